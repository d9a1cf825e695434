"""Profiling, run reports and the planner's cost model."""

"""Traces and profiles of chosen training steps: the pipeline's instruction timeline
(--pipe-trace: the last step; with plots, the profile window's first step too) and
torch.profiler over the profile window (--profile / seekspeed.report.profile)."""

import os
import time

from .errors import SeekspeedError
from .log import rank0_log


class StepTrace:
    """Call ``before_step`` and ``after_step`` around each optimizer step (all ranks:
    a traced step starts at a barrier and ends with a gather)."""

    def __init__(self, plan, engine, control, *, pipe_trace, start, rank, stage, dp_rank):
        s, layout = plan.section, plan.layout
        self.engine, self.control, self.rank, self.stage, self.dp_rank = engine, control, rank, stage, dp_rank
        self.pipe_trace, self.start, self.total, self.plots = pipe_trace, start, s.train.steps, s.report.plots
        self.title = f"{s.schedule}, {layout.pipe_stages} stages, {layout.grad_accum} micro-batches"
        self.window = _profile_window(plan, start=start, rank=rank)
        self._trace_dir, self._origin = None, None

    def before_step(self, step):
        window = self.window
        trace_dir = self.pipe_trace if self.pipe_trace and step == self.total else None
        if window is not None and step == max(window.first, self.start + 1) and self.plots:
            trace_dir = trace_dir or window.out_dir     # before the profiler starts: its barrier stays out
        self._trace_dir = trace_dir
        if trace_dir:
            from deepspeed import comm as dist
            from .pipe.engine import InstructionTimeline
            dist.barrier()
            self._origin = time.perf_counter()
            self.engine.timeline = InstructionTimeline()
        if window is not None:
            window.before_step(step)

    def after_step(self, step):
        window = self.window
        if window is not None and step == window.last:
            error = None
            try:
                window.after_step(step)
            except OSError as exc:
                error = SeekspeedError(str(exc))
            self.control.stop_if_any_failed(error, rank=self.rank)
        if self._trace_dir:
            self._write_pipe_trace(self._trace_dir, title=f"{self.title}, step {step}")

    def _write_pipe_trace(self, directory, *, title):
        """Gather the traced step's instruction times of data-parallel replica 0 (one lane
        per pipeline stage; times from the barrier just before the step) and write them."""
        from .pipe.trace import from_engine_events, plot_timeline, write_chrome_trace
        engine = self.engine
        events = from_engine_events(engine.timeline.events, origin=self._origin) if self.dp_rank == 0 else None
        engine.timeline = None
        lanes = self.control.gather((self.stage, events))
        if self.rank != 0:
            return
        lanes = [e for _, e in sorted((s, e) for s, e in lanes if e is not None)]
        os.makedirs(directory, exist_ok=True)
        write_chrome_trace(lanes, os.path.join(directory, "pipeline_trace.json"), name=title)
        plot_timeline(lanes, os.path.join(directory, "pipeline_timeline.png"), title=title)
        print(f"pipeline trace: {directory}/pipeline_trace.json, {directory}/pipeline_timeline.png", flush=True)


def _profile_window(plan, *, start, rank):
    """The plan's profile window on this rank, or None; says so when a resumed run
    starts after it."""
    if plan.profile is None:
        return None
    from .profile.window import ProfileWindow
    first, last, text = plan.profile.first, plan.profile.last, plan.profile.text
    if last <= start and rank == 0:
        print(f"profile: window {text} lies before the resumed step {start}; nothing is profiled", flush=True)
    return ProfileWindow(first, last, out_dir=os.path.join(plan.report_dir, "profile"), rank=rank,
                         log=rank0_log(rank))

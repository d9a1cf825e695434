"""seekspeed's extensions to DeepSpeed: config section, pipeline schedules, data,
training loop (and, as they land: gradient compression, topology, checkpointing)."""

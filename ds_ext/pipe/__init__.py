"""Pipeline schedules, chosen by ``seekspeed.schedule``; each is one entry of the
registry (ds_ext/pipe/registry.py), which holds its facts.

- ``1f1b``: DeepSpeed's TrainSchedule on a PipelineModule.
- ``dualpipev``: DeepSpeed's own DualPipeV (DualPipeVModule + DualPipeVEngine); each
  pipeline rank holds two stages, so the model is cut into 2 x stages parts.
- ``dualpipev-zb``: DualPipeV with zero-bubble weight-gradient deferral, F&B chunks and
  point-to-point transfers overlapped with compute (ds_ext/pipe/engine.py).
- ``dualpipe``: bidirectional DualPipe; each rank holds stage r and a copy of stage
  R-1-r (ds_ext/pipe/dualpipe.py). Even pipeline degree only.

The functions and tuples below read the registry, for callers that hold a name.
"""

from .registry import REGISTRY, Schedule, schedule_spec

__all__ = ["REGISTRY", "SCHEDULES", "LAYER_OVERLAP_SCHEDULES", "Schedule", "schedule_spec", "check_schedule",
           "pipeline_module_class", "virtual_stages", "check_micro_batches", "rank_chunks", "data_stages"]

SCHEDULES = tuple(REGISTRY)
# the schedules whose F&B chunks overlap "layer" can interleave (ds_ext/pipe/overlap.py)
LAYER_OVERLAP_SCHEDULES = tuple(name for name, s in REGISTRY.items() if s.layer_overlap)


def pipeline_module_class(schedule):
    """DeepSpeed's module class for ``schedule``, reporting the loss function's parts
    (language-model and MTP loss) through DeepSpeed's get_additional_losses."""
    return schedule_spec(schedule).module_class()


def check_schedule(schedule):
    return schedule_spec(schedule).name


def virtual_stages(schedule, stages):
    """How many parts the layer list is cut into."""
    return schedule_spec(schedule).virtual_stages(stages)


def check_micro_batches(schedule, *, stages, micro_batches):
    """Schedules' constraints on gradient accumulation, checked before DeepSpeed starts."""
    schedule_spec(schedule).check(stages=stages, micro_batches=micro_batches)


def rank_chunks(schedule, *, rank, stages):
    """Which parts of the layer list (as ``virtual_stages`` cuts it) pipeline rank
    ``rank`` holds: its stage; for the V schedules also part 2 x stages - 1 - rank;
    for dualpipe a copy of stage stages - 1 - rank."""
    return schedule_spec(schedule).rank_chunks(rank=rank, stages=stages)


def data_stages(schedule, stages):
    """Pipeline stage ids whose ranks read training data (inputs and/or labels)."""
    return schedule_spec(schedule).data_stages(stages)

"""Pipeline schedules, chosen by ``seekspeed.schedule``.

- ``1f1b``: DeepSpeed's TrainSchedule on a PipelineModule.
- ``dualpipev``: DeepSpeed's own DualPipeV (DualPipeVModule + DualPipeVEngine); each
  pipeline rank holds two stages, so the model is cut into 2 x stages parts.
- ``dualpipev-zb``: DualPipeV with zero-bubble weight-gradient deferral, F&B chunks and
  point-to-point transfers overlapped with compute (ds_ext/pipe/engine.py).
- ``dualpipe``: bidirectional DualPipe; each rank holds stage r and a copy of stage
  R-1-r (ds_ext/pipe/dualpipe.py). Even pipeline degree only.
"""

from ds_ext.errors import ConfigError

SCHEDULES = ("1f1b", "dualpipev", "dualpipev-zb", "dualpipe")
# on SeekspeedDualPipeVEngine: zero-bubble W slots, and F&B chunks that overlap "layer"
# can interleave (ds_ext/pipe/overlap.py)
ZERO_BUBBLE_SCHEDULES = ("dualpipev-zb", "dualpipe")
DUALPIPEV_FAMILY = ("dualpipev", "dualpipev-zb")


_CLASSES = {}


def pipeline_module_class(schedule):
    """DeepSpeed's module class for ``schedule``, reporting the loss function's parts
    (language-model and MTP loss) through DeepSpeed's get_additional_losses."""
    if not _CLASSES:
        from deepspeed.pipe import PipelineModule
        from deepspeed.runtime.pipe.dualpipev import DualPipeVModule

        class _ReportsLossParts:

            def __init__(self, *args, partition_bounds=None, **kwargs):
                # read by _PresetCut while PipelineModule.__init__ partitions
                object.__setattr__(self, "_preset_bounds", partition_bounds)
                super().__init__(*args, **kwargs)

            def get_additional_losses(self):
                parts = getattr(self.loss_fn, "additional_losses", None)
                return parts() if parts is not None else None

        from .overlap import PerThread, switch

        class _FastPhaseSwitch:
            """DualPipeV switches phase around every compute instruction; its plain
            attributes need not go through nn.Module.__setattr__'s module/parameter
            bookkeeping (several hundred calls per step). They are per thread while an
            F&B chunk is interleaved (ds_ext/pipe/overlap.py): its forward and backward
            halves run different phases at the same time."""

            active_phase = PerThread()
            forward_funcs = PerThread()
            is_checkpointable_results = PerThread()
            _local_start = PerThread()
            _local_stop = PerThread()
            curr_layer = PerThread()

            def forward(self, forward_input):
                # an interleaved F&B chunk's forward half lets the backward half go first
                # once DeepSpeed's forward prologue has run: the backward's first
                # all-to-all (a combine's) then runs behind the forward's attention
                switch()
                return super().forward(forward_input)

            def activate_phase(self, phase):
                set_ = object.__setattr__
                set_(self, "active_phase", phase)
                set_(self, "forward_funcs", self.phase_funcs[phase])
                set_(self, "is_checkpointable_results", self.phase_checkpointable[phase])
                start, stop = self.phase_bounds[phase]
                set_(self, "_local_start", start)
                set_(self, "_local_stop", stop)

        class _PresetCut(PipelineModule):
            """``partition_method="balanced"``: the boundaries ``partition_bounds`` (cut by
            ds_ext.profile.plan from the planner's per-layer costs) become DeepSpeed's
            ``parts``; every other method is DeepSpeed's. Sits right above PipelineModule,
            so DualPipeVModule's doubling of the stages and its phase bounds still apply."""

            def _partition_layers(self, method="uniform"):
                if method.lower() != "balanced":
                    return super()._partition_layers(method)
                bounds = self._preset_bounds
                if bounds is None or len(bounds) != self.num_stages + 1 or bounds[-1] != len(self._layer_specs):
                    raise ValueError(f"partition 'balanced' needs partition_bounds: {self.num_stages + 1} boundaries "
                                     f"of {len(self._layer_specs)} layers, got {bounds}")
                self.parts = [int(b) for b in bounds]
                if self.global_rank == 0:
                    print("balanced partition (planner costs): "
                          + ", ".join(f"stage {p}: layers [{self.parts[p]},{self.parts[p + 1]})"
                                      for p in range(self.num_stages)), flush=True)
                stage_id = self._topo.get_coord(self.global_rank).pipe
                self._set_bounds(start=self.parts[stage_id], stop=self.parts[stage_id + 1])

        _CLASSES["1f1b"] = type("SeekspeedPipelineModule", (_ReportsLossParts, _PresetCut), {})
        _CLASSES["dualpipev"] = type("SeekspeedDualPipeVModule", (_ReportsLossParts, _FastPhaseSwitch,
                                                                  DualPipeVModule, _PresetCut), {})
        _CLASSES["dualpipev-zb"] = _CLASSES["dualpipev"]
        from .dualpipe import DualPipeModule
        _CLASSES["dualpipe"] = type("SeekspeedDualPipeModule", (_ReportsLossParts, _FastPhaseSwitch, DualPipeModule,
                                                                _PresetCut), {})
    return _CLASSES[check_schedule(schedule)]


def check_schedule(schedule):
    if schedule not in SCHEDULES:
        raise ConfigError(f"seekspeed.schedule: unknown schedule {schedule!r}; choose one of {list(SCHEDULES)}")
    return schedule


def virtual_stages(schedule, stages):
    """How many parts the layer list is cut into."""
    return 2 * stages if check_schedule(schedule) in DUALPIPEV_FAMILY else stages


def check_micro_batches(schedule, *, stages, micro_batches):
    """Schedules' constraints on gradient accumulation, checked before DeepSpeed starts."""
    if schedule == "dualpipe":
        if stages % 2:
            raise ConfigError(f"dualpipe pairs rank r with rank R-1-r, so it needs an even pipeline.stages, got "
                              f"{stages}: use an even degree or schedule dualpipev-zb")
        if micro_batches % 2 or micro_batches < 2 * stages:
            raise ConfigError(f"dualpipe sends half of the micro-batches each way and needs an even "
                              f"gradient_accumulation_steps >= 2 x pipeline.stages ({2 * stages}), got {micro_batches}")
    if schedule in DUALPIPEV_FAMILY and micro_batches < 2 * stages:
        raise ConfigError(f"{schedule} needs gradient_accumulation_steps >= 2 x pipeline.stages "
                          f"({2 * stages}), got {micro_batches}: raise gradient_accumulation_steps "
                          f"(train_batch_size) or use schedule 1f1b")


def rank_chunks(schedule, *, rank, stages):
    """Which parts of the layer list (as ``virtual_stages`` cuts it) pipeline rank
    ``rank`` holds: its stage; for the V schedules also part 2 x stages - 1 - rank;
    for dualpipe a copy of stage stages - 1 - rank."""
    if check_schedule(schedule) in DUALPIPEV_FAMILY:
        return [rank, 2 * stages - 1 - rank]
    if schedule == "dualpipe":
        return [rank, stages - 1 - rank]
    return [rank]


def data_stages(schedule, stages):
    """Pipeline stage ids whose ranks read training data (inputs and/or labels)."""
    if schedule in DUALPIPEV_FAMILY:
        return {0}  # rank 0 holds both the first stage and the loss stage
    return {0, stages - 1}

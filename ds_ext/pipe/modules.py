"""seekspeed's PipelineModule classes, one per way a rank holds the layer list; the
schedule registry (ds_ext/pipe/registry.py) names which one each schedule builds.
Each reports the loss function's parts (language-model and MTP loss) through
DeepSpeed's get_additional_losses and takes the planner's balanced cut."""

from deepspeed.pipe import PipelineModule
from deepspeed.runtime.pipe.dualpipev import DualPipeVModule

from .dualpipe import DualPipeModule
from .overlap import PerThread, switch


class _ReportsLossParts:
    """The loss function's parts through get_additional_losses; ``partition_bounds``
    kept for _PresetCut."""

    def __init__(self, *args, partition_bounds=None, **kwargs):
        # read by _PresetCut while PipelineModule.__init__ partitions
        object.__setattr__(self, "_preset_bounds", partition_bounds)
        super().__init__(*args, **kwargs)

    def get_additional_losses(self):
        parts = getattr(self.loss_fn, "additional_losses", None)
        return parts() if parts is not None else None


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
    ds_ext.planner from the planner's per-layer costs) become DeepSpeed's
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


class SeekspeedPipelineModule(_ReportsLossParts, _PresetCut):
    """One stage per rank (1f1b)."""


class SeekspeedDualPipeVModule(_ReportsLossParts, _FastPhaseSwitch, DualPipeVModule, _PresetCut):
    """DeepSpeed's DualPipeVModule: two parts per rank (dualpipev, dualpipev-zb)."""


class SeekspeedDualPipeModule(_ReportsLossParts, _FastPhaseSwitch, DualPipeModule, _PresetCut):
    """Stage r and a copy of stage R-1-r per rank (dualpipe)."""

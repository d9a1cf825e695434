"""The pipeline schedules, one ``Schedule`` entry each in ``REGISTRY``.

An entry holds every fact about its schedule that seekspeed asks: how the layer list
is cut and which parts each rank holds, which ranks read data, the module, engine and
instruction-stream classes (named ``"module:Class"``, imported when asked for, since
importing DeepSpeed is slow), whether it defers weight gradients to W slots, whether
overlap "layer" can interleave its F&B chunks, its constraints on the layout with
their messages, and what the simulator and the planner read. Config validation, the
engine, the simulator, the planner and its sweep ask the entry
(``schedule_spec(name).virtual_stages(stages)``, ``.zero_bubble``, ...) and never
compare schedule names.

Adding a schedule means adding one entry to ``REGISTRY`` (and writing the classes it
names); nothing else changes.
"""

import importlib
from dataclasses import dataclass
from typing import Callable

from ds_ext.errors import ConfigError


# ---- which parts of the layer list rank ``rank`` of ``stages`` holds, in phase order ---

def own_stage(rank, stages):
    """Stage ``rank`` only (1F1B)."""
    return [rank]


def v_shape(rank, stages):
    """Part ``rank`` on the way down and part ``2 x stages - 1 - rank`` on the way back
    (DualPipeV: 2 x stages parts)."""
    return [rank, 2 * stages - 1 - rank]


def mirrored_copy(rank, stages):
    """Stage ``rank`` for direction 0 and a copy of stage ``stages - 1 - rank`` for
    direction 1 (DualPipe: stages parts, each held by two ranks)."""
    return [rank, stages - 1 - rank]


# ---- constraints: (schedule, *, stages, micro_batches) -> error message, or None ------

def two_micro_batches_per_stage(schedule, *, stages, micro_batches):
    if micro_batches < 2 * stages:
        return (f"{schedule} needs gradient_accumulation_steps >= 2 x pipeline.stages ({2 * stages}), got "
                f"{micro_batches}: raise gradient_accumulation_steps (train_batch_size) or use schedule 1f1b")
    return None


def even_stages(schedule, *, stages, micro_batches):
    if stages % 2:
        return (f"{schedule} pairs rank r with rank R-1-r, so it needs an even pipeline.stages, got {stages}: "
                f"use an even degree or schedule dualpipev-zb")
    return None


def even_micro_batches_each_way(schedule, *, stages, micro_batches):
    if micro_batches % 2 or micro_batches < 2 * stages:
        return (f"{schedule} sends half of the micro-batches each way and needs an even gradient_accumulation_steps "
                f">= 2 x pipeline.stages ({2 * stages}), got {micro_batches}")
    return None


# ---- precision constraints: (schedule, *, model, accum) -> error message, or None -----
# checked when the weights' dtype ``model`` and the accumulation dtype ``accum`` differ
# (ZeRO stage 1 by then)

def bf16_optimizer_only(schedule, *, model, accum):
    if (model, accum) != ("bf16", "fp32"):
        return (f"schedule {schedule} does not support {model} weights with data_types.grad_accum_dtype {accum} "
                f"(ZeRO-1 keeps those gradients in a buffer the stage-copy sum does not read): remove "
                f"data_types.grad_accum_dtype, use bf16 with fp32, or schedule dualpipev-zb")
    return None


# ---- the DualPipe README's bubble formulas, F, B, W, F&B per stage chunk --------------

def one_f_one_b_bubble(*, ranks, F, B, W, FB):
    return (ranks - 1) * (F + B)


def dualpipev_zb_bubble(*, ranks, F, B, W, FB):
    return (ranks - 1) * (FB + B - 3 * W)            # PP = 2 x ranks


def dualpipe_bubble(*, ranks, F, B, W, FB):
    return (ranks / 2 - 1) * (FB + B - 3 * W)


@dataclass(frozen=True)
class SimMap:
    """How the simulator (ds_ext/pipe/simulate.py) reads the entry's instruction
    stream. An instruction of ``phase`` on rank r runs virtual stage
    ``rank_chunks(rank=r, stages=ranks)[phase]``."""
    # True: an instruction's micro-batch is its buffer id modulo the micro-batches per
    # direction; False: the k-th forward (backward) of a rank is micro-batch k (1F1B's
    # buffers are reused cyclically)
    by_buffer: bool = True
    # 2: each phase is a direction of travel with its own copy of the model (dualpipe)
    directions: int = 1


def _load(ref):
    module, _, name = ref.partition(":")
    return getattr(importlib.import_module(module), name)


@dataclass(frozen=True, kw_only=True)
class Schedule:
    """One schedule's facts (see the module docstring); ``name`` is its
    ``seekspeed.schedule`` value."""
    name: str
    # layout
    virtual_per_rank: int       # parts of the layer list per pipeline rank: 1, or 2 (V schedules)
    chunks: Callable            # (rank, stages) -> the parts the rank holds, in phase order
    constraints: tuple = ()     # (schedule, *, stages, micro_batches) -> message or None, in order
    precision_constraints: tuple = ()   # (schedule, *, model, accum) -> message or None
    # classes, "module:Class"
    module: str                 # the PipelineModule subclass a recipe builds
    engine: str                 # the engine class ds_ext.pipe.engine.initialize installs (with its mixins)
    instructions: str           # the instruction stream the engine runs: cls(micro_batches, stages, stage_id)
    # behaviour
    zero_bubble: bool = False   # backward chunks defer weight gradients to W slots
    layer_overlap: bool = False  # has F&B chunks that overlap "layer" interleaves (ds_ext/pipe/overlap.py)
    async_p2p: bool = False     # point-to-point transfers posted asynchronously (SeekspeedDualPipeVEngine)
    # simulator and planner
    sim: SimMap = SimMap()
    bubble_formula: Callable | None = None   # (*, ranks, F, B, W, FB) -> the README's bubble
    # the planner's pipeline traffic, 2 x micro-batches x activation bytes x (stages - 1) x link_passes:
    # 2 for the V schedules (down the ranks and back up) and for dualpipe
    link_passes: int = 1
    one_stage: bool = False     # the planner's sweep tries it with pipeline.stages 1

    def virtual_stages(self, stages):
        """How many parts the layer list is cut into."""
        return self.virtual_per_rank * stages

    def rank_chunks(self, *, rank, stages):
        """Which parts of the layer list (as ``virtual_stages`` cuts it) pipeline rank
        ``rank`` holds, in phase order."""
        return self.chunks(rank, stages)

    def data_stages(self, stages):
        """Pipeline stage ids whose ranks read training data: those holding the first
        part (inputs) or the last (labels)."""
        ends = {0, self.virtual_stages(stages) - 1}
        return {r for r in range(stages) if ends & set(self.chunks(r, stages))}

    def check(self, *, stages, micro_batches):
        """The constraints on the pipeline degree and gradient accumulation."""
        for constraint in self.constraints:
            message = constraint(self.name, stages=stages, micro_batches=micro_batches)
            if message:
                raise ConfigError(message)

    def check_precision(self, *, model, accum):
        """The constraints on weights' dtype ``model`` and accumulation dtype ``accum``
        when they differ."""
        for constraint in self.precision_constraints:
            message = constraint(self.name, model=model, accum=accum)
            if message:
                raise ConfigError(message)

    def module_class(self):
        return _load(self.module)

    def engine_class(self):
        return _load(self.engine)

    def instruction_class(self):
        return _load(self.instructions)


_DS_SCHEDULE = "deepspeed.runtime.pipe.schedule"

REGISTRY = {s.name: s for s in (
    # DeepSpeed's TrainSchedule on a PipelineModule
    Schedule(name="1f1b", virtual_per_rank=1, chunks=own_stage,
             module="ds_ext.pipe.modules:SeekspeedPipelineModule",
             engine="ds_ext.pipe.engine:SeekspeedPipelineEngine",
             instructions=f"{_DS_SCHEDULE}:TrainSchedule",
             sim=SimMap(by_buffer=False), bubble_formula=one_f_one_b_bubble, one_stage=True),
    # DeepSpeed's own DualPipeV (DualPipeVModule + DualPipeVEngine)
    Schedule(name="dualpipev", virtual_per_rank=2, chunks=v_shape, constraints=(two_micro_batches_per_stage,),
             module="ds_ext.pipe.modules:SeekspeedDualPipeVModule",
             engine="ds_ext.pipe.engine:SeekspeedDualPipeVEngineAsIs",
             instructions=f"{_DS_SCHEDULE}:DualPipeVSchedule", link_passes=2),
    # DualPipeV with zero-bubble W slots, F&B chunks and asynchronous transfers
    Schedule(name="dualpipev-zb", virtual_per_rank=2, chunks=v_shape, constraints=(two_micro_batches_per_stage,),
             module="ds_ext.pipe.modules:SeekspeedDualPipeVModule",
             engine="ds_ext.pipe.engine:SeekspeedDualPipeVEngine",
             instructions="ds_ext.pipe.schedules:DualPipeVZBSchedule",
             zero_bubble=True, layer_overlap=True, async_p2p=True,
             bubble_formula=dualpipev_zb_bubble, link_passes=2),
    # bidirectional DualPipe (ds_ext/pipe/dualpipe.py)
    Schedule(name="dualpipe", virtual_per_rank=1, chunks=mirrored_copy,
             constraints=(even_stages, even_micro_batches_each_way), precision_constraints=(bf16_optimizer_only,),
             module="ds_ext.pipe.modules:SeekspeedDualPipeModule",
             engine="ds_ext.pipe.engine:SeekspeedDualPipeEngine",
             instructions="ds_ext.pipe.dualpipe:DualPipeSchedule",
             zero_bubble=True, layer_overlap=True, async_p2p=True,
             sim=SimMap(directions=2), bubble_formula=dualpipe_bubble, link_passes=2),
)}


def schedule_spec(name, *, where="seekspeed.schedule"):
    """The registry entry of schedule ``name``; an unknown name is a ConfigError that
    lists the schedules (``where`` names the config key)."""
    spec = REGISTRY.get(name) if isinstance(name, str) else None
    if spec is None:
        raise ConfigError(f"{where}: unknown schedule {name!r}; choose one of {list(REGISTRY)}")
    return spec

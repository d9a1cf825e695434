"""The parallel layout a DeepSpeed config implies on ``world_size`` ranks (pipeline x
data parallel, DeepSpeed's own batch arithmetic) and the checks of DeepSpeed's keys
that depend on it."""

import difflib
from dataclasses import dataclass

from .errors import ConfigError
from .pipe import check_micro_batches, check_schedule
from .grad_norm import check_grad_norm
from .muon import check_muon_update
from .precision import check_dispatch_dtype, check_precision
from .sections import SECTION


@dataclass(kw_only=True)
class Layout:
    """How ``world_size`` ranks split into pipeline stages and data-parallel replicas,
    and the batch arithmetic DeepSpeed will use."""
    world_size: int
    pipe_stages: int
    data_parallel: int
    micro_batch: int
    grad_accum: int
    train_batch: int
    seq_len: int
    schedule: str

    @property
    def tokens_per_step(self):
        return self.train_batch * self.seq_len

    def describe(self):
        return (f"{self.world_size} ranks = {self.pipe_stages} pipeline stages x {self.data_parallel} data-parallel; "
                f"global batch {self.train_batch} = micro-batch {self.micro_batch} x {self.grad_accum} accumulation "
                f"x {self.data_parallel} replicas; {self.tokens_per_step:,} tokens/step; schedule {self.schedule}")


PIPELINE_KEYS = ("stages", "partition", "seed_layers", "activation_checkpoint_interval", "pipe_partitioned",
                 "grad_partitioned", "use_reentrant")

# Top-level keys DeepSpeed reads through .keys() or outside DeepSpeedConfig, which the
# recording dict below cannot see.
_TOP_LEVEL_KEYS = {"optimizer", "scheduler", "activation_checkpointing", "flops_profiler", "aio", "autotuning",
                   "tensorboard", "wandb", "csv_monitor", "comet", "data_efficiency", "torch_autocast",
                   "zero_optimization", "elasticity", "compression_training", "weight_quantization",
                   "sequence_parallel_size", "checkpoint", "data_types", "fp16", "bf16", "amp"}


def _object(ds, key, *, path):
    """ds[key] as a dict ({} when absent); anything else is a one-line error."""
    value = ds.get(key, {})
    if not isinstance(value, dict):
        raise ConfigError(f"{path}: {key!r} must be an object, got {value!r}")
    return value


def pipeline_stages(ds, *, path="config"):
    pipeline = _object(ds, "pipeline", path=path)
    unknown = sorted(set(pipeline) - set(PIPELINE_KEYS))
    if unknown:
        key = unknown[0]
        close = difflib.get_close_matches(key, PIPELINE_KEYS, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ConfigError(f"{path}: pipeline.{key} is not a DeepSpeed pipeline key{hint}; allowed: {list(PIPELINE_KEYS)}")
    stages = pipeline.get("stages", 1)
    if stages == "auto" or not isinstance(stages, int) or isinstance(stages, bool) or stages < 1:
        raise ConfigError(f"{path}: pipeline.stages must be a positive integer (the pipeline degree), "
                          f"got {stages!r}")
    interval = pipeline.get("activation_checkpoint_interval", 0)
    if not isinstance(interval, int) or isinstance(interval, bool) or interval < 0:
        raise ConfigError(f"{path}: pipeline.activation_checkpoint_interval must be an integer >= 0 "
                          f"(0 = off, N = checkpoint every N layers), got {interval!r}")
    partition = pipeline.get("partition", "best")
    if not isinstance(partition, str):
        raise ConfigError(f"{path}: pipeline.partition must be a string such as 'type:DecoderLayerPipe', "
                          f"got {partition!r}")
    return stages


def _deepspeed_batch_config(param_dict, data_parallel):
    """DeepSpeed's own config parser, resolving batch sizes for ``data_parallel``
    replicas whether or not a process group exists yet."""
    from deepspeed.runtime.config import DeepSpeedConfig

    class _Resolver(DeepSpeedConfig):

        def _configure_train_batch_size(self):
            self.world_size = data_parallel
            super()._configure_train_batch_size()

    return _Resolver(param_dict)


class _RecordingDict(dict):
    """Records which top-level keys DeepSpeed's config parser looks up."""

    def __init__(self, *args):
        super().__init__(*args)
        self.seen = set()

    def get(self, key, *default):
        self.seen.add(key)
        return super().get(key, *default)

    def __getitem__(self, key):
        self.seen.add(key)
        return super().__getitem__(key)

    def __contains__(self, key):
        self.seen.add(key)
        return super().__contains__(key)


def check_momentum_target(ds, comm, where="seekspeed.comm"):
    """``target: "momentum"`` sends Adam's momentum: the config's optimizer must be
    Adam or AdamW (install.check_momentum_optimizer checks the instance too)."""
    if comm.target != "momentum":
        return
    opt = ds.get("optimizer") or {}
    kind = str(opt.get("type", "")).lower()
    if kind not in ("adam", "adamw"):
        raise ConfigError(f"{where}.target 'momentum' freezes Adam's second moment and sends its momentum, and the "
                          f"optimizer is {opt.get('type') or 'none (a client optimizer)'!s}: set optimizer.type to "
                          f"AdamW (or Adam), or set {where}.target 'gradient'")
    params = opt.get("params") or {}
    if kind == "adam" and params.get("weight_decay") and params.get("adam_w_mode") is False:
        raise ConfigError(f"{where}.target 'momentum' with Adam's L2 weight decay (adam_w_mode false: the decay goes "
                          f"into the gradient, so into the momentum each rank sends): use AdamW or weight_decay 0")
    if (ds.get("zero_optimization") or {}).get("offload_optimizer"):
        raise ConfigError(f"{where}.target 'momentum' replaces the step of the Adam DeepSpeed runs on the device; "
                          f"zero_optimization.offload_optimizer runs DeepSpeedCPUAdam's instead: remove the offload or "
                          f"set {where}.target 'gradient'")


def check_overlap_grad_reduce(ds, section, *, zero):
    """The combinations ``seekspeed.overlap_grad_reduce`` cannot run, refused in one line."""
    if not section.overlap_grad_reduce:
        return
    zero_cfg = ds.get("zero_optimization", {})
    if zero == 1 and zero_cfg.get("overlap_comm") is True:
        raise ConfigError("seekspeed.overlap_grad_reduce with zero_optimization.overlap_comm true: ZeRO's own "
                          "overlap reduces from backward hooks, which a pipeline never runs at the boundary; set "
                          "zero_optimization.overlap_comm false (seekspeed overlaps the reduction itself)")


def resolve_layout(ds, *, world_size, section, path="config"):
    """The parallel layout, the warnings about keys DeepSpeed will ignore and the op
    builders DeepSpeed's optimizer loads.

    Batch sizes are resolved by DeepSpeed's own ``DeepSpeedConfig`` for the
    data-parallel size, so what is checked here is what the engine will do.
    """
    stages = pipeline_stages(ds, path=path)
    if world_size % stages:
        raise ConfigError(f"world size {world_size} is not divisible by pipeline.stages {stages}: "
                          f"launch a multiple of {stages} ranks or change pipeline.stages")
    dp = world_size // stages
    for key in ("zero_optimization", "scheduler", "optimizer", "bf16", "fp16", "data_types"):
        _object(ds, key, path=path)
    for key in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"):
        value = ds.get(key)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise ConfigError(f"{path}: {key} must be a positive integer, got {value!r}")
    from . import ds_keys
    ds_keys.check_pydantic_sections(ds)
    zero = ds.get("zero_optimization", {}).get("stage", 0)
    if zero not in (0, 1) or isinstance(zero, bool):
        raise ConfigError(f"zero_optimization.stage {zero!r} cannot be used with DeepSpeed's pipeline engine: "
                          f"use stage 0 or 1")
    recorder = _RecordingDict({k: v for k, v in ds.items() if k != SECTION})
    try:
        resolved = _deepspeed_batch_config(recorder, dp)
    except AssertionError as exc:
        micro = ds.get("train_micro_batch_size_per_gpu")
        gas = ds.get("gradient_accumulation_steps")
        hint = (f"set train_batch_size to {micro * gas * dp} (= micro-batch {micro} x accumulation {gas} x "
                f"{dp} data-parallel replicas)" if isinstance(micro, int) and isinstance(gas, int) else
                "make train_batch_size = train_micro_batch_size_per_gpu x gradient_accumulation_steps x "
                f"data-parallel size ({dp})")
        raise ConfigError(f"batch sizes do not fit {world_size} ranks ({stages} stages x {dp} data-parallel): "
                          f"{' '.join(str(exc).split())}; {hint}") from None
    except Exception as exc:  # DeepSpeed's parser: TypeError, pydantic ValidationError, ...
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
        raise ConfigError(f"{path}: DeepSpeed rejects the config ({type(exc).__name__}: {' | '.join(lines[:3])})"
                          f"; fix the DeepSpeed keys named there") from None
    compiled_ops = ds_keys.check(ds, resolved=resolved)
    layout = Layout(world_size=world_size, pipe_stages=stages, data_parallel=dp,
                    micro_batch=resolved.train_micro_batch_size_per_gpu,
                    grad_accum=resolved.gradient_accumulation_steps, train_batch=resolved.train_batch_size,
                    seq_len=section.data.seq_len, schedule=check_schedule(section.schedule))
    if layout.train_batch != layout.micro_batch * layout.grad_accum * dp or layout.grad_accum < 1:
        raise ConfigError(f"batch sizes do not fit {world_size} ranks: train_batch_size {layout.train_batch} is not "
                          f"micro-batch {layout.micro_batch} x accumulation {layout.grad_accum} x {dp} replicas")
    check_micro_batches(layout.schedule, stages=stages, micro_batches=layout.grad_accum)
    check_precision(ds, schedule=layout.schedule, zero=zero)
    check_momentum_target(ds, section.comm)
    check_dispatch_dtype(ds, section.moe)
    check_overlap_grad_reduce(ds, section, zero=zero)
    check_grad_norm(ds, section, zero=zero)
    check_muon_update(ds, section)
    ep = section.moe.expert_parallel_size
    if dp % ep:
        raise ConfigError(f"seekspeed.moe.expert_parallel_size {ep} does not divide the data-parallel size {dp} "
                          f"({world_size} ranks / {stages} stages): choose a divisor of {dp}")
    if section.moe.balance_loss_alpha > 0 and ds.get("fp16", {}).get("enabled", False):
        raise ConfigError("seekspeed.moe.balance_loss_alpha > 0 is not supported with fp16 (its gradient would miss "
                          "the loss scale): use bf16 or fp32, or set balance_loss_alpha to 0")

    known = recorder.seen | _TOP_LEVEL_KEYS | {SECTION}
    warnings = []
    for key in ds:
        if key not in known:
            close = difflib.get_close_matches(key, sorted(known), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            warnings.append(f"top-level key {key!r} is not a DeepSpeed key; DeepSpeed will ignore it{hint}")
    return layout, warnings, compiled_ops

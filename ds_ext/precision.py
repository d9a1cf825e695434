"""The dtypes a DeepSpeed config trains in (weights, gradient accumulation), as
DeepSpeed resolves them, and which of them DeepSpeed and the schedule can train with."""

from .errors import ConfigError
from .muon import uses_muon
from .pipe import schedule_spec


def mixed_precision(ds):
    """Whether the DeepSpeed config trains in bf16 or fp16."""
    return bool(ds.get("bf16", {}).get("enabled", False) or ds.get("fp16", {}).get("enabled", False))


def fp32_grad_accumulation(ds):
    """Whether DeepSpeed accumulates gradients in fp32: fp32 training, or
    ``data_types.grad_accum_dtype: fp32`` under bf16/fp16."""
    return not mixed_precision(ds) or _grad_accum_is_fp32(ds)


def _grad_accum_is_fp32(ds):
    """``data_types.grad_accum_dtype`` names fp32 in any of DeepSpeed's spellings
    (fp32, float32, float, torch.float32); resolve_layout has checked it is one."""
    from deepspeed.runtime.config import DtypeEnum
    value = ds.get("data_types", {}).get("grad_accum_dtype")
    return value is not None and DtypeEnum(value) is DtypeEnum.fp32


def _dtypes(ds):
    """(weights' dtype, gradient accumulation dtype), as DeepSpeed's get_data_types
    resolves them: each "fp32", "bf16" or "fp16"."""
    from deepspeed.runtime.config import DtypeEnum
    model = ("fp16" if ds.get("fp16", {}).get("enabled", False) else
             "bf16" if ds.get("bf16", {}).get("enabled", False) else "fp32")
    value = ds.get("data_types", {}).get("grad_accum_dtype")
    return model, model if value is None else DtypeEnum(value).name


def check_precision(ds, *, schedule, zero):
    """The weights' and accumulation dtypes DeepSpeed and the schedule can train with."""
    model, accum = _dtypes(ds)
    spec = schedule_spec(schedule)
    if model == "bf16" and ds["bf16"].get("immediate_grad_update") is True and spec.zero_bubble:
        raise ConfigError(f"bf16.immediate_grad_update true does not work with schedule {schedule}: its W slots add "
                          f"the deferred weight gradients outside autograd, where the BF16 optimizer's hooks never "
                          f"see them: set bf16.immediate_grad_update false, or use schedule 1f1b or dualpipev")
    if uses_muon(ds) and model == "bf16" and (zero == 0 or accum == "fp32"):
        # DeepSpeed's engine wraps bf16 in its BF16 optimizer here, which takes Muon only
        # without a pipeline and without MoE layers, and stops at start-up otherwise
        raise ConfigError(f"optimizer.type Muon with bf16 weights and {accum} accumulation under ZeRO stage {zero}: "
                          f"DeepSpeed's BF16 optimizer runs Muon only without a pipeline or MoE: set "
                          f"zero_optimization.stage 1 with bf16 accumulation (remove data_types.grad_accum_dtype), "
                          f"or use optimizer AdamW")
    if accum == model:
        return
    bf16_optimizer = (model, accum) == ("bf16", "fp32")
    if zero == 0:
        raise ConfigError(f"data_types.grad_accum_dtype {accum} with {model} weights needs ZeRO stage 1 (DeepSpeed's "
                          f"stage 0 accumulates in the weights' dtype only and stops with 'unsupported mix'): set "
                          f"zero_optimization.stage 1{' (BF16 optimizer)' if bf16_optimizer else ''} or remove "
                          f"data_types.grad_accum_dtype")
    spec.check_precision(model=model, accum=accum)


_DTYPE_NAMES = {"fp32": ("fp32", "float32"), "bf16": ("bf16", "bfloat16"), "fp16": ("fp16", "float16")}


def check_dispatch_dtype(ds, moe, where="seekspeed.moe"):
    """``moe.dispatch_dtype``: unset, the activation dtype's name, or "fp8"; returns the
    layer's payload (None for the activation dtype, or "fp8")."""
    model, _ = _dtypes(ds)
    value = moe.dispatch_dtype
    if value is None or value == "fp8":
        return value
    if value in _DTYPE_NAMES[model]:
        return None
    raise ConfigError(f"{where}.dispatch_dtype {value!r}: the dispatch sends the activation dtype ({model}) or fp8: "
                      f"set it to \"{model}\" (or leave it unset) or \"fp8\"")

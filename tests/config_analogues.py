"""Every config in ds_configs/ as a run that fits this machine: the same non-shape
sections (optimizer, scheduler, ZeRO stage, precision, gradient accumulation dtype,
schedule, overlaps, partition method, checkpoint engine settings, MTP, balancing,
recipe sections), with the shapes made small. A config already sized for CPU keeps its
shapes; a production one (deepseek-v2-lite, deepseek-v3, 4096 tokens, 16 stages, EP 8)
takes its recipe's tiny preset (the MoE one where its preset has MoE layers), 2 pipeline
stages, expert parallelism 2 at most, 128-token sequences of the stdlib corpus through
the byte tokenizer, and a gradient accumulation its schedule accepts at 2 stages.

``analogue(name)`` returns the config (a dict) and the world size it runs on; a config
that cannot be run here raises ``CannotRun`` saying why. A new file in ds_configs/ is
covered by whoever iterates ``config_names()``.
"""

import copy
import json
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = os.path.join(ROOT, "ds_configs")

MAX_STAGES = 2
MAX_EXPERT_PARALLEL = 2
MAX_GRAD_ACCUM = 8
SEQ_LEN = 128
# model fields a production config overrides that are shapes, not behaviour
SHAPE_OVERRIDES = ("max_position_embeddings",)


class CannotRun(Exception):
    pass


def config_names():
    return sorted(n for n in os.listdir(CONFIGS) if n.endswith(".json"))


def load(name):
    with open(os.path.join(CONFIGS, name)) as f:
        return json.load(f)


def _has_moe(fields):
    return fields.get("n_routed_experts", 0) > 0 and fields.get("first_k_dense_replace", 0) < fields.get(
        "num_hidden_layers", 0)


def _tiny_preset(spec, preset):
    """The recipe's CPU-sized preset ("tiny-moe" or "tiny") with the same kind of layers
    (MoE or dense) as ``preset``."""
    moe = _has_moe(spec.presets[preset])
    for name in ("tiny-moe", "tiny"):
        if name in spec.presets and _has_moe(spec.presets[name]) == moe:
            return name
    raise CannotRun(f"recipe {spec.name} has no tiny preset with {'MoE' if moe else 'dense'} layers to stand in "
                    f"for {preset!r}")


def _is_cpu_sized(cfg):
    data = cfg["seekspeed"].get("data", {})
    return (cfg["seekspeed"]["recipe"].get("preset", "").startswith("tiny") and data.get("seq_len", 0) <= SEQ_LEN
            and cfg.get("pipeline", {}).get("stages", 1) <= MAX_STAGES)


def analogue(name):
    """(config dict, world size) of ds_configs/``name`` at this machine's scale."""
    from recipes import get_recipe
    cfg = copy.deepcopy(load(name))
    s = cfg["seekspeed"]
    spec = get_recipe(s["recipe"]["name"])
    if not _is_cpu_sized(cfg):
        recipe = s["recipe"]
        recipe["preset"] = _tiny_preset(spec, recipe["preset"])
        overrides = {k: v for k, v in recipe.get("overrides", {}).items() if k not in SHAPE_OVERRIDES}
        recipe["overrides"] = overrides
        cfg.pop("train_batch_size", None)
        cfg["train_micro_batch_size_per_gpu"] = min(cfg.get("train_micro_batch_size_per_gpu", 1), 4)
        cfg["gradient_accumulation_steps"] = min(cfg.get("gradient_accumulation_steps", 1), MAX_GRAD_ACCUM)
        pipe = cfg.setdefault("pipeline", {})
        pipe["stages"] = min(pipe.get("stages", 1), MAX_STAGES)
        s["data"] = {k: v for k, v in s.get("data", {}).items() if k not in ("format", "text_field", "num_proc")}
        s["data"].update(source="stdlib", tokenizer="byte", seq_len=SEQ_LEN)
    moe = s.get("moe", {})
    ep = min(moe.get("expert_parallel_size", 1), MAX_EXPERT_PARALLEL)
    if "expert_parallel_size" in moe:
        moe["expert_parallel_size"] = ep
    stages = cfg.get("pipeline", {}).get("stages", 1)
    return cfg, stages * ep

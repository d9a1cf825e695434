"""Loading a DeepSpeed JSON config: the project's section validated strictly
(ds_ext/sections.py, and the recipes' own sections), the parallel layout it implies
(ds_ext/layout.py) and the dtypes (ds_ext/precision.py).

One JSON file holds DeepSpeed's own keys plus ``"seekspeed": {...}``:

    "seekspeed": {
      "recipe":     {"name": "deepseek_v3", "preset": "tiny", "overrides": {...}},
      "schedule":   "1f1b" | "dualpipev" | "dualpipev-zb" | "dualpipe",
      "overlap":    "auto" | "layer" | "none",
      "overlap_grad_reduce": false | true,
      "grad_norm":  "deepspeed" | "exact",
      "muon_update": "auto" | "compiled" | "eager",
      "moe":        {"bias_update_speed": 0.001, "balance_loss_alpha": 0.0001},
      "data":       {"source": "stdlib", "tokenizer": "byte", "seq_len": 128, ...},
      "train":      {"steps": 300, "seed": 1234, "log_interval": 10},
      "checkpoint": {"dir": "runs/tiny", "interval_steps": 100},
      "topology":   {"placement": "auto", "bandwidth": "launcher", ...},
      "comm":       {"compressor": "topk", "ratio": 0.01, "hierarchical": true, ...},
      "report":     {"dir": null, "plots": true, "profile": "10:12"}
    }

``overlap_grad_reduce`` (Megatron's name): each virtual stage's data-parallel gradient
reduction is issued asynchronously once the schedule has run that stage's last backward
(and, under the zero-bubble schedules, its last W) of the step, and waited for at
ReduceGrads, so it runs while the rest of the pipeline drains (ds_ext/pipe/grad_overlap.py).
Dense, it is bitwise DeepSpeed's own reduction; ZeRO stage 1 with
``zero_optimization.overlap_comm`` true and a ``communication_data_type`` wider than the
gradients under ZeRO 1 are refused.

Pipeline degree, partitioning and activation checkpointing use DeepSpeed's own
``"pipeline"`` section (``stages``, ``partition``, ``activation_checkpoint_interval``);
batch sizes use DeepSpeed's ``train_batch_size`` / ``train_micro_batch_size_per_gpu``
/ ``gradient_accumulation_steps``, resolved by DeepSpeed's own config code.
"""

import json
import os
import sys
from dataclasses import dataclass

from .errors import ConfigError
from .layout import Layout, _object, check_momentum_target, pipeline_stages, resolve_layout  # noqa: F401
from .precision import check_precision, fp32_grad_accumulation, mixed_precision  # noqa: F401
from .schema import from_dict
from .sections import (  # noqa: F401 (the section classes, ds_ext/sections.py; importers use them from here)
    OVERLAP_CHOICES, SECTION, RecipeSection, DATA_FORMATS, ENCODING_ERRORS,
    MixtureSource, DataSection, TrainSection, CheckpointSection, MoeSection,
    TopologySection, CommSection, MtpSection, ReportSection, SeekspeedSection,
)


@dataclass(kw_only=True)
class RunConfig:
    path: str
    ds: dict          # the whole JSON, passed to deepspeed.initialize unchanged but for resolved batch keys
    section: SeekspeedSection
    layout: Layout
    warnings: list
    # DeepSpeed's op builders its optimizer for this config loads (ds_keys.check): the
    # trainer loads them under ds_ext.ops.build_guard before DeepSpeed does
    compiled_ops: tuple = ()


def read_json(path):
    if not os.path.exists(path):
        raise ConfigError(f"config file {path} does not exist: pass --deepspeed with a path such as "
                          f"ds_configs/tiny_cpu.json")
    with open(path) as f:
        text = f.read()
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path}:{exc.lineno}:{exc.colno}: invalid JSON ({exc.msg})") from None


def load_config(path, *, world_size, overrides=None):
    """Read, validate and resolve a config for ``world_size`` ranks.

    ``overrides`` maps dotted paths in the seekspeed section to values (for example
    ``{"train.steps": 5}``) so command-line flags never repeat numbers from the JSON.
    """
    ds = read_json(path)
    if not isinstance(ds, dict):
        raise ConfigError(f"{path}: the top level must be an object")
    if SECTION not in ds:
        raise ConfigError(f"{path}: no {SECTION!r} section: add one (see ds_configs/tiny_cpu.json)")
    raw = json.loads(json.dumps(ds[SECTION]))
    for dotted, value in (overrides or {}).items():
        node = raw
        *parents, leaf = dotted.split(".")
        for p in parents:
            if not isinstance(node.get(p), dict):
                node[p] = {}
            node = node[p]
        node[leaf] = value
    section = parse_section(raw)
    ds[SECTION] = raw
    _fill_auto(ds, section)
    layout, warnings, compiled_ops = resolve_layout(ds, world_size=world_size, section=section, path=path)
    return RunConfig(path=path, ds=ds, section=section, layout=layout, warnings=warnings, compiled_ops=compiled_ops)


def parse_section(raw):
    """The seekspeed section: its own keys, and the sections the registered recipes
    declare (RecipeSpec.sections, e.g. deepseek_v32's ``dsa``), each by its class."""
    from recipes import recipe_section_classes
    classes = recipe_section_classes()
    own = {k: v for k, v in raw.items() if k not in classes}
    try:
        section = from_dict(SeekspeedSection, own, where=SECTION)
    except ConfigError as exc:
        if "unknown key" in str(exc) and str(exc).startswith(f"{SECTION}:"):
            raise ConfigError(f"{exc}; recipe sections: {sorted(classes)}") from None
        raise
    section.recipe_config = {name: from_dict(classes[name], raw[name], where=f"{SECTION}.{name}")
                             for name in raw if name in classes}
    return section


_AUTO_SCHEDULER_PARAMS = {"total_num_steps"}


def _fill_auto(ds, section):
    """``"auto"`` in the scheduler means "from seekspeed.train", so the step count
    lives in one place."""
    params = _object(ds, "scheduler", path="config").get("params", {})
    if not isinstance(params, dict):
        raise ConfigError(f"scheduler.params must be an object, got {params!r}")
    for key, value in params.items():
        if value == "auto":
            if key not in _AUTO_SCHEDULER_PARAMS:
                raise ConfigError(f"scheduler.params.{key}: \"auto\" is only understood for "
                                  f"{sorted(_AUTO_SCHEDULER_PARAMS)}; give a number")
            params[key] = section.train.steps


# DeepSpeed's own "pipeline" keys (deepspeed/runtime/config.py get_pipeline_config)


def print_warnings(warnings, *, rank):
    if rank == 0:
        for w in warnings:
            print(f"warning: {w}", file=sys.stderr, flush=True)

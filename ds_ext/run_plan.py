"""The run plan: what launch/train.py decides before any process group exists,
checked and computed once by ``validate`` and then only read.

It holds the checked config, the recipe and its model config, the layer specs and
how the pipeline cuts them, the data stages, the report directory and profile
window, and whether the run resumes. The recipe is asked here (config, stage check,
layer specs, default partition) and once more by the trainer to build the model.
"""

import os
import re
from dataclasses import dataclass

from .config import load_config
from .errors import ConfigError


@dataclass(frozen=True)
class LayerCut:
    """The recipe's layer specs and how the pipeline cuts them."""
    specs: list
    partition: object     # what PipelineModule is given: a DeepSpeed method, or the bounds "balanced" planned
    bounds: list          # layer boundaries of the schedule's virtual stages
    stage_layers: list    # per pipeline rank: the indices of the specs it holds (a tied layer once)


@dataclass(frozen=True)
class ProfileSteps:
    """The optimizer steps torch.profiler records (--profile or seekspeed.report.profile)."""
    text: str             # as the user wrote it, for messages
    first: int
    last: int


@dataclass(frozen=True, kw_only=True)
class RunPlan:
    # what was asked
    cfg: object           # the checked RunConfig: cfg.ds, cfg.section, cfg.layout
    recipe: object        # the RecipeSpec (recipes/spec.py)
    model_config: object
    recipe_options: dict  # the recipe's own settings (RecipeSpec.train_options: seekspeed.dsa for deepseek_v32)
    tokenizer: object
    # the model
    layers: LayerCut
    stage_params: int     # parameters of the largest pipeline rank (the topology's traffic estimate)
    has_moe: bool
    overlap: str          # seekspeed.overlap resolved: "layer" or "none"
    ds_config: dict       # DeepSpeed's own keys, for deepspeed.initialize
    layout_record: dict   # saved beside each checkpoint; the engine adds its optimizer
    # data
    data_stages: frozenset  # pipeline stages whose ranks read training data
    # report and profile
    report_dir: str | None
    profile: ProfileSteps | None
    # checkpoints
    checkpoint_dir: str | None
    resume: bool          # --resume, and there is a checkpoint to continue
    init_from: str | None  # the transformers directory the weights start from (None when resuming)

    @property
    def section(self):
        return self.cfg.section

    @property
    def layout(self):
        return self.cfg.layout


def _config_overrides(args):
    overrides = {}
    if args.steps is not None:
        overrides["train.steps"] = args.steps
    if args.checkpoint_dir is not None:
        overrides["checkpoint.dir"] = args.checkpoint_dir
    return overrides


def _checkpoint_exists(directory):
    """A checkpoint lives here: a 'latest' file or a global_step* tag (torn staging
    directories of a crashed first save do not count)."""
    if not directory or not os.path.isdir(directory):
        return False
    return any(name == "latest" or name.startswith("global_step") for name in os.listdir(directory))


def validate(args, *, world_size):
    """Everything that can be checked before a process group exists: config, recipe,
    stages vs layers, partitioning, tokenizer vs vocabulary, data path, resume.
    Writes nothing; returns the RunPlan."""
    from .data import load_tokenizer, resolve_source
    from .pipe import data_stages
    from .planner.model import partition_method, resolve_model
    from .topology.setup import check as check_topology
    cfg = load_config(args.config, world_size=world_size, overrides=_config_overrides(args))
    s = cfg.section
    recipe, model_config = resolve_model(cfg)
    has_moe = model_config.num_moe_layers() > 0
    _check_experts(s, model_config, has_moe=has_moe)
    overlap = s.resolve_overlap(has_moe=has_moe)
    specs = recipe.layer_specs(model_config, seed=0)
    check_partition(partition_method(cfg.ds, recipe), specs, model_config, recipe)
    interval = cfg.ds.get("pipeline", {}).get("activation_checkpoint_interval", 0)
    recipe.check_checkpointing(specs, interval=interval)
    cfg.warnings += recipe.layer_warnings(specs, schedule=s.schedule, checkpoint_interval=interval)
    recipe_options = recipe.train_options(s)
    partition = partition_for(cfg, recipe, model_config)
    check_topology(s.topology, model_config=model_config)
    if model_config.max_position_embeddings < s.data.seq_len:
        raise ConfigError(f"seekspeed.data.seq_len {s.data.seq_len} exceeds the model's max_position_embeddings "
                          f"{model_config.max_position_embeddings}: lower seq_len or raise it in recipe.overrides")
    if s.data.attention == "document" and model_config.num_mtp_layers:
        raise ConfigError("seekspeed.data.attention \"document\" does not support multi-token prediction yet: set "
                          "num_mtp_layers to 0 in recipe.overrides or attention to \"causal\"")
    tokenizer = load_tokenizer(s.data.tokenizer, vocab_size=model_config.vocab_size)
    for section, _ in s.data.sources():
        resolve_source(section)
    if s.init_from is not None:
        from .hf_io import check_hf_dir
        check_hf_dir(s.init_from, model_config)
    report_dir = _report_dir(args, s)
    profile = _profile_steps(args, s, report_dir=report_dir)
    resume = _resume_decision(args, s.checkpoint.dir)
    layers = cut_layers(cfg, specs, partition)
    return RunPlan(cfg=cfg, recipe=recipe, model_config=model_config, recipe_options=recipe_options,
                   tokenizer=tokenizer, layers=layers,
                   stage_params=_largest_stage_params(layers), has_moe=has_moe, overlap=overlap,
                   ds_config={k: v for k, v in cfg.ds.items() if k != "seekspeed"},
                   layout_record=layout_record(cfg, model_config, layers),
                   data_stages=frozenset(data_stages(s.schedule, cfg.layout.pipe_stages)), report_dir=report_dir,
                   profile=profile, checkpoint_dir=s.checkpoint.dir, resume=resume,
                   init_from=s.init_from if not resume else None)


def _check_experts(s, model_config, *, has_moe):
    ep = s.moe.expert_parallel_size
    if ep > 1 and not has_moe:
        raise ConfigError(f"seekspeed.moe.expert_parallel_size {ep} but preset {s.recipe.preset!r} has no MoE layers: "
                          f"set it to 1 or use an MoE preset (tiny-moe, deepseek-v2-lite, deepseek-v3)")
    if has_moe and model_config.n_routed_experts % ep:
        raise ConfigError(f"seekspeed.moe.expert_parallel_size {ep} does not divide n_routed_experts "
                          f"{model_config.n_routed_experts}: choose a divisor of {model_config.n_routed_experts}")


def _report_dir(args, s):
    from .profile.run import report_dir
    return report_dir(s.report, checkpoint_dir=s.checkpoint.dir, override=args.report_dir)


def _profile_steps(args, s, *, report_dir):
    text = args.profile or s.report.profile
    if not text:
        return None
    from .profile.window import parse_window
    first, last = parse_window(text, flag="--profile" if args.profile else "seekspeed.report.profile")
    if last > s.train.steps:
        raise ConfigError(f"profile window {text} ends after the last step ({s.train.steps}): choose steps "
                          f"within 1..{s.train.steps}")
    if report_dir is None:
        raise ConfigError("a profile window needs a report directory: set seekspeed.checkpoint.dir, "
                          "seekspeed.report.dir or --report-dir")
    return ProfileSteps(text, first, last)


def _resume_decision(args, directory):
    """Whether the run continues a checkpoint of ``directory``: --resume needs one,
    --resume auto takes one if there is, and a fresh run never overwrites one."""
    if args.resume and not directory:
        raise ConfigError("--resume needs a checkpoint directory: set seekspeed.checkpoint.dir or --checkpoint-dir")
    resume = bool(args.resume)
    if resume:
        from .checkpoint import list_checkpoints
        found = list_checkpoints(directory)[0]
        if not found and args.resume == "yes":
            raise ConfigError(f"--resume: no checkpoint in {directory!r} (none complete): run without --resume (or "
                              f"with --resume auto), or set seekspeed.checkpoint.dir / --checkpoint-dir")
        if not found:
            if int(os.environ.get("RANK", "0")) == 0:
                torn = _checkpoint_exists(directory)
                print(f"--resume auto: no complete checkpoint in {directory} yet, starting fresh"
                      + (" (the saves there never completed and will be written again)" if torn else ""), flush=True)
            return False
    if not resume and _checkpoint_exists(directory):
        raise ConfigError(f"checkpoint directory {directory} already holds a checkpoint: pass --resume (or "
                          f"--resume auto) to continue it, or choose another --checkpoint-dir (nothing was "
                          f"overwritten)")
    return resume


def check_partition(method, specs, model_config, recipe=None):
    """DeepSpeed's partition methods and "balanced", checked before any rank builds a
    layer; "balanced" needs the recipe's planner costs to cost every layer class."""
    if method in ("uniform", "parameters"):
        return
    if method == "balanced":
        from recipes import spec_for
        try:
            (recipe or spec_for(model_config)).layer_kinds(specs, model_config)
        except ConfigError as exc:
            raise ConfigError(f"pipeline.partition 'balanced' cuts layers by the planner's cost: {exc}; or use "
                              f"'type:REGEX' / 'parameters'") from None
        return
    if not method.startswith("type:"):
        raise ConfigError(f"pipeline.partition {method!r} is not a DeepSpeed partition method: use 'best' "
                          f"(the recipe's default), 'uniform', 'parameters', 'type:REGEX' or 'balanced' (cut from "
                          f"the planner's per-layer costs)")
    try:
        pattern = re.compile(method[len("type:"):], re.IGNORECASE)
    except re.error as exc:
        raise ConfigError(f"pipeline.partition {method!r}: invalid regular expression ({exc})") from None
    names = sorted({spec.typename.__name__ for spec in specs})
    if not any(pattern.search(n) for n in names):
        raise ConfigError(f"pipeline.partition {method!r} matches no layer of the recipe (layers: {names})")


def partition_for(cfg, recipe, model_config):
    """What the layers are cut by: a DeepSpeed partition method, or for "balanced" the
    boundaries ds_ext.planner cuts from its per-layer costs on this run's layout
    (nodes of LOCAL_WORLD_SIZE ranks; ds_ext.planner.cut_hardware's figures),
    the same on every rank. ``validate`` computes it once into the run plan."""
    from .planner.model import partition_method
    method = partition_method(cfg.ds, recipe)
    if method != "balanced":
        return method
    from .planner import cut_hardware, make_plan
    world = cfg.layout.world_size
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if per_node < 1 or world % per_node:
        per_node = world
    return list(make_plan(cfg, nodes=world // per_node, ranks_per_node=per_node,
                          hardware=cut_hardware(cfg.section.topology, per_node)).bounds)


def cut_layers(cfg, specs, partition):
    """The LayerCut of ``specs`` by ``partition`` (partition_for's answer) on cfg's layout."""
    from .pipe import virtual_stages
    from .pipe.partition import partition as bounds_of, rank_layers
    s, lay = cfg.section, cfg.layout
    bounds = bounds_of(specs, num_parts=virtual_stages(s.schedule, lay.pipe_stages), method=partition)
    return LayerCut(specs=specs, partition=partition, bounds=bounds,
                    stage_layers=rank_layers(specs, bounds=bounds, schedule=s.schedule, stages=lay.pipe_stages))


def layer_cut(cfg, recipe, model_config):
    """The LayerCut of a config loaded without ``validate`` (tests, tools)."""
    return cut_layers(cfg, recipe.layer_specs(model_config, seed=0), partition_for(cfg, recipe, model_config))


def _largest_stage_params(layers):
    from .pipe.partition import count_parameters
    counts = [count_parameters(spec) for spec in layers.specs]
    return max(sum(counts[i] for i in held) for held in layers.stage_layers)


def layout_record(cfg, model_config, layers, *, optimizer=None):
    """The parallel layout of this run, saved beside each checkpoint so that a run on
    another layout can find each layer's state: degrees, schedule, the optimizer that
    cut its state (known once the engine is built), and the layer keys (global layer
    index, or tied_modules.<key>) each pipeline rank holds."""
    s, lay = cfg.section, cfg.layout

    def key(i):
        tied = getattr(layers.specs[i], "key", None)
        return f"tied_modules.{tied}" if tied is not None else str(i)

    return {"pipe_stages": lay.pipe_stages, "data_parallel": lay.data_parallel,
            "expert_parallel_size": s.moe.expert_parallel_size, "schedule": s.schedule,
            "zero_stage": cfg.ds.get("zero_optimization", {}).get("stage", 0), "train_batch": lay.train_batch,
            "optimizer": optimizer, "bf16": bool(cfg.ds.get("bf16", {}).get("enabled", False)),
            "n_routed_experts": model_config.n_routed_experts if model_config.num_moe_layers() else 0,
            "stage_keys": [sorted({key(i) for i in held}) for held in layers.stage_layers]}

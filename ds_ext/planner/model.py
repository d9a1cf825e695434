"""The model a config trains, as the planner and the run's validation both resolve it:
the recipe and its checked config, the precision DeepSpeed keeps each tensor in, and
the layers with their parameters (built on the meta device)."""

from dataclasses import dataclass


def partition_method(ds, recipe):
    """``pipeline.partition`` with "best" resolved to the recipe's default."""
    method = ds.get("pipeline", {}).get("partition", "best")
    return recipe.default_partition if method == "best" else method


def resolve_model(cfg):
    """(recipe spec, checked recipe config) of a loaded RunConfig; the pipeline's stage
    count checked against the layers."""
    from recipes import get_recipe
    s = cfg.section
    recipe = get_recipe(s.recipe.name)
    config = recipe.make_config(s.recipe.preset, s.recipe.overrides)
    recipe.check_stages(config, stages=cfg.layout.pipe_stages, schedule=s.schedule)
    return recipe, config


def gradient_bytes(ds):
    """Bytes per parameter DeepSpeed keeps for gradients. bf16 with fp32 accumulation
    under ZeRO-1 runs DeepSpeed's BF16_Optimizer: the bf16 ``param.grad`` stays
    allocated (unless ``bf16.immediate_grad_update``) next to a full fp32 accumulation
    buffer; other bf16/fp16 setups keep low-precision gradients; fp32 keeps fp32."""
    from ds_ext.precision import fp32_grad_accumulation, mixed_precision
    if not mixed_precision(ds):
        return 4
    if ds.get("bf16", {}).get("enabled", False) and fp32_grad_accumulation(ds):
        return 4 + (0 if ds["bf16"].get("immediate_grad_update", False) else 2)
    return 2


@dataclass(frozen=True, kw_only=True)
class Precision:
    """Bytes per element DeepSpeed keeps: activations (``act``, also the weights),
    gradients, what the data-parallel reduction moves, the optimizer's state per
    parameter (Adam's moments, plus fp32 master weights in mixed precision) and ZeRO's
    reduce bucket (bytes)."""
    act: int
    weight: int
    grad: int
    reduce: int
    optimizer: int
    bucket: float
    zero_stage: int


def precision(ds):
    from ds_ext.precision import fp32_grad_accumulation, mixed_precision
    mixed = mixed_precision(ds)
    zero = ds.get("zero_optimization", {}).get("stage", 0)
    return Precision(act=2 if mixed else 4, weight=2 if mixed else 4, grad=gradient_bytes(ds),
                     reduce=4 if fp32_grad_accumulation(ds) else 2, optimizer=8 + (4 if mixed else 0),
                     bucket=ds.get("zero_optimization", {}).get("reduce_bucket_size", 5e8) * 4 if zero >= 1 else 0,
                     zero_stage=zero)


@dataclass(frozen=True, kw_only=True)
class PlanModel:
    """Everything a plan needs that does not depend on the hardware: the config's
    layout and sections, the recipe, the layers (``specs`` as this rank builds them,
    one expert-parallel shard; ``rows`` their figures, layers.layer_rows, with the
    activated parameters of the unsharded build) and the schedule's cut into
    ``parts`` virtual stages."""
    cfg: object
    recipe: object
    mc: object
    options: dict
    precision: Precision
    interval: int              # activation checkpointing: layers per checkpointed group, 0 off
    specs: list
    rows: list
    unique_params: int         # parameters of the whole model, each tied layer once
    sched: object
    parts: int
    method: str                # pipeline.partition as configured

    @property
    def section(self):
        return self.cfg.section

    @property
    def layout(self):
        return self.cfg.layout

    @property
    def ep(self):
        return self.cfg.section.moe.expert_parallel_size

    @property
    def tokens(self):
        return self.cfg.layout.micro_batch * self.cfg.layout.seq_len

    @property
    def recompute_passes(self):
        return 1 if self.interval > 0 else 0

    @property
    def has_moe(self):
        return self.mc.num_moe_layers() > 0

    def full_bytes(self, row):
        """Bytes autograd keeps for one micro-batch of the layer (the recipe's activation_bytes)."""
        return self.tokens * self.recipe.planner.activation_bytes(
            self.mc, row["kind"], seq_len=self.layout.seq_len, act_bytes=self.precision.act, **self.options)

    def is_moe(self, row):
        return row["kind"] in self.recipe.planner.moe_kinds

    def is_lookup(self, row):
        return row["kind"] in self.recipe.planner.lookup_kinds

    def is_logits(self, row):
        return row["kind"] in self.recipe.planner.logits_kinds


def plan_model(cfg, *, checkpoint_interval=None):
    """The PlanModel of a loaded RunConfig; ``checkpoint_interval`` overrides the
    config's pipeline.activation_checkpoint_interval."""
    from ds_ext.pipe import schedule_spec
    from ds_ext.pipe.partition import held_once

    from .layers import layer_rows
    recipe, mc = resolve_model(cfg)
    s, ds = cfg.section, cfg.ds
    options = recipe.train_options(s)
    ep = s.moe.expert_parallel_size
    interval = (ds.get("pipeline", {}).get("activation_checkpoint_interval", 0) if checkpoint_interval is None
                else checkpoint_interval)
    # parameters held (this rank's experts only) and compute (every routed expert a
    # token picks, wherever it lives: from the unsharded build)
    specs = recipe.layer_specs(mc, seed=0, ep_size=ep, ep_rank=0, **options)
    rows = layer_rows(specs, mc, recipe)
    full_specs = specs if ep == 1 else recipe.layer_specs(mc, seed=0, **options)
    full = rows if ep == 1 else layer_rows(full_specs, mc, recipe)
    for row, whole in zip(rows, full):
        row["active"] = whole["active"]
    sched = schedule_spec(s.schedule)
    return PlanModel(cfg=cfg, recipe=recipe, mc=mc, options=options, precision=precision(ds), interval=interval,
                     specs=specs, rows=rows, sched=sched, parts=sched.virtual_stages(cfg.layout.pipe_stages),
                     unique_params=sum(full[i]["params"] for i in held_once(full_specs, range(len(full_specs)))),
                     method=ds.get("pipeline", {}).get("partition", "best"))

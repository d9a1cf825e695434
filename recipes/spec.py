"""What a recipe tells the rest of seekspeed: one ``RecipeSpec`` per model, registered
in recipes/__init__.py (torchtitan's ModelSpec is the model for it).

ds_ext (trainer, planner, checkpoint export and import, generation) asks the spec and
never names a recipe's classes, so a copied recipe that registers its spec gets
training, planning, export and generation, or a start-up error naming what it lacks.

A spec holds:
- ``config_class`` and ``presets``: the typed config (a ``@dataclass(kw_only=True)``
  with a ``check(where)`` method) and its named shapes;
- ``layer_specs(config, *, seed, ep_size, ep_rank, document_token, **options)``: the
  model as DeepSpeed LayerSpecs; ``loss_fn(config, *, mtp_loss_weight)``: the pipeline's
  loss; together they make ``build_pipeline`` (recipes.layers.pipe.build_pipeline, or
  ``build`` where a recipe adds to it);
- ``default_partition`` (what ``pipeline.partition: "best"`` means) and
  ``checkpointable_layers`` (the layer class names DeepSpeed's activation checkpointing
  wraps; it matches names exactly, so a renamed class must be listed);
- ``planner``: the kind of each layer and what each kind costs (ds_ext/planner/);
- ``hf``: the transformers counterpart (class, config both ways, the fields that
  identify a model); layer classes name their transformers prefix (``hf_prefix``), so
  the tensor-name mapping follows the layer list (recipes/layers/hf.py);
- ``decoder``: what generation runs (a latent-KV decoder over the whole model);
- ``sections`` and ``options``: the recipe's own config sections ({name: section class},
  parsed from the seekspeed section by the loader, which learns them from the registry)
  and ``options(section)``, the training settings read from them (``train_options``:
  setting a section the recipe does not read is an error; they also go to
  ``layer_specs`` and the planner's costs); ``build_options(section)``: arguments of the
  recipe's ``build_pipeline`` only (DeepSeek-V3's MTP loss weight and expert-parallel
  degree), read from the seekspeed section;
- ``routed_experts(module)``: the routed experts inside a built layer or model, one
  ``RoutedExperts`` per MoE block (the planner's expert parameters, resharding's expert
  names, ``activated_parameters``); DeepSpeed's own ``is_moe_param`` tag marks the same
  parameters for its expert groups and ZeRO partitions;
- ``hooks``: the per-step mechanisms of the recipe's layers (``StepHook``): a set-up once
  the engine exists, a call after each optimizer step that reports ``StepFigures``
  (in-layer losses, expert loads), for example the MoE routers' bias balancing and
  DeepSeek-V3.2's indexer loss; in-layer losses train through an identity's backward
  and the trainer reports them apart (the progress line, metrics.csv's
  ``loss_<name>``, the summary);
- ``reference(specs, loss_fn)``, ``hf_layout(config)``: the single-process model of a
  layer list (recipes/layers/reference.py) and the transformers tensor-name mapping
  (recipes/layers/hf.py) for tools that check or convert a model.

Under DeepSpeed's Muon (``"optimizer": {"type": "Muon"}``) every parameter of two or
more dimensions is orthogonalised by Muon except the embedding and the head, which go to
its auxiliary Adam with the vectors (DeepSpeed's ``set_optimizer_flags``); a layer marks
a matrix-shaped parameter that is not a linear map (a position bias, a table) with
``ds_ext.muon.muon_exempt(param)`` to send it to the auxiliary Adam as well.

The planner and the trainer also read these config fields, which every recipe's config
has (DeepSeek-V3's names): hidden_size, vocab_size, num_hidden_layers,
max_position_embeddings, num_mtp_layers, n_routed_experts, num_experts_per_tok,
moe_intermediate_size, n_shared_experts, and the methods ``is_moe_layer(i)`` and
``num_moe_layers()``.
"""

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from ds_ext.errors import ConfigError
from recipes.step import NotCostable, RoutedExperts, StepFigures, StepHook  # noqa: F401 (the spec's API)


@dataclass(frozen=True, kw_only=True)
class PlannerCosts:
    """What ds_ext/planner/ needs per layer. ``layer_kind(spec, config)`` names a
    layer spec's kind ("embed", "dense", "moe", "mtp-dense", "mtp-moe", "norm", "head",
    or a recipe's own: a kind ending in "moe" has routed experts) or raises
    ``NotCostable``; ``activation_bytes(config, kind, *, seq_len, act_bytes,
    fused_attention, **options)`` is what autograd keeps per token; ``attention_flops(config,
    kind, *, seq_len, **options)`` the forward FLOPs per token that are not weight matmuls
    (attention's scores and weighted sums, an indexer's scores), 0 for layers without
    attention. ``options`` are the run's RecipeSpec.train_options (a DSA stage, say).
    The planner treats kinds by their role: ``lookup_kinds`` gather rows of a table
    (the embedding), ``logits_kinds`` write the vocabulary's logits (the head),
    ``moe_kinds`` hold routed experts (their all-to-all is costed). ``boundary_bytes(config,
    *, act_bytes)``: bytes per token a stage sends the next (default: the hidden state,
    and MTP's second one; DeepSeek-V4: hc_mult streams and the token ids)."""
    layer_kind: Callable
    activation_bytes: Callable
    attention_flops: Callable
    lookup_kinds: tuple = ("embed",)
    logits_kinds: tuple = ("head",)
    moe_kinds: tuple = ("moe", "mtp-moe")
    boundary_bytes: Callable | None = None

    def stage_boundary_bytes(self, config, *, act_bytes):
        """Bytes per token between two pipeline stages."""
        if self.boundary_bytes is not None:
            return self.boundary_bytes(config, act_bytes=act_bytes)
        return config.hidden_size * act_bytes * (2 if config.num_mtp_layers else 1)


@dataclass(frozen=True, kw_only=True)
class TransformersAdapter:
    """The model in transformers. ``model_class`` is the transformers class name
    (AutoModelForCausalLM loads it from the exported config's model_type);
    ``to_hf_config(config)`` the transformers config; ``from_hf_config(dict)`` the recipe
    fields of a config.json; ``identity_fields`` the config.json fields on which a
    directory must agree with the recipe for ``seekspeed.init_from`` to load it."""
    model_class: str
    to_hf_config: Callable
    from_hf_config: Callable
    identity_fields: tuple

    def model_type(self):
        import transformers
        return getattr(transformers, self.model_class).config_class.model_type

    def model(self, config):
        """An initialised transformers model of ``config`` (for parity checks)."""
        import transformers
        return getattr(transformers, self.model_class)(self.to_hf_config(config))


@dataclass(frozen=True, kw_only=True)
class RecipeSpec:
    name: str
    config_class: type
    presets: Mapping
    layer_specs: Callable
    loss_fn: Callable
    default_partition: str
    checkpointable_layers: tuple
    planner: PlannerCosts
    hf: TransformersAdapter | None = None
    decoder: Callable | None = None
    sections: Mapping = field(default_factory=dict)
    options: Callable = field(default=lambda section: {})
    build_options: Callable = field(default=lambda section: {})
    routed_experts: Callable = field(default=lambda module: [])
    hooks: tuple = ()
    build: Callable | None = None

    @property
    def layer_losses(self):
        """The names of the in-layer losses the recipe's hooks report."""
        return tuple(name for hook in self.hooks for name in hook.losses)

    def active_hooks(self, config):
        """The hooks that apply to a model of ``config``."""
        return [hook for hook in self.hooks if hook.applies(config)]

    def expert_parameter_ids(self, module):
        """ids of the routed-expert parameters in ``module`` (the spec's predicate)."""
        return {id(p) for group in self.routed_experts(module) for p in group.parameters}

    def activated_parameters(self, specs):
        """Parameters one token passes through (recipes/layers/counts.py)."""
        from recipes.layers.counts import activated_parameters
        return activated_parameters(specs, routed_experts=self.routed_experts)

    def check_checkpointing(self, specs, *, interval):
        from recipes.layers.pipe import check_checkpointing
        check_checkpointing(self, specs, interval=interval)

    def layer_warnings(self, specs, *, schedule, checkpoint_interval):
        from recipes.layers.pipe import layer_warnings
        return layer_warnings(self, specs, schedule=schedule, checkpoint_interval=checkpoint_interval)

    def reference(self, specs, loss_fn=None):
        """All layers of ``specs`` in one process (recipes/layers/reference.py)."""
        from recipes.layers.reference import SequentialReference
        return SequentialReference(specs, loss_fn)

    def hf_layout(self, config):
        """The transformers tensor-name mapping of ``config``'s model (recipes/layers/hf.py)."""
        from recipes.layers.hf import HFLayout
        return HFLayout.of(config)

    def first_expert(self, module):
        """Global index of the first routed expert ``module`` holds (0 without expert parallelism)."""
        return next((g.ep_rank * g.num_local for g in self.routed_experts(module)), 0)

    def make_config(self, preset, overrides=None, *, where="seekspeed.recipe"):
        """A checked config from a named preset plus field overrides."""
        from ds_ext.schema import from_dict
        if preset not in self.presets:
            raise ConfigError(f"{where}.preset: unknown preset {preset!r} of recipe {self.name}; choose one of "
                              f"{sorted(self.presets)}")
        return from_dict(self.config_class, {**self.presets[preset], **(overrides or {})}, where=f"{where}.overrides")

    def config_from_fields(self, fields, *, where):
        """A checked config from a full field dict (a checkpoint's record of it)."""
        from ds_ext.schema import from_dict
        return from_dict(self.config_class, fields, where=where)

    def check_stages(self, config, *, stages, schedule):
        from recipes.layers.pipe import check_stages
        check_stages(config, stages=stages, schedule=schedule)

    def build_pipeline(self, config, **kwargs):
        """The model as a DeepSpeed PipelineModule for ``schedule`` (recipes.layers.pipe.build_pipeline);
        ``kwargs`` are build_pipeline's and the recipe's ``build_options``."""
        if self.build is not None:
            return self.build(config, **kwargs)
        from recipes.layers.pipe import build_pipeline
        return build_pipeline(self, config, **kwargs)

    def layer_kinds(self, specs, config):
        """The planner's kind of each layer spec; a class it cannot cost is a ConfigError naming it."""
        kinds = []
        for spec in specs:
            try:
                kinds.append(self.planner.layer_kind(spec, config))
            except NotCostable as exc:
                raise ConfigError(f"recipe {self.name}: the planner cannot cost layer class "
                                  f"{spec.typename.__name__} ({exc}): give it a kind in the recipe's PlannerCosts "
                                  f"(layer_kind, activation_bytes, attention_flops)") from None
        return kinds

    def train_options(self, section, *, where="seekspeed"):
        """The recipe's own training settings from the seekspeed section; a section the
        recipe does not read, set anyway, is refused."""
        for name in section.recipe_sections():
            if name not in self.sections:
                raise ConfigError(f"{where}.{name} is set, and recipe {self.name} does not read it: remove it (it "
                                  f"belongs to recipes {_readers(name)})")
        return self.options(section)


def _readers(section_name):
    from recipes import RECIPES, get_recipe
    return sorted(n for n in RECIPES if section_name in get_recipe(n).sections) or ["(none registered)"]

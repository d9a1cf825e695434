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
- ``planner``: the kind of each layer and what each kind costs (ds_ext/profile/plan.py);
- ``hf``: the transformers counterpart (class, config both ways, the fields that
  identify a model); layer classes name their transformers prefix (``hf_prefix``), so
  the tensor-name mapping follows the layer list (recipes/layers/hf.py);
- ``decoder``: what generation runs (a latent-KV decoder over the whole model);
- ``options``: recipe-specific training settings read from the seekspeed section
  (``sections`` names the ones it reads; setting one for a recipe that does not read
  it is an error);
- ``layer_losses``: the names of losses computed inside layers (they train through an
  identity's backward, as the MoE balance loss does) and ``take_layer_losses(module)``,
  this rank's values since the last call ({name: mean over micro-batches, summed over
  the rank's layers}); the trainer reports them apart (the progress line, metrics.csv's
  ``loss_<name>``, the summary); ``configure_layer_losses(module, *, grad_scale)`` gives
  them the engine's loss scaling of one micro-batch (1 / gradient accumulation).

The planner and the trainer also read these config fields, which every recipe's config
has (DeepSeek-V3's names): hidden_size, vocab_size, num_hidden_layers,
max_position_embeddings, num_mtp_layers, n_routed_experts, num_experts_per_tok,
moe_intermediate_size, n_shared_experts, and the methods ``is_moe_layer(i)`` and
``num_moe_layers()``.
"""

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from ds_ext.errors import ConfigError


@dataclass(frozen=True, kw_only=True)
class PlannerCosts:
    """What ds_ext/profile/plan.py needs per layer. ``layer_kind(spec, config)`` names a
    layer spec's kind ("embed", "dense", "moe", "mtp-dense", "mtp-moe", "norm", "head",
    or a recipe's own: a kind ending in "moe" has routed experts) or raises
    ``NotCostable``; ``activation_bytes(config, kind, *, seq_len, act_bytes,
    fused_attention, **options)`` is what autograd keeps per token; ``attention_flops(config,
    kind, *, seq_len, **options)`` the forward FLOPs per token that are not weight matmuls
    (attention's scores and weighted sums, an indexer's scores), 0 for layers without
    attention. ``options`` are the run's RecipeSpec.train_options (a DSA stage, say)."""
    layer_kind: Callable
    activation_bytes: Callable
    attention_flops: Callable


class NotCostable(ValueError):
    """A layer class the recipe's planner costs do not know."""


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
    sections: tuple = ()
    options: Callable = field(default=lambda section: {})
    layer_losses: tuple = ()
    take_layer_losses: Callable = field(default=lambda module: {})
    configure_layer_losses: Callable = field(default=lambda module, *, grad_scale: None)
    build: Callable | None = None

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
        """The model as a DeepSpeed PipelineModule for ``schedule`` (recipes.layers.pipe.build_pipeline)."""
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

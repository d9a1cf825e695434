"""Config checks shared by the recipes' config classes (DeepSeek-V3's field names):
each raises a one-line ConfigError naming the field and the value."""

from ds_ext.errors import ConfigError

from . import rope
from .mlp import ACTIVATIONS

# the shape fields every MLA recipe needs positive (a recipe adds its own)
POSITIVE = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "max_position_embeddings",
            "rms_norm_eps", "initializer_range")


def check_mla_model(config, where, *, positive=()):
    """MLA, RoPE, activation, MTP and (when the model has MoE layers) DeepSeekMoE fields."""
    c = config
    for name in POSITIVE + tuple(positive):
        if getattr(c, name) <= 0:
            raise ConfigError(f"{where}.{name} must be positive, got {getattr(c, name)}")
    for name in ("first_k_dense_replace", "n_routed_experts", "n_shared_experts", "moe_intermediate_size"):
        if getattr(c, name) < 0:
            raise ConfigError(f"{where}.{name} must be >= 0, got {getattr(c, name)}")
    if c.num_mtp_layers not in (0, 1):
        raise ConfigError(f"{where}.num_mtp_layers must be 0 (off) or 1 (DeepSeek-V3's depth-1 MTP), "
                          f"got {c.num_mtp_layers}")
    if c.qk_rope_head_dim % 2:
        raise ConfigError(f"{where}.qk_rope_head_dim must be even (rotary pairs), got {c.qk_rope_head_dim}")
    if c.hidden_act not in ACTIVATIONS:
        raise ConfigError(f"{where}.hidden_act {c.hidden_act!r} is not supported: use one of {list(ACTIVATIONS)}")
    rope.check_rope_parameters(c.rope_parameters, where=f"{where}.rope_parameters")
    if c.num_moe_layers():
        check_moe(c, where)


def check_moe(config, where):
    """DeepSeekMoE's group-limited routing: experts divide into groups of >= 2, and the
    groups and experts chosen per token fit."""
    c = config
    e, g = c.n_routed_experts, c.n_group
    if c.moe_intermediate_size <= 0:
        raise ConfigError(f"{where}.moe_intermediate_size must be positive for MoE layers")
    if c.routed_scaling_factor <= 0:
        raise ConfigError(f"{where}.routed_scaling_factor must be positive, got {c.routed_scaling_factor}")
    if g <= 0 or e % g:
        raise ConfigError(f"{where}: n_routed_experts ({e}) must be divisible by n_group ({g})")
    if e // g < 2:
        raise ConfigError(f"{where}: each expert group needs >= 2 experts (group score = sum of its top 2); "
                          f"n_routed_experts ({e}) / n_group ({g}) < 2")
    if not 1 <= c.topk_group <= g:
        raise ConfigError(f"{where}.topk_group ({c.topk_group}) must be between 1 and n_group ({g})")
    if not 1 <= c.num_experts_per_tok <= c.topk_group * (e // g):
        raise ConfigError(f"{where}.num_experts_per_tok ({c.num_experts_per_tok}) must be between 1 and "
                          f"topk_group * experts per group ({c.topk_group * (e // g)})")

"""DeepSeek-V3 family recipe: Multi-head Latent Attention, SwiGLU or DeepSeekMoE
feed-forward, RMSNorm, decoupled RoPE with YaRN, as a DeepSpeed PipelineModule.

Copy this file to make a new model: change the config fields or presets, or the
layer list in ``layer_specs``, then register ``SPEC`` (the end of this file) in
recipes/__init__.py (README, "Make a new model"). Field names are transformers'
DeepseekV3Config names, so ``to_hf_config()`` gives a config that transformers loads
as the same model.

    python -m recipes.deepseek_v3 --preset deepseek-v3 --stages 16 --schedule dualpipev
prints the parameters each pipeline rank holds, built on the meta device.
"""

import dataclasses
from dataclasses import dataclass, field

from ds_ext.errors import ConfigError
from recipes.layers import checks, costs, moe, pipe
from recipes.layers.dispatch import DEFAULT_DISPATCH
from recipes.layers.latent_kv import MLADecoder
from recipes.layers.pipe import CausalLMLoss, DecoderLayerPipe, MTPLayerPipe, decoder_stack_specs
from recipes.spec import PlannerCosts, RecipeSpec, TransformersAdapter


@dataclass(kw_only=True)
class DeepseekV3Config:
    # shape
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    max_position_embeddings: int = 4096
    hidden_act: str = "silu"
    rms_norm_eps: float = 1e-6
    initializer_range: float = 0.02
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    # mla
    q_lora_rank: int | None = None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    # rope
    rope_parameters: dict = field(default_factory=lambda: {"rope_type": "default", "rope_theta": 10000.0})
    rope_interleave: bool = True
    # moe: layer i is MoE when i >= first_k_dense_replace (and n_routed_experts > 0)
    first_k_dense_replace: int = 0
    moe_intermediate_size: int = 0
    n_routed_experts: int = 0
    n_shared_experts: int = 1
    num_experts_per_tok: int = 1
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    # mtp: DeepSeek-V3's multi-token prediction module (0 = off, 1 = depth 1)
    num_mtp_layers: int = 0

    def check(self, where="recipe"):
        checks.check_mla_model(self, where)
        if self.q_lora_rank is not None and self.q_lora_rank <= 0:
            raise ConfigError(f"{where}.q_lora_rank must be positive or null (plain q_proj), got {self.q_lora_rank}")

    def is_moe_layer(self, layer_idx):
        return self.n_routed_experts > 0 and layer_idx >= self.first_k_dense_replace

    def num_moe_layers(self):
        return sum(self.is_moe_layer(i) for i in range(self.num_hidden_layers))

    def to_hf_config(self):
        """The same model as a transformers config (its DeepseekV3Config)."""
        from transformers import AutoConfig
        fields = dataclasses.asdict(self)
        moe = self.num_moe_layers() > 0
        fields["first_k_dense_replace"] = self.first_k_dense_replace if moe else self.num_hidden_layers
        if not moe:
            # transformers needs valid MoE fields even when every layer is dense
            fields.update(n_routed_experts=max(self.n_routed_experts, 2), n_group=1, topk_group=1,
                          num_experts_per_tok=1, moe_intermediate_size=max(self.moe_intermediate_size, 1))
        return AutoConfig.for_model("deepseek_v3", **fields, num_key_value_heads=self.num_attention_heads,
                                    pad_token_id=None)


# Presets. Shapes from the released config.json files of DeepSeek-V2-Lite and DeepSeek-V3,
# including their YaRN context extension (factor 40); a pretraining config at 4K
# overrides rope_parameters to plain RoPE, as DeepSeek pretrained (see ds_configs/128node.json).
# deepseek-v2-lite is V2-Lite's shape with this recipe's V3 router (sigmoid scores and
# a correction bias; V2 used softmax and greedy top-k).
PRESETS = {
    # A CPU step in well under a second; all layers dense (MoE: see README).
    "tiny": dict(vocab_size=512, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
                 num_attention_heads=4, max_position_embeddings=1024, q_lora_rank=64, kv_lora_rank=32,
                 qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, first_k_dense_replace=4),
    # tiny with DeepSeekMoE layers after the first: 8 routed experts in 4 groups.
    "tiny-moe": dict(vocab_size=512, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
                     num_attention_heads=4, max_position_embeddings=1024, q_lora_rank=64, kv_lora_rank=32,
                     qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, first_k_dense_replace=1,
                     moe_intermediate_size=96, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
                     n_group=4, topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5),
    "deepseek-v2-lite": dict(
        vocab_size=102400, hidden_size=2048, intermediate_size=10944, num_hidden_layers=27, num_attention_heads=16,
        max_position_embeddings=163840, q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128,
        qk_rope_head_dim=64, v_head_dim=128,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0,
                         "original_max_position_embeddings": 4096, "beta_fast": 32.0, "beta_slow": 1.0,
                         "mscale": 0.707, "mscale_all_dim": 0.707},
        first_k_dense_replace=1, moe_intermediate_size=1408, n_routed_experts=64, n_shared_experts=2,
        num_experts_per_tok=6, n_group=1, topk_group=1, norm_topk_prob=False, routed_scaling_factor=1.0),
    "deepseek-v3": dict(
        vocab_size=129280, hidden_size=7168, intermediate_size=18432, num_hidden_layers=61, num_attention_heads=128,
        max_position_embeddings=163840, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
        qk_rope_head_dim=64, v_head_dim=128,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0,
                         "original_max_position_embeddings": 4096, "beta_fast": 32.0, "beta_slow": 1.0,
                         "mscale": 1.0, "mscale_all_dim": 1.0},
        first_k_dense_replace=3, moe_intermediate_size=2048, n_routed_experts=256, n_shared_experts=1,
        num_experts_per_tok=8, n_group=8, topk_group=4, norm_topk_prob=True, routed_scaling_factor=2.5),
}


def make_config(preset, overrides=None, *, where="seekspeed.recipe"):
    """A checked config from a named preset plus field overrides."""
    return SPEC.make_config(preset, overrides, where=where)


def layer_specs(config, *, seed, ep_size=1, ep_rank=0, document_token=None, moe_dispatch=DEFAULT_DISPATCH):
    """The model as DeepSpeed layer specs: embedding, decoder layers, [MTP], final norm,
    head (recipes.layers.pipe.decoder_stack_specs; a new model changes the classes or
    the list here)."""
    return decoder_stack_specs(config, seed=seed, decoder=DecoderLayerPipe, mtp_layer=MTPLayerPipe, ep_size=ep_size,
                               ep_rank=ep_rank, document_token=document_token, moe_dispatch=moe_dispatch)


DEFAULT_PARTITION = "type:DecoderLayerPipe"
# the classes DeepSpeed's activation checkpointing wraps (matched by exact class name)
CHECKPOINTABLE_LAYERS = ("DecoderLayerPipe", "MTPLayerPipe")


def loss_fn(config, *, mtp_loss_weight):
    return CausalLMLoss(mtp_loss_weight, mtp=config.num_mtp_layers > 0)


def build_pipeline(config, **kwargs):
    """The model as a DeepSpeed PipelineModule (recipes.layers.pipe.build_pipeline:
    num_stages or topology, schedule, partition_method, activation_checkpoint_interval,
    seed, mtp_loss_weight, expert_parallel_size, document_token)."""
    return SPEC.build_pipeline(config, **kwargs)


def config_from_hf(fields):
    """The recipe fields of a transformers DeepseekV3 config.json."""
    names = {f.name for f in dataclasses.fields(DeepseekV3Config)}
    out = {k: v for k, v in fields.items() if k in names}
    if fields.get("first_k_dense_replace", 0) >= fields.get("num_hidden_layers", 0):
        out["n_routed_experts"] = 0          # every layer dense (to_hf_config's placeholders)
    return out


SPEC = RecipeSpec(
    name="deepseek_v3",
    config_class=DeepseekV3Config,
    presets=PRESETS,
    layer_specs=layer_specs,
    loss_fn=loss_fn,
    default_partition=DEFAULT_PARTITION,
    checkpointable_layers=CHECKPOINTABLE_LAYERS,
    planner=PlannerCosts(layer_kind=costs.layer_kind, activation_bytes=costs.activation_bytes,
                         attention_flops=costs.attention_flops),
    hf=TransformersAdapter(
        model_class="DeepseekV3ForCausalLM", to_hf_config=DeepseekV3Config.to_hf_config, from_hf_config=config_from_hf,
        identity_fields=("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                         "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                         "tie_word_embeddings", "n_routed_experts", "moe_intermediate_size", "first_k_dense_replace")),
    decoder=MLADecoder,
    build_options=pipe.build_options,
    routed_experts=moe.routed_experts,
    hooks=(moe.balancing_hook(),),
)


if __name__ == "__main__":
    from recipes.layers.counts import print_stage_parameters
    print_stage_parameters(SPEC, default_preset="deepseek-v3")

"""DeepSeek-V3.2 recipe: DeepSeek-V3 (MLA, DeepSeekMoE, RMSNorm, YaRN) with DeepSeek
Sparse Attention in every layer: a lightning indexer picks ``index_topk`` keys per
query and the attention reads only those (recipes/layers/dsa.py). Made by copying
recipes/deepseek_v3.py; field names are transformers' DeepseekV32Config names, so
``to_hf_config()`` gives a config that transformers loads as the same model.

Training follows the DeepSeek-V3.2 report: ``dsa_stage="warmup"`` (dense attention;
only the indexers learn, from their KL loss against the main attention) and then
``dsa_stage="sparse"`` (top-k attention; everything learns, the indexer from its KL
over the selected keys only). ``indexer_kl_weight`` scales that loss.

    python -m recipes.deepseek_v32 --preset deepseek-v3.2 --stages 16 --schedule dualpipev
prints the parameters each pipeline rank holds, built on the meta device.
"""

import dataclasses
from dataclasses import dataclass, field

from ds_ext.errors import ConfigError
from recipes.layers import checks, costs, moe, pipe
from recipes.layers.dispatch import DEFAULT_DISPATCH
from recipes.layers.dsa import (INDEXER_LOSS, DSADecoder, DSADecoderLayerPipe, DSAMTPLayerPipe,
                                DsaSection, check_dsa, freeze_for_warmup, train_options)
from recipes.layers.pipe import CausalLMLoss, decoder_stack_specs
from recipes.spec import PlannerCosts, RecipeSpec, TransformersAdapter


@dataclass(kw_only=True)
class DeepseekV32Config:
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
    # mla (V3.2 always has the query low-rank path: the indexer reads its latent)
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    # dsa: the lightning indexer of each attention layer
    index_topk: int = 2048
    index_n_heads: int = 64
    index_head_dim: int = 128
    # rope (the main attention rotates interleaved pairs, the indexer halves; not configurable)
    rope_parameters: dict = field(default_factory=lambda: {"rope_type": "default", "rope_theta": 10000.0})
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

    rope_interleave = True      # read by MLAttention; a class constant, not a field

    def check(self, where="recipe"):
        checks.check_mla_model(self, where, positive=("q_lora_rank", "index_topk", "index_n_heads", "index_head_dim"))
        if self.index_head_dim < self.qk_rope_head_dim:
            raise ConfigError(f"{where}.index_head_dim ({self.index_head_dim}) must be >= qk_rope_head_dim "
                              f"({self.qk_rope_head_dim}): the indexer rotates its first qk_rope_head_dim dimensions")

    def is_moe_layer(self, layer_idx):
        return self.n_routed_experts > 0 and layer_idx >= self.first_k_dense_replace

    def num_moe_layers(self):
        return sum(self.is_moe_layer(i) for i in range(self.num_hidden_layers))

    def to_hf_config(self):
        """The same model as a ``transformers.DeepseekV32Config`` (its MTP layer, which
        transformers does not build, as ``num_nextn_predict_layers``)."""
        from transformers import AutoConfig
        fields = dataclasses.asdict(self)
        fields["num_nextn_predict_layers"] = fields.pop("num_mtp_layers")
        moe = self.num_moe_layers() > 0
        fields["first_k_dense_replace"] = self.first_k_dense_replace if moe else self.num_hidden_layers
        if not moe:
            # transformers needs valid MoE fields even when every layer is dense
            fields.update(n_routed_experts=max(self.n_routed_experts, 2), n_group=1, topk_group=1,
                          num_experts_per_tok=1, moe_intermediate_size=max(self.moe_intermediate_size, 1))
        return AutoConfig.for_model("deepseek_v32", **fields, num_key_value_heads=self.num_attention_heads,
                                    pad_token_id=None)


# Presets. deepseek-v3.2 is the released config.json of DeepSeek-V3.2-Exp: DeepSeek-V3's
# shape (and YaRN factor 40) plus 64 indexer heads of 128 dimensions keeping 2048 keys.
_TINY = dict(vocab_size=512, hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4,
             max_position_embeddings=1024, q_lora_rank=64, kv_lora_rank=32, qk_nope_head_dim=32,
             qk_rope_head_dim=16, v_head_dim=32, index_topk=16, index_n_heads=8, index_head_dim=32)
PRESETS = {
    # A CPU step in well under a second; all layers dense; 16 keys per query, so
    # sequences beyond 16 tokens attend sparsely.
    "tiny": dict(_TINY, first_k_dense_replace=4),
    # tiny with DeepSeekMoE layers after the first: 8 routed experts in 4 groups.
    "tiny-moe": dict(_TINY, first_k_dense_replace=1, moe_intermediate_size=96, n_routed_experts=8,
                     n_shared_experts=1, num_experts_per_tok=2, n_group=4, topk_group=2, norm_topk_prob=True,
                     routed_scaling_factor=2.5),
    "deepseek-v3.2": dict(
        vocab_size=129280, hidden_size=7168, intermediate_size=18432, num_hidden_layers=61, num_attention_heads=128,
        max_position_embeddings=163840, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
        qk_rope_head_dim=64, v_head_dim=128, index_topk=2048, index_n_heads=64, index_head_dim=128,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0,
                         "original_max_position_embeddings": 4096, "beta_fast": 32.0, "beta_slow": 1.0,
                         "mscale": 1.0, "mscale_all_dim": 1.0},
        first_k_dense_replace=3, moe_intermediate_size=2048, n_routed_experts=256, n_shared_experts=1,
        num_experts_per_tok=8, n_group=8, topk_group=4, norm_topk_prob=True, routed_scaling_factor=2.5),
}


def make_config(preset, overrides=None, *, where="seekspeed.recipe"):
    """A checked config from a named preset plus field overrides."""
    return SPEC.make_config(preset, overrides, where=where)


def layer_specs(config, *, seed, ep_size=1, ep_rank=0, document_token=None, dsa_stage="sparse",
                indexer_kl_weight=1.0, moe_dispatch=DEFAULT_DISPATCH):
    """The model as DeepSpeed layer specs: embedding, DSA decoder layers, [MTP], final
    norm, head (recipes.layers.pipe.decoder_stack_specs with the DSA layer classes)."""
    check_dsa(dsa_stage, indexer_kl_weight)
    return decoder_stack_specs(config, seed=seed, decoder=DSADecoderLayerPipe, mtp_layer=DSAMTPLayerPipe,
                               ep_size=ep_size, ep_rank=ep_rank, document_token=document_token, dsa_stage=dsa_stage,
                               indexer_kl_weight=indexer_kl_weight, moe_dispatch=moe_dispatch)


DEFAULT_PARTITION = "type:DecoderLayerPipe"
CHECKPOINTABLE_LAYERS = ("DSADecoderLayerPipe", "DSAMTPLayerPipe")


def build_pipeline(config, *, dsa_stage="sparse", indexer_kl_weight=1.0, **kwargs):
    """The model as a DeepSpeed PipelineModule (recipes.layers.pipe.build_pipeline's
    arguments), plus the DSA training stage: under ``"warmup"`` every parameter but the
    indexers' is frozen (the trainer passes only parameters that require a gradient to
    deepspeed.initialize), and activation checkpointing uses DeepSpeed's non-reentrant
    checkpoint, since the first stage's frozen embedding output carries no gradient
    (the reentrant one would cut the backward off there)."""
    module_kwargs = {}
    if dsa_stage == "warmup":
        from deepspeed.runtime.activation_checkpointing.checkpointing import non_reentrant_checkpoint
        module_kwargs["activation_checkpoint_func"] = non_reentrant_checkpoint
    module = pipe.build_pipeline(SPEC, config, module_kwargs=module_kwargs, dsa_stage=dsa_stage,
                                 indexer_kl_weight=indexer_kl_weight, **kwargs)
    if dsa_stage == "warmup":
        freeze_for_warmup(module)
    return module


def loss_fn(config, *, mtp_loss_weight):
    return CausalLMLoss(mtp_loss_weight, mtp=config.num_mtp_layers > 0)


def config_from_hf(fields):
    """The recipe fields of a transformers DeepseekV32 config.json."""
    names = {f.name for f in dataclasses.fields(DeepseekV32Config)}
    out = {k: v for k, v in fields.items() if k in names}
    if "num_nextn_predict_layers" in fields:
        out["num_mtp_layers"] = fields["num_nextn_predict_layers"]
    if fields.get("first_k_dense_replace", 0) >= fields.get("num_hidden_layers", 0):
        out["n_routed_experts"] = 0          # every layer dense (to_hf_config's placeholders)
    return out


# ---- planner figures (ds_ext/planner/ asks the recipe spec for these) ---------

def mean_selected_keys(config, *, seq_len):
    """Keys a query attends to, averaged over positions t in [0, seq_len] (the
    continuous mean of min(index_topk, t)): seq_len / 2 while seq_len <= index_topk,
    as for dense causal attention."""
    k, s = config.index_topk, seq_len
    return s / 2 if s <= k else k - k * k / (2 * s)


def attention_flops(config, kind, *, seq_len, dsa_stage="sparse", **options):
    """Forward FLOPs per token of one layer's non-weight matmuls, averaged over
    positions (mean over t of the keys query t sees; seq_len / 2 causal keys):

    - the indexer's scores over all causal keys: per key index_n_heads x (2 x
      index_head_dim for q . k, + 2 for the weighted sum over heads);
    - the main attention over min(index_topk, t) keys (``mean_selected_keys``): per key
      2 x heads x (qk_head_dim + v_head_dim), as deepseek_v3's 2-FLOP convention;
    - in training (``dsa_stage`` "warmup" or "sparse", None for inference) the KL
      target's own q . k over the attended keys: 2 x heads x qk_head_dim per key
      (the warm-up attends densely).

    These are the FLOPs of the algorithm as a sparse kernel runs it; the masked SDPA
    of recipes/layers/dsa.py computes every key of the row (seq_len, not causal, per
    query) for the indexer, the attention and the KL target."""
    if kind not in ("dense", "moe", "mtp-dense", "mtp-moe"):
        return 0.0
    c = config
    qk = c.qk_nope_head_dim + c.qk_rope_head_dim
    causal = seq_len / 2
    attended = causal if dsa_stage == "warmup" else mean_selected_keys(c, seq_len=seq_len)
    indexer = causal * c.index_n_heads * (2 * c.index_head_dim + 2)
    attention = attended * 2 * c.num_attention_heads * (qk + c.v_head_dim)
    target = attended * 2 * c.num_attention_heads * qk if dsa_stage is not None else 0.0
    return indexer + attention + target


def activation_bytes(config, kind, *, seq_len, act_bytes, fused_attention=True, dsa_stage="sparse", **options):
    """Bytes autograd keeps per token for one layer of ``kind``, counted from what the
    DSA layers save: deepseek_v3's MLA and feed-forward terms (recipes/layers/costs.py
    activation_bytes; the sparse attention's boolean mask is folded into the
    scores, not kept) plus, while the indexer learns (``dsa_stage`` "warmup" or
    "sparse"; None: no indexer loss), its graph: the rotated queries (index_n_heads x
    index_head_dim) and key, the key projection's output (LayerNorm's input) and
    LayerNorm's fp32 mean and rstd, the fp32 per-head weights, and the KL's fp32
    gradient over the row's seq_len keys (the per-head scores are recomputed in the
    backward). Its inputs are the main graph's (detached views of the same tensors),
    except in the dense warm-up, where the main model keeps nothing and the indexer
    keeps the hidden state and the query latent itself."""
    c, a = config, act_bytes
    main = costs.activation_bytes(c, kind, seq_len=seq_len, act_bytes=a, fused_attention=fused_attention)
    if kind not in ("dense", "moe", "mtp-dense", "mtp-moe") or dsa_stage is None:
        return main
    heads, dim = c.index_n_heads, c.index_head_dim
    indexer = a * (heads * dim + 2 * dim) + 4 * heads + 8 + 4 * seq_len
    if dsa_stage == "warmup":
        return indexer + a * (c.hidden_size + c.q_lora_rank)
    return main + indexer


SPEC = RecipeSpec(
    name="deepseek_v32",
    config_class=DeepseekV32Config,
    presets=PRESETS,
    layer_specs=layer_specs,
    loss_fn=loss_fn,
    build=build_pipeline,
    default_partition=DEFAULT_PARTITION,
    checkpointable_layers=CHECKPOINTABLE_LAYERS,
    planner=PlannerCosts(layer_kind=costs.layer_kind, activation_bytes=activation_bytes,
                         attention_flops=attention_flops),
    hf=TransformersAdapter(
        model_class="DeepseekV32ForCausalLM", to_hf_config=DeepseekV32Config.to_hf_config,
        from_hf_config=config_from_hf,
        identity_fields=("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                         "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                         "tie_word_embeddings", "n_routed_experts", "moe_intermediate_size", "first_k_dense_replace",
                         "index_topk", "index_n_heads", "index_head_dim")),
    decoder=DSADecoder,
    sections={"dsa": DsaSection},
    options=train_options,
    build_options=pipe.build_options,
    routed_experts=moe.routed_experts,
    hooks=(moe.balancing_hook(), INDEXER_LOSS),
)


if __name__ == "__main__":
    from recipes.layers.counts import print_stage_parameters
    print_stage_parameters(SPEC, default_preset="deepseek-v3.2")

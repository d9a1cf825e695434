"""DeepSeek-V4 recipe: hybrid attention (a 128-token sliding window in every layer, plus
heavily compressed (HCA) or compressed sparse (CSA) entries of the past,
recipes/layers/hybrid_attention.py), manifold-constrained hyper-connections around every
sublayer (recipes/layers/hyper.py), and DeepSeekMoE in every layer, the first layers
routed by a token-id table (hash routing), the rest by sqrt(softplus) scores with the
bias used for the choice only; SwiGLU clamped at ``swiglu_limit``. Made by copying
recipes/deepseek_v32.py; field names are transformers' DeepseekV4Config names, so
``to_hf_config()`` gives a config transformers loads as the same model and
``config_from_hf`` reads any config transformers accepts (its legacy ``compress_ratios``,
``num_hash_layers`` and nested ``rope_parameters`` included).

Not built yet: the MTP module (``num_nextn_predict_layers`` is exported, the module is
not trained), FlashMLA/DeepGEMM kernels (attention is masked dense attention on every
device), document-bounded attention (the compressors pool across documents).

    python -m recipes.deepseek_v4 --preset deepseek-v4-flash --stages 8
prints the parameters each pipeline rank holds, built on the meta device, and the
totals.
"""

import dataclasses
from dataclasses import dataclass, field

from ds_ext.errors import ConfigError
from recipes.layers import moe, pipe
from recipes.layers import hybrid_attention as ha
from recipes.layers.dispatch import DEFAULT_DISPATCH
from recipes.layers.dsa import INDEXER_LOSS, DsaSection, check_dsa, freeze_for_warmup, train_options
from recipes.layers.mlp import ACTIVATIONS
from recipes.layers.moe import SCORE_FUNCTIONS
from recipes.layers.pipe import CausalLMLoss, LMHeadPipe, tied_lm_head
from recipes.layers.rope import check_rope_parameters
from recipes.layers.v4 import HASH, MLP_LAYER_TYPES, V4DecoderLayerPipe, V4EmbeddingPipe, V4HeadNormPipe
from recipes.layers.v4_cache import V4Decoder
from recipes.spec import PlannerCosts, RecipeSpec, TransformersAdapter
from recipes.step import NotCostable


@dataclass(kw_only=True)
class DeepseekV4Config:
    # shape
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    max_position_embeddings: int = 4096
    hidden_act: str = "silu"
    rms_norm_eps: float = 1e-6
    initializer_range: float = 0.02
    tie_word_embeddings: bool = False
    # attention: one KV head of head_dim (K = V), RoPE on the last head_dim x partial_rotary_factor
    head_dim: int
    q_lora_rank: int
    partial_rotary_factor: float
    sliding_window: int = 128
    o_groups: int
    o_lora_rank: int
    # per layer: "sliding_attention", "compressed_sparse_attention" or "heavily_compressed_attention"
    layer_types: list[str]
    compress_rates: dict = field(default_factory=lambda: {ha.CSA: 4, ha.HCA: 128})
    # the lightning indexer of CSA layers
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    # rope: sliding layers at rope_theta; compressed layers at compress_rope_theta with
    # rope_parameters' scaling (YaRN for the published models)
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    rope_parameters: dict = field(default_factory=lambda: {"rope_type": "default"})
    # mhc
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    # moe: every layer; per layer "hash_moe" (token-id table) or "moe" (scores + bias)
    moe_intermediate_size: int
    n_routed_experts: int
    n_shared_experts: int = 1
    num_experts_per_tok: int
    scoring_func: str = "sqrtsoftplus"
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    mlp_layer_types: list[str]
    swiglu_limit: float = 10.0
    # mtp: the published models have one module; not built here (0 only)
    num_mtp_layers: int = 0

    def check(self, where="recipe"):
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "head_dim",
                     "q_lora_rank", "o_groups", "o_lora_rank", "index_n_heads", "index_head_dim", "index_topk",
                     "moe_intermediate_size", "n_routed_experts", "num_experts_per_tok", "hc_mult",
                     "hc_sinkhorn_iters", "sliding_window", "max_position_embeddings", "rms_norm_eps",
                     "initializer_range", "routed_scaling_factor", "swiglu_limit"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{where}.{name} must be positive, got {getattr(self, name)}")
        ha.check_layer_types(self, where)
        types = list(self.mlp_layer_types)
        if len(types) != self.num_hidden_layers or any(t not in MLP_LAYER_TYPES for t in types):
            raise ConfigError(f"{where}.mlp_layer_types must give one of {list(MLP_LAYER_TYPES)} for each of the "
                              f"{self.num_hidden_layers} layers, got {types!r}")
        if (self.num_attention_heads * self.head_dim) % self.o_groups:
            raise ConfigError(f"{where}.o_groups ({self.o_groups}) must divide num_attention_heads x head_dim "
                              f"({self.num_attention_heads * self.head_dim})")
        rope = ha.rope_dim(self)
        if not 0 < rope <= min(self.head_dim, self.index_head_dim) or rope % 2:
            raise ConfigError(f"{where}.partial_rotary_factor {self.partial_rotary_factor} gives {rope} rotary "
                              f"channels: they must be even and at most head_dim and index_head_dim")
        if self.num_experts_per_tok > self.n_routed_experts:
            raise ConfigError(f"{where}.num_experts_per_tok ({self.num_experts_per_tok}) exceeds n_routed_experts "
                              f"({self.n_routed_experts})")
        if self.scoring_func not in SCORE_FUNCTIONS:
            raise ConfigError(f"{where}.scoring_func {self.scoring_func!r} is not one of {list(SCORE_FUNCTIONS)}")
        if self.hidden_act not in ACTIVATIONS:
            raise ConfigError(f"{where}.hidden_act {self.hidden_act!r} is not supported: use one of "
                              f"{list(ACTIVATIONS)}")
        if self.num_mtp_layers != 0:
            raise ConfigError(f"{where}.num_mtp_layers {self.num_mtp_layers}: DeepSeek-V4's MTP module is not built "
                              f"in this recipe yet; set it to 0")
        check_rope_parameters(dict(self.rope_parameters, rope_theta=self.compress_rope_theta),
                              where=f"{where}.rope_parameters")

    def is_moe_layer(self, layer_idx):
        return True

    def num_moe_layers(self):
        return self.num_hidden_layers

    def hash_layers(self):
        return [i for i, t in enumerate(self.mlp_layer_types) if t == HASH]

    def to_hf_config(self):
        """The same model as a ``transformers.DeepseekV4Config`` (MTP as
        ``num_nextn_predict_layers``, which transformers does not build either)."""
        from transformers import AutoConfig
        fields = dataclasses.asdict(self)
        fields["num_nextn_predict_layers"] = fields.pop("num_mtp_layers")
        return AutoConfig.for_model("deepseek_v4", **fields, num_key_value_heads=1, pad_token_id=None)


def _v4_layer_types(layers, *, first):
    """DeepSeek-V4's attention pattern: ``first`` for layers 0 and 1, then CSA on even
    and HCA on odd layers."""
    return [first] * 2 + [ha.CSA if i % 2 == 0 else ha.HCA for i in range(2, layers)]


def _hash_first(layers, hashed=3):
    return [HASH] * hashed + ["moe"] * (layers - hashed)


# YaRN of the published models' compressed layers: x16 from a 64K pretraining context
_V4_YARN = {"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 65536, "beta_fast": 32.0,
            "beta_slow": 1.0}
_V4_COMMON = dict(vocab_size=129280, max_position_embeddings=1048576, head_dim=512, partial_rotary_factor=64 / 512,
                  o_lora_rank=1024, index_n_heads=64, index_head_dim=128, rope_parameters=_V4_YARN,
                  n_shared_experts=1, num_experts_per_tok=6, swiglu_limit=10.0)
# Presets. deepseek-v4-flash and deepseek-v4-pro are the published shapes (Flash: 43
# layers, the first two sliding-window only; Pro: 61 layers, the first two HCA; both
# then CSA on even and HCA on odd layers, hash routing in the first three); tiny has all
# three attention kinds, hash and score routing and 4 streams, and sequences of 256
# tokens give HCA 2 entries and CSA 64, of which the indexer keeps 16.
PRESETS = {
    "tiny": dict(vocab_size=512, hidden_size=128, num_hidden_layers=4, num_attention_heads=4,
                 max_position_embeddings=1024, head_dim=64, q_lora_rank=64, partial_rotary_factor=0.25,
                 sliding_window=32, o_groups=2, o_lora_rank=32,
                 layer_types=[ha.SLIDING, ha.CSA, ha.HCA, ha.CSA], compress_rates={ha.CSA: 4, ha.HCA: 128},
                 index_n_heads=4, index_head_dim=32, index_topk=16, moe_intermediate_size=96, n_routed_experts=8,
                 num_experts_per_tok=2, routed_scaling_factor=1.5, mlp_layer_types=_hash_first(4, 1)),
    "deepseek-v4-flash": dict(_V4_COMMON, hidden_size=4096, num_hidden_layers=43, num_attention_heads=64,
                              q_lora_rank=1024, o_groups=8, layer_types=_v4_layer_types(43, first=ha.SLIDING),
                              index_topk=512, moe_intermediate_size=2048, n_routed_experts=256,
                              routed_scaling_factor=1.5, mlp_layer_types=_hash_first(43)),
    "deepseek-v4-pro": dict(_V4_COMMON, hidden_size=7168, num_hidden_layers=61, num_attention_heads=128,
                            q_lora_rank=1536, o_groups=16, layer_types=_v4_layer_types(61, first=ha.HCA),
                            index_topk=1024, moe_intermediate_size=3072, n_routed_experts=384,
                            routed_scaling_factor=2.5, mlp_layer_types=_hash_first(61)),
}


def make_config(preset, overrides=None, *, where="seekspeed.recipe"):
    """A checked config from a named preset plus field overrides."""
    return SPEC.make_config(preset, overrides, where=where)


def layer_specs(config, *, seed, ep_size=1, ep_rank=0, document_token=None, moe_dispatch=DEFAULT_DISPATCH,
                dsa_stage="sparse", indexer_kl_weight=1.0):
    """The model as DeepSpeed layer specs: the embedding into hc_mult streams (the ids
    travel along), the decoder layers, the head norm (HyperHead + RMSNorm), the head.
    ``dsa_stage`` and ``indexer_kl_weight``: how CSA's indexers train (seekspeed.dsa)."""
    from deepspeed.pipe import LayerSpec, TiedLayerSpec
    check_dsa(dsa_stage, indexer_kl_weight)
    if document_token is not None:
        raise ConfigError("document-bounded attention (seekspeed.data.attention \"document\") is not built for "
                          "DeepSeek-V4: its compressors pool windows across document boundaries; use \"causal\"")
    if config.tie_word_embeddings:
        embed = TiedLayerSpec("embed", V4EmbeddingPipe, config, seed=seed, tied_weight_attr=["embed_tokens.weight"])
    else:
        embed = LayerSpec(V4EmbeddingPipe, config, seed=seed)
    specs = [embed]
    specs += [LayerSpec(V4DecoderLayerPipe, config, layer_idx=i, seed=seed, ep_size=ep_size, ep_rank=ep_rank,
                        moe_dispatch=moe_dispatch, dsa_stage=dsa_stage, indexer_kl_weight=indexer_kl_weight)
              for i in range(config.num_hidden_layers)]
    specs.append(LayerSpec(V4HeadNormPipe, config, seed=seed))
    specs.append(TiedLayerSpec("embed", V4EmbeddingPipe, config, seed=seed, forward_fn=tied_lm_head,
                               tied_weight_attr=["embed_tokens.weight"]) if config.tie_word_embeddings
                 else LayerSpec(LMHeadPipe, config, seed=seed))
    return specs


DEFAULT_PARTITION = "type:V4DecoderLayerPipe"
CHECKPOINTABLE_LAYERS = ("V4DecoderLayerPipe",)


def loss_fn(config, *, mtp_loss_weight):
    return CausalLMLoss()


def build_pipeline(config, *, dsa_stage="sparse", indexer_kl_weight=1.0, **kwargs):
    """The model as a DeepSpeed PipelineModule (recipes.layers.pipe.build_pipeline's
    arguments) and the indexers' training stage: under ``"warmup"`` every parameter but
    the indexers' is frozen and activation checkpointing uses DeepSpeed's non-reentrant
    checkpoint (deepseek_v32's build_pipeline says why)."""
    module_kwargs = {}
    if dsa_stage == "warmup":
        from deepspeed.runtime.activation_checkpointing.checkpointing import non_reentrant_checkpoint
        module_kwargs["activation_checkpoint_func"] = non_reentrant_checkpoint
    module = pipe.build_pipeline(SPEC, config, module_kwargs=module_kwargs, dsa_stage=dsa_stage,
                                 indexer_kl_weight=indexer_kl_weight, **kwargs)
    if dsa_stage == "warmup":
        freeze_for_warmup(module)
    return module


def config_from_hf(fields):
    """The recipe fields of any config transformers' DeepseekV4Config accepts: the
    legacy ``compress_ratios`` (0 / 4 / 128 per layer), ``num_hash_layers`` and
    ``compress_rate_csa`` / ``compress_rate_hca``, and ``rope_parameters`` nested by
    RoPE kind ({"main": ..., "compress": ...}) or flat; fields transformers fills by
    default are filled the same way."""
    names = {f.name for f in dataclasses.fields(DeepseekV4Config)}
    out = {k: v for k, v in fields.items() if k in names and v is not None}
    layers = fields["num_hidden_layers"]
    if "num_nextn_predict_layers" in fields:
        out["num_mtp_layers"] = 0          # the module is not built here; a checkpoint's MTP tensors are ignored
    rates = dict(fields.get("compress_rates") or {ha.CSA: 4, ha.HCA: 128})
    for key, kind in (("compress_rate_csa", ha.CSA), ("compress_rate_hca", ha.HCA)):
        if fields.get(key) is not None:
            rates[kind] = fields[key]
    out["compress_rates"] = rates
    if fields.get("layer_types") is None:
        ratios = fields.get("compress_ratios")
        if ratios is not None:
            out["layer_types"] = ha.layer_types_from_ratios(ratios, "config.json")[:layers]
        else:       # transformers' default: 2 HCA, then HCA / CSA interleaved
            out["layer_types"] = [ha.HCA] * min(layers, 2) + [ha.CSA if i % 2 else ha.HCA
                                                              for i in range(max(layers - 2, 0))]
    if fields.get("mlp_layer_types") is None:
        hashed = fields.get("num_hash_layers", 3)
        out["mlp_layer_types"] = [HASH] * min(layers, hashed) + ["moe"] * max(0, layers - hashed)
    if fields.get("partial_rotary_factor") is None:
        rope = fields.get("qk_rope_head_dim", 64)
        out["partial_rotary_factor"] = rope / fields.get("head_dim", 512)
    rope = fields.get("rope_parameters") or fields.get("rope_scaling") or {}
    if isinstance(rope.get("compress"), dict):
        rope = rope["compress"]
    out["rope_parameters"] = {k: v for k, v in rope.items()
                              if k not in ("rope_theta", "partial_rotary_factor", "attention_factor", "type")}
    out["rope_parameters"].setdefault("rope_type", rope.get("type", "default"))
    return out


# ---- planner figures (ds_ext/planner/ asks the recipe spec for these) ---------

KINDS = {ha.SLIDING: "sliding-moe", ha.CSA: "csa-moe", ha.HCA: "hca-moe"}
LAYER_TYPE_OF_KIND = {kind: layer_type for layer_type, kind in KINDS.items()}


def layer_kind(spec, config):
    cls = spec.typename
    if issubclass(cls, V4EmbeddingPipe):
        return "head" if getattr(spec, "forward_fn", None) is tied_lm_head else "embed"
    if issubclass(cls, V4DecoderLayerPipe):
        return KINDS[config.layer_types[spec.module_kwargs["layer_idx"]]]
    if issubclass(cls, V4HeadNormPipe):
        return "norm"
    if issubclass(cls, LMHeadPipe):
        return "head"
    raise NotCostable("not one of recipes.layers.v4's V4EmbeddingPipe / V4DecoderLayerPipe / V4HeadNormPipe or "
                      "LMHeadPipe")


def attention_flops(config, kind, *, seq_len, **options):
    """Forward FLOPs per token that are not weight matmuls, averaged over positions:
    the attention's scores and weighted sums (heads x head_dim x 2 x 2 per key, K = V)
    over the keys a query sees (the window and the visible compressed entries, at most
    index_topk in CSA); the compressors' gated pooling (a softmax-weighted sum per
    channel: ~4 x width FLOPs a token, 2 windows' worth with CSA's overlap); in CSA the
    indexer's scores over every visible entry (index_n_heads x (2 x index_head_dim + 2)
    per entry); the hyper-connections' Sinkhorn iterations (N x N x 4 each, twice a layer)."""
    layer_type = LAYER_TYPE_OF_KIND.get(kind)
    if layer_type is None:
        return 0.0
    c = config
    keys = _mean_keys(c, layer_type, seq_len=seq_len)
    flops = 4 * c.num_attention_heads * c.head_dim * keys
    sinkhorn = 2 * c.hc_sinkhorn_iters * 4 * c.hc_mult ** 2
    if layer_type == ha.SLIDING:
        return flops + sinkhorn
    flops += 4 * c.head_dim * (2 if layer_type == ha.CSA else 1)
    if layer_type == ha.CSA:
        entries = seq_len / 2 / c.compress_rates[ha.CSA]            # visible entries, averaged over positions
        flops += c.index_n_heads * (2 * c.index_head_dim + 2) * entries + 4 * c.index_head_dim * 2
    return flops + sinkhorn


def _mean_keys(config, layer_type, *, seq_len):
    """Keys a query attends to, averaged over positions 0..seq_len."""
    window = min(config.sliding_window, seq_len)
    mean_window = window - window * window / (2 * seq_len)      # min(t, window) averaged over t
    if layer_type == ha.SLIDING:
        return mean_window
    rate = config.compress_rates[layer_type]
    entries = seq_len / 2 / rate
    if layer_type == ha.CSA:
        k, last = config.index_topk, seq_len / rate
        entries = entries if last <= k else k - k * k / (2 * last)
    return mean_window + entries


def activation_bytes(config, kind, *, seq_len, act_bytes, fused_attention=True, **options):
    """Bytes autograd keeps per token of one layer (counted from what the layers save):
    the streams around each sublayer (hc_mult x hidden, twice) and the hyper-connections'
    fp32 weights; the query path (q_lora_rank twice, heads x head_dim three times: the
    projection, the normed and the rotated query), the K = V entry, the attention output
    and its inverse rotation, the grouped projection's groups; the scores over the
    attended keys (fp32 probabilities: heads x keys, masked dense attention keeps a row
    of seq_len + entries); the compressors' projections and gates; the MoE terms of
    recipes/layers/costs.py (experts, router, shared expert)."""
    c, a = config, act_bytes
    h = c.hidden_size
    if kind == "embed":
        return 8 + 8            # ids, twice (the ids travel along)
    if kind == "norm":
        return a * (c.hc_mult * h + 2 * h)
    if kind == "head":
        return h * a + 4 * c.vocab_size
    layer_type = LAYER_TYPE_OF_KIND.get(kind)
    if layer_type is None:
        raise NotCostable(f"kind {kind!r}")
    heads, d = c.num_attention_heads, c.head_dim
    streams = a * 2 * 2 * c.hc_mult * h + 4 * 2 * (2 * c.hc_mult + c.hc_mult ** 2) * (1 + c.hc_sinkhorn_iters)
    rate = c.compress_rates.get(layer_type, 0)
    entries = seq_len // rate if rate else 0
    keys = (seq_len + entries) if not fused_attention else _mean_keys(c, layer_type, seq_len=seq_len)
    attention = a * (2 * h + 2 * c.q_lora_rank + 5 * heads * d + 3 * d + c.o_groups * c.o_lora_rank) \
        + 4 * heads * keys
    if layer_type != ha.SLIDING:
        width = 2 * d if layer_type == ha.CSA else d
        attention += a * 2 * width + 4 * width
        if layer_type == ha.CSA:
            attention += a * (4 * c.index_head_dim + c.index_n_heads * c.index_head_dim) \
                + 4 * (c.index_n_heads + entries)
    k, inter = c.num_experts_per_tok, c.moe_intermediate_size
    ffn = a * (2 * h + k * (2 * h + 5 * inter) + 4 * inter) + 4 * (h + 2 * c.n_routed_experts)
    return streams + attention + ffn


def boundary_bytes(config, *, act_bytes):
    """A stage sends the next the hc_mult streams and the token ids (int64) per token."""
    return config.hc_mult * config.hidden_size * act_bytes + 8


SPEC = RecipeSpec(
    name="deepseek_v4",
    config_class=DeepseekV4Config,
    presets=PRESETS,
    layer_specs=layer_specs,
    loss_fn=loss_fn,
    default_partition=DEFAULT_PARTITION,
    checkpointable_layers=CHECKPOINTABLE_LAYERS,
    planner=PlannerCosts(layer_kind=layer_kind, activation_bytes=activation_bytes, attention_flops=attention_flops,
                         moe_kinds=tuple(KINDS.values()), boundary_bytes=boundary_bytes),
    hf=TransformersAdapter(
        model_class="DeepseekV4ForCausalLM", to_hf_config=DeepseekV4Config.to_hf_config,
        from_hf_config=config_from_hf,
        identity_fields=("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "head_dim",
                         "q_lora_rank", "o_groups", "o_lora_rank", "layer_types", "mlp_layer_types", "hc_mult",
                         "tie_word_embeddings", "n_routed_experts", "moe_intermediate_size", "index_n_heads",
                         "index_head_dim")),
    build=build_pipeline,
    sections={"dsa": DsaSection},
    options=train_options,
    build_options=pipe.build_options,
    routed_experts=moe.routed_experts,
    hooks=(moe.balancing_hook(), INDEXER_LOSS),
    decoder=V4Decoder,
)


if __name__ == "__main__":
    from recipes.layers.counts import print_stage_parameters
    print_stage_parameters(SPEC, default_preset="deepseek-v4-flash")

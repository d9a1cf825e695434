"""What the planner (ds_ext/planner/) needs to cost the layers of this
directory: each layer spec's kind, the bytes autograd keeps per token of each kind,
and the FLOPs that are not weight matmuls (attention). A recipe's PlannerCosts
(recipes/spec.py) points at these, or at its own where its layers differ.
"""

from recipes.step import NotCostable

ATTENTION_KINDS = ("dense", "moe", "mtp-dense", "mtp-moe")


def layer_kind(spec, config):
    """The kind of one layer spec of recipes.layers.pipe's classes (or subclasses)."""
    from .pipe import DecoderLayerPipe, EmbeddingPipe, FinalNormPipe, LMHeadPipe, MTPLayerPipe, tied_lm_head
    cls = spec.typename
    if issubclass(cls, EmbeddingPipe):
        return "head" if getattr(spec, "forward_fn", None) is tied_lm_head else "embed"
    if issubclass(cls, MTPLayerPipe):
        return "mtp-moe" if config.is_moe_layer(config.num_hidden_layers) else "mtp-dense"
    if issubclass(cls, DecoderLayerPipe):
        return "moe" if config.is_moe_layer(spec.module_kwargs["layer_idx"]) else "dense"
    if issubclass(cls, FinalNormPipe):
        return "norm"
    if issubclass(cls, LMHeadPipe):
        return "head"
    raise NotCostable("not a subclass of recipes.layers.pipe's Embedding/DecoderLayer/MTPLayer/FinalNorm/LMHead "
                      "Pipe")


def activation_bytes(config, kind, *, seq_len, act_bytes, fused_attention=True, **options):
    """Bytes autograd keeps per token for one layer of ``kind``, counted from the
    tensors our layers save: norms' inputs and outputs, the MLA projections (q low-rank
    path, latent, decoupled RoPE key), attention's q, k, v and output, the SwiGLU gates,
    and for MoE the router's fp32 scores and each of the k chosen experts' gates.
    Without a fused attention kernel (CPU's math path when the q/k and v head sizes
    differ) the softmax probabilities are kept too: heads x seq_len fp32 per token."""
    c, a = config, act_bytes
    h, heads = c.hidden_size, c.num_attention_heads
    qk = c.qk_nope_head_dim + c.qk_rope_head_dim
    if kind == "embed":
        return 8
    if kind == "norm":
        return 2 * h * a
    if kind == "head":
        return h * a + 4 * c.vocab_size             # input, fp32 log-softmax of the logits
    q_path = 2 * (c.q_lora_rank or 0)
    attention = a * (2 * h + q_path + 2 * c.kv_lora_rank + c.qk_rope_head_dim + 2 * heads * qk + 3 * heads * c.v_head_dim)
    attention += 4 * heads + (0 if fused_attention else 4 * heads * seq_len)
    if kind.endswith("moe"):
        k, inter, shared = c.num_experts_per_tok, c.moe_intermediate_size, c.moe_intermediate_size * c.n_shared_experts
        ffn = a * (2 * h + k * (2 * h + 5 * inter) + 4 * shared) + 4 * (h + 2 * c.n_routed_experts)
    else:
        ffn = a * (2 * h + 4 * c.intermediate_size)
    mtp = a * 5 * h if kind.startswith("mtp") else 0
    return attention + ffn + mtp


def full_attention_flops(config, *, seq_len):
    """Multiply-adds per token of attention over ``seq_len`` keys (scores and weighted
    sum): also the FLOPs per token of causal attention, averaged over the positions
    (2 FLOPs each over seq_len / 2 keys on average)."""
    c = config
    return c.num_attention_heads * seq_len * (c.qk_nope_head_dim + c.qk_rope_head_dim + c.v_head_dim)


def attention_flops(config, kind, *, seq_len, **options):
    """Forward FLOPs per token of MLA's causal attention, averaged over the positions:
    0 for layers without attention."""
    return full_attention_flops(config, seq_len=seq_len) if kind in ATTENTION_KINDS else 0.0

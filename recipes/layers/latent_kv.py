"""Generation with MLA's latent KV cache and absorbed weights (DeepSeek-V2, sec. 2.1).

The cache holds, per layer and token, only the normalised kv latent c (kv_lora_rank
values) and the shared rotary key (qk_rope_head_dim values). Attention never
materialises per-head keys or values:

    score_h(t) = (W_UK_h^T q_nope_h) . c_t + q_rope_h . k_rope_t      (W_UK folded into q)
    out_h      = W_UV_h (sum_t p_h(t) c_t)                            (W_UV applied once, after)

where kv_b_proj = [W_UK_h; W_UV_h] per head. The result equals the expanded
computation up to rounding; ``MLADecoder.logits_without_cache`` is that computation
(the model's own forward over the whole sequence) for comparison.
"""

import torch
import torch.nn.functional as F
from torch import nn

from . import rope


class LatentKVCache:
    """Per layer: latents [B, T, kv_lora_rank] and rotary keys [B, T, qk_rope_head_dim]."""

    def __init__(self, config, *, batch, max_tokens, dtype, device="cpu"):
        shape = (config.num_hidden_layers, batch, max_tokens)
        self.latent = torch.zeros(*shape, config.kv_lora_rank, dtype=dtype, device=device)
        self.k_rope = torch.zeros(*shape, config.qk_rope_head_dim, dtype=dtype, device=device)
        self.length = 0

    def bytes_per_token(self):
        per_layer = self.latent.shape[-1] * self.latent.element_size() + self.k_rope.shape[-1] * self.k_rope.element_size()
        return per_layer * self.latent.shape[0]


def full_kv_bytes_per_token(config, dtype=torch.bfloat16):
    """What a cache of expanded per-head keys and values would hold per token."""
    per_head = config.qk_nope_head_dim + config.qk_rope_head_dim + config.v_head_dim
    return config.num_hidden_layers * config.num_attention_heads * per_head * torch.tensor([], dtype=dtype).element_size()


def absorbed_attention(attn, x, cache, layer, start, *, keep=None):
    """MLA for new tokens ``x`` [B, S, H] at positions start..start+S-1, reading and
    extending layer ``layer`` of ``cache``; ``keep`` (bool [B, S, start+S]) limits the
    keys each query attends to (DeepSeek Sparse Attention's selection)."""
    batch, seq, _ = x.shape
    heads, d_nope, d_rope, d_v = attn.num_heads, attn.qk_nope_head_dim, attn.qk_rope_head_dim, attn.v_head_dim
    if attn.q_lora_rank is None:
        q = attn.q_proj(x)
    else:
        q = attn.q_b_proj(attn.q_a_layernorm(attn.q_a_proj(x)))
    q = q.view(batch, seq, heads, d_nope + d_rope).transpose(1, 2)
    q_nope, q_rot = torch.split(q, [d_nope, d_rope], dim=-1)
    latent, k_rot = torch.split(attn.kv_a_proj_with_mqa(x), [attn.kv_lora_rank, d_rope], dim=-1)
    latent = attn.kv_a_layernorm(latent)

    cos, sin = rope.cos_sin(attn.inv_freq, attn.rope_attention_factor, seq_len=start + seq, dtype=x.dtype,
                            device=x.device)
    cos, sin = cos[:, start:], sin[:, start:]
    q_rot, k_rot = rope.apply_rope(q_rot, k_rot.view(batch, 1, seq, d_rope), cos, sin, interleave=attn.rope_interleave)
    end = start + seq
    cache.latent[layer, :batch, start:end] = latent
    cache.k_rope[layer, :batch, start:end] = k_rot[:, 0]
    latents = cache.latent[layer, :batch, :end]              # [B, T, r]
    k_ropes = cache.k_rope[layer, :batch, :end]              # [B, T, d_rope]

    w = attn.kv_b_proj.weight.view(heads, d_nope + d_v, attn.kv_lora_rank)
    w_uk, w_uv = w[:, :d_nope], w[:, d_nope:]                 # [h, d_nope, r], [h, d_v, r]
    q_latent = torch.einsum("bhsd,hdr->bhsr", q_nope, w_uk)  # W_UK folded into the query
    scores = (torch.einsum("bhsr,btr->bhst", q_latent, latents) +
              torch.einsum("bhsd,btd->bhst", q_rot, k_ropes)) * attn.scaling
    causal = torch.arange(end, device=x.device)[None, :] > torch.arange(start, end, device=x.device)[:, None]
    if keep is not None:
        causal = causal | ~keep[:, None]
    scores = scores.masked_fill(causal, float("-inf"))
    probs = torch.softmax(scores.float(), dim=-1).to(x.dtype)
    out_latent = torch.einsum("bhst,btr->bhsr", probs, latents)
    out = torch.einsum("bhsr,hvr->bhsv", out_latent, w_uv)   # W_UV after the weighted sum
    return attn.o_proj(out.transpose(1, 2).reshape(batch, seq, heads * d_v))


def head_weight(modules, embedding):
    """The output projection among a reference's ``modules``: the head's weight, or the
    embedding's where the head is tied to it."""
    from .pipe import LMHeadPipe
    heads = [m for m in modules if isinstance(m, LMHeadPipe)]
    return heads[0].lm_head.weight if heads else embedding.embed_tokens.weight


class MLADecoder(nn.Module):
    """The main model path (no MTP) of a recipe's SequentialReference, for generation:
    its embedding, decoder layers (in order), final norm and head, found by class."""

    cache_class = LatentKVCache
    cache_name = "latent KV cache"

    def __init__(self, reference, config):
        super().__init__()
        from .pipe import DecoderLayerPipe, EmbeddingPipe, FinalNormPipe, MTPLayerPipe
        self.config = config
        modules = list(reference.layer_modules())
        self.embedding = next(m for m in modules if isinstance(m, EmbeddingPipe))
        self.layers = nn.ModuleList(m for m in modules if isinstance(m, DecoderLayerPipe)
                                    and not isinstance(m, MTPLayerPipe))
        self.norm = next(m for m in modules if isinstance(m, FinalNormPipe))
        self.head_weight = head_weight(modules, self.embedding)

    def _logits(self, hidden):
        return F.linear(self.norm(hidden), self.head_weight)

    @torch.no_grad()
    def logits_without_cache(self, ids):
        """The model's own forward over the whole sequence (expanded keys and values)."""
        hidden = self.embedding.embed_tokens(ids)
        for layer in self.layers:
            hidden = layer.block(hidden)
        return self._logits(hidden)

    @torch.no_grad()
    def forward_cached(self, ids, cache):
        """Logits for new tokens ``ids`` [B, S], attending to the cache and extending it."""
        start = cache.length
        hidden = self.embedding.embed_tokens(ids)
        for index, layer in enumerate(self.layers):
            hidden = hidden + absorbed_attention(layer.self_attn, layer.input_layernorm(hidden), cache, index, start)
            hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
        cache.length = start + ids.shape[1]
        return self._logits(hidden)

    @torch.no_grad()
    def generate(self, ids, *, max_new_tokens, use_cache=True, temperature=0.0, top_k=0, generator=None):
        """Append ``max_new_tokens`` tokens to ``ids`` [B, S]: greedy at temperature 0,
        otherwise sampled (optionally from the top k)."""
        dtype = self.head_weight.dtype
        cache = self.cache_class(self.config, batch=ids.shape[0], max_tokens=ids.shape[1] + max_new_tokens, dtype=dtype)
        out = ids
        logits = self.forward_cached(ids, cache) if use_cache else self.logits_without_cache(ids)
        for i in range(max_new_tokens):
            nxt = _pick(logits[:, -1].float(), temperature=temperature, top_k=top_k, generator=generator)
            out = torch.cat([out, nxt[:, None]], dim=1)
            if i + 1 == max_new_tokens:
                break
            logits = self.forward_cached(nxt[:, None], cache) if use_cache else self.logits_without_cache(out)
        return out


def _pick(logits, *, temperature, top_k, generator):
    if temperature <= 0:
        return logits.argmax(dim=-1)
    logits = logits / temperature
    if top_k:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator)[:, 0]

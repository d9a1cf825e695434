"""Generation for DeepSeek-V4 with its cache: per layer only what later tokens read.

- every layer: the last ``sliding_window`` tokens' K = V (normed, rotated);
- HCA and CSA layers: the compressed entries (rotated), and the compressor's tail, the
  kv and gate rows of tokens since the last complete window, pooled into one entry when
  the window completes;
- CSA layers besides: the overlap state (the last complete window's first series of
  kv and gate, which the next window's entry also pools), and the same three for the
  lightning indexer's keys at ``index_head_dim``.

A new token's attention reads the window and the entries its layer allows (HCA: every
visible entry; CSA: the indexer's top ``index_topk`` of the visible ones, or all of them
in the dense warm-up stage), exactly as the full forward's masks do; the mHC streams and
the MoE (hash layers read the new token ids) need no state. ``V4Cache.elements()`` is
what the cache holds, ``cache_elements`` the same count as arithmetic (the long-context
benchmark's figure), as transformers' DeepseekV4 cache layers hold it too.
"""

import torch
import torch.nn.functional as F
from torch import nn

from . import hybrid_attention as ha
from .latent_kv import MLADecoder, head_weight


def cache_elements(config, context):
    """Values one row's cache holds after ``context`` tokens, all layers."""
    c, total = config, 0
    for layer_type in c.layer_types:
        total += min(context, c.sliding_window) * c.head_dim
        if layer_type == ha.SLIDING:
            continue
        rate = c.compress_rates[layer_type]
        entries, tail = divmod(context, rate)
        if layer_type == ha.HCA:
            total += entries * c.head_dim + tail * 2 * c.head_dim           # entries; the tail's kv and gate
        else:
            for width in (c.head_dim, c.index_head_dim):                    # the compressor, the indexer's keys
                # entries; the tail's kv and gate, two series each; the overlap's first series of both
                total += entries * width + tail * 2 * 2 * width + (2 * rate * width if entries else 0)
    return total


class _Pool:
    """One compressor's cached state: entries [B, W, width] (rotated), the tail's kv
    and gate rows [B, t, channels], and for overlapping windows the last complete
    window's first series [B, rate, width] of each."""

    def __init__(self, rate, width, overlap):
        self.rate, self.width, self.overlap = rate, width, overlap
        self.entries = self.tail_kv = self.tail_gate = self.overlap_kv = self.overlap_gate = None

    def push(self, module, hidden, rotary):
        """Add the new tokens' rows; pool every window they complete. -> all entries."""
        kv, gate = module.kv_proj(hidden), module.gate_proj(hidden)
        if self.tail_kv is not None:
            kv, gate = torch.cat([self.tail_kv, kv], dim=1), torch.cat([self.tail_gate, gate], dim=1)
        done = kv.shape[1] // self.rate * self.rate
        first = 0 if self.entries is None else self.entries.shape[1]
        self.tail_kv, self.tail_gate = kv[:, done:], gate[:, done:]
        if done == 0:
            return self.entries if self.entries is not None else kv.new_zeros((kv.shape[0], 0, self.width))
        kv, gate = kv[:, :done], gate[:, :done]
        prior = self.overlap and self.overlap_kv is not None
        if prior:   # the previous window's first series, in the slots its own entry (dropped) reads as zeros
            pad = kv.new_zeros(self.overlap_kv.shape)
            kv = torch.cat([torch.cat([self.overlap_kv, pad], dim=-1), kv], dim=1)
            gate = torch.cat([torch.cat([self.overlap_gate, pad], dim=-1), gate], dim=1)
        new = ha._compress(kv, gate, module.position_bias, rate=self.rate, overlap=self.overlap, head_dim=self.width,
                           norm=module.kv_norm)[:, 1 if prior else 0:]
        if self.overlap:
            self.overlap_kv, self.overlap_gate = kv[:, -self.rate:, :self.width], gate[:, -self.rate:, :self.width]
        new = ha.rotated_entries(new, rotary, self.rate, first)
        self.entries = new if self.entries is None else torch.cat([self.entries, new], dim=1)
        return self.entries

    def elements(self):
        return sum(t[0].numel() for t in (self.entries, self.tail_kv, self.tail_gate, self.overlap_kv,
                                          self.overlap_gate) if t is not None)


class _LayerCache:
    def __init__(self, config, layer_type):
        self.window = None
        self.compressor = self.indexer = None
        if layer_type != ha.SLIDING:
            rate = config.compress_rates[layer_type]
            overlap = layer_type == ha.CSA
            self.compressor = _Pool(rate, config.head_dim, overlap)
            if overlap:
                self.indexer = _Pool(rate, config.index_head_dim, True)

    def elements(self):
        return sum(p.elements() for p in (self.compressor, self.indexer) if p is not None) + \
            (self.window[0].numel() if self.window is not None else 0)


class V4Cache:
    """The cache of every layer, for ``batch`` rows; ``max_tokens`` and ``dtype`` as the
    latent cache takes them (its tensors grow with the tokens, in the model's dtype)."""

    def __init__(self, config, *, batch, max_tokens=None, dtype=None, device="cpu"):
        self.layers = [_LayerCache(config, t) for t in config.layer_types]
        self.length = 0

    def elements(self):
        """Values held for one row, all layers."""
        return sum(layer.elements() for layer in self.layers)


def cached_attention(attn, x, positions, state):
    """``attn`` (a HybridAttention) for new tokens ``x`` [B, S, H] at ``positions``
    [B, S], reading and extending its layer's ``state``."""
    q, kv, q_residual, rotation = attn.project(x, positions)
    keys = kv[:, 0] if state.window is None else torch.cat([state.window, kv[:, 0]], dim=1)
    key_positions = positions[:, -1:] - keys.shape[1] + 1 + torch.arange(keys.shape[1], device=x.device)
    mask = ha.sliding_mask(positions, attn.window, x.dtype, key_positions)
    state.window = keys[:, -attn.window:]
    keys = keys.unsqueeze(1)
    if state.compressor is not None:
        entries = state.compressor.push(attn.compressor, x, attn.rotary)
        if attn.layer_type == ha.CSA:
            indexer = attn.compressor.indexer
            index_keys = state.indexer.push(indexer, x, attn.rotary)
            scores = indexer.score_keys(index_keys, x, q_residual, positions, attn.rotary)
            attended = attn.compressor.attended(scores, positions, dense=attn.stage == "warmup")
        else:
            attended = ha._visible(positions, entries.shape[1], state.compressor.rate)
        keys = torch.cat([keys, entries.unsqueeze(1)], dim=2)
        mask = torch.cat([mask, ha.entry_bias(attended, mask.dtype)], dim=-1)
    out, _ = attn._attend(q, keys, mask)
    return attn.output(out, rotation)


class V4Decoder(MLADecoder):
    """Generation for a DeepSeek-V4 recipe module (its SequentialReference): the
    embedding into ``hc_mult`` streams, the decoder layers over the V4 cache, the
    HyperHead and norm, the head."""

    cache_class = V4Cache
    cache_name = "V4 cache: window, compressed entries, indexer keys"

    def __init__(self, reference, config):
        nn.Module.__init__(self)
        from .v4 import V4DecoderLayerPipe, V4EmbeddingPipe, V4HeadNormPipe
        self.config = config
        modules = list(reference.layer_modules())
        self.embedding = next(m for m in modules if isinstance(m, V4EmbeddingPipe))
        self.layers = nn.ModuleList(m for m in modules if isinstance(m, V4DecoderLayerPipe))
        self.head_norm = next(m for m in modules if isinstance(m, V4HeadNormPipe))
        self.head_weight = head_weight(modules, self.embedding)

    @torch.no_grad()
    def logits_without_cache(self, ids):
        x = self.embedding(ids)
        for layer in self.layers:
            x = layer(x)
        return F.linear(self.head_norm(x), self.head_weight)

    @torch.no_grad()
    def forward_cached(self, ids, cache):
        start = cache.length
        positions = (start + torch.arange(ids.shape[1], device=ids.device)).unsqueeze(0).expand(ids.shape[0], -1)
        streams, _ = self.embedding(ids)
        for layer, state in zip(self.layers, cache.layers):
            def attend(x, attn=layer.self_attn, state=state):
                return cached_attention(attn, x, positions, state), None
            streams, _ = layer.block(streams, ids, attend=attend)
        cache.length = start + ids.shape[1]
        return F.linear(self.head_norm((streams, ids)), self.head_weight)

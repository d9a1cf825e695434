"""DeepSeek-V4's attention: single-KV-head MQA where one projection serves as key and
value (K = V), over a sliding window of the latest ``sliding_window`` tokens plus, in
compressed layers, entries that pool whole windows of the past:

- sliding (``layer_types`` "sliding_attention"): the window only;
- HCA ("heavily_compressed_attention"): every ``m'`` (128) tokens pooled into one entry
  by a per-channel softmax gate with a position bias, normed and rotated; a query sees
  every entry whose window lies wholly in its past;
- CSA ("compressed_sparse_attention"): entries every ``m`` (4) tokens over overlapping
  windows of 2m (each token feeds its own window's entry and the next one's), and a
  lightning indexer that keeps ``index_topk`` of them per query.

Queries come through a low-rank path (``q_a_proj`` -> RMSNorm -> ``q_b_proj``) with an
unweighted per-head RMSNorm; RoPE rotates the last ``qk_rope_head_dim`` channels of each
head in interleaved pairs ("main" frequencies in sliding layers, the YaRN-scaled
"compress" ones in compressed layers), and the inverse rotation is applied to the
attention output (since V = K carries the rotation). Each head has a learned attention
sink (a logit with no value); the output goes through a grouped low-rank projection
(``o_a_proj`` per group of heads, then ``o_b_proj``).

Every computation mirrors transformers' DeepseekV4 modules operation by operation (the
same reductions, casts and mask values), so fp32 outputs agree to rounding of the same
operations and the indexer ranks the same scores. One deliberate difference: on equal
scores at the top-k boundary (ReLU zeros, common at initialisation) the earliest entry
wins (``first_topk``), where transformers' ``topk`` leaves the choice to the row's
length, so a cached decode step would not select as the full forward does. Unlike
transformers, the indexer learns: its KL loss against the main attention over the compressed entries (DeepSeek-V3.2's objective,
recipes/layers/dsa.py) enters the gradient through an identity's backward.

Attention here is the masked dense form (scores over the whole window and every
compressed entry), O(S^2) in memory: a CPU and correctness path, not FlashMLA's sparse
kernels.
"""

import torch
import torch.nn.functional as F
from torch import nn

from ds_ext.errors import ConfigError
from ds_ext.muon import muon_exempt
from ds_ext.pipe.zero_bubble import Linear

from .dsa import IndexerLoss, indexer_kl
from .hyper import unweighted_rms_norm
from .rope import inv_freq_and_attention_factor

SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
LAYER_TYPES = (SLIDING, CSA, HCA)
# the legacy per-layer compress_ratios (0 / 4 / 128) and the layer type each names
RATIO_TO_LAYER_TYPE = {0: SLIDING, 4: CSA, 128: HCA}


class Fp32RMSNorm(nn.Module):
    """RMSNorm whose product with the weight is taken in fp32 and cast once (V4's)."""

    def __init__(self, size, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, dtype=torch.float32))
        self.eps = eps

    def forward(self, x):
        x32 = x.to(torch.float32)
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * x32).to(x.dtype)


def rope_dim(config):
    return int(config.head_dim * config.partial_rotary_factor)


def rope_parameters(config):
    """{"main": ..., "compress": ...}: the sliding layers' plain RoPE at rope_theta, and
    the compressed layers' at compress_rope_theta with the config's YaRN (if any), whose
    cos/sin are not rescaled (attention_factor 1, as DeepSeek's reference)."""
    main = {"rope_type": "default", "rope_theta": config.rope_theta}
    compress = dict(config.rope_parameters, rope_theta=config.compress_rope_theta)
    if compress.get("rope_type") == "yarn":
        compress["attention_factor"] = 1.0
    return {"main": main, "compress": compress}


class Rotary(nn.Module):
    """cos / sin of the interleaved pairs for positions, per RoPE kind ("main",
    "compress"): [B, S, rope_dim / 2] each."""

    def __init__(self, config):
        super().__init__()
        self.scaling = {}
        for kind, params in rope_parameters(config).items():
            inv_freq, factor = inv_freq_and_attention_factor(params, dim=rope_dim(config),
                                                             max_position_embeddings=config.max_position_embeddings)
            self.register_buffer(f"{kind}_inv_freq", inv_freq, persistent=False)
            self.scaling[kind] = factor

    def forward(self, positions, kind, dtype):
        inv_freq = getattr(self, f"{kind}_inv_freq")
        freqs = positions[..., None].float() * inv_freq.to(device=positions.device, dtype=torch.float)
        return (freqs.cos() * self.scaling[kind]).to(dtype), (freqs.sin() * self.scaling[kind]).to(dtype)


def rotate_tail(x, cos, sin):
    """RoPE on the last 2 x cos.shape[-1] channels of ``x`` [B, h, S, D] in interleaved
    pairs, in fp32 (cos, sin [B, S, r / 2], broadcast over the head axis)."""
    cos = cos.repeat_interleave(2, dim=-1).unsqueeze(1)
    sin = sin.repeat_interleave(2, dim=-1).unsqueeze(1)
    width = cos.shape[-1]
    nope, rope = x[..., :-width], x[..., -width:]
    half = torch.stack((-rope[..., 1::2], rope[..., 0::2]), dim=-1).flatten(-2)
    rotated = ((rope.float() * cos) + (half.float() * sin)).to(x.dtype)
    return torch.cat([nope, rotated], dim=-1)


def _compress(kv, gate, position_bias, *, rate, overlap, head_dim, norm):
    """Pool each complete window of ``rate`` tokens into one entry: softmax of the gate
    (plus its position bias) over the window's tokens, per channel, weighting kv, then
    ``norm``. With ``overlap`` (CSA) kv and gate carry two series of ``head_dim``
    channels: the first feeds the next window's entry, the second its own, so entry w
    pools 2 x rate slots (window 0's first half empty). Returns [B, W, head_dim]."""
    batch = kv.shape[0]
    windows = kv.shape[1] // rate
    if windows == 0:            # shorter than one window: no entry yet
        return kv.new_zeros((batch, 0, head_dim))
    kv = kv[:, :windows * rate].view(batch, windows, rate, -1)
    gate = gate[:, :windows * rate].view(batch, windows, rate, -1) + position_bias
    if overlap:
        slots_kv = kv.new_zeros((batch, windows, 2 * rate, head_dim))
        slots_gate = gate.new_full((batch, windows, 2 * rate, head_dim), float("-inf"))
        slots_kv[:, :, rate:] = kv[..., head_dim:]
        slots_gate[:, :, rate:] = gate[..., head_dim:]
        if windows > 1:
            slots_kv[:, 1:, :rate] = kv[:, :-1, :, :head_dim]
            slots_gate[:, 1:, :rate] = gate[:, :-1, :, :head_dim]
        kv, gate = slots_kv, slots_gate
    return norm((kv * gate.softmax(dim=2, dtype=torch.float32).to(kv.dtype)).sum(dim=2))


def _entry_positions(batch, windows, rate, device, first=0):
    return ((first + torch.arange(windows, device=device)) * rate).unsqueeze(0).expand(batch, -1)


def rotated_entries(entries, rotary, rate, first=0):
    """Entries [B, W, D] (entry ``first`` onwards) rotated at their window's first
    position with the compressed layers' RoPE."""
    batch, windows = entries.shape[:2]
    cos, sin = rotary(_entry_positions(batch, windows, rate, entries.device, first), "compress", entries.dtype)
    return rotate_tail(entries.unsqueeze(1), cos, sin).squeeze(1)


def _visible(positions, windows, rate):
    """bool [B, S, W]: query t sees entry w when w's window ends at or before t."""
    return torch.arange(windows, device=positions.device).view(1, 1, -1) < ((positions + 1) // rate).unsqueeze(-1)


class HeavyCompressor(nn.Module):
    """HCA: every ``rate`` tokens into one entry (non-overlapping windows)."""

    def __init__(self, config, *, rate):
        super().__init__()
        self.rate, self.head_dim = rate, config.head_dim
        self.kv_proj = Linear(config.hidden_size, config.head_dim, bias=False)
        self.gate_proj = Linear(config.hidden_size, config.head_dim, bias=False)
        self.position_bias = muon_exempt(nn.Parameter(torch.zeros(rate, config.head_dim, dtype=torch.float32)))
        self.kv_norm = Fp32RMSNorm(config.head_dim, config.rms_norm_eps)

    def forward(self, hidden, q_residual, positions, rotary):
        """-> (entries [B, 1, W, D], additive bias [B, 1, S, W]: 0 where visible)."""
        batch, windows = hidden.shape[0], hidden.shape[1] // self.rate
        entries = _compress(self.kv_proj(hidden), self.gate_proj(hidden), self.position_bias, rate=self.rate,
                            overlap=False, head_dim=self.head_dim, norm=self.kv_norm)
        entries = rotated_entries(entries, rotary, self.rate).unsqueeze(1)
        bias = entries.new_zeros((batch, 1, hidden.shape[1], windows)).masked_fill(
            ~_visible(positions, windows, self.rate).unsqueeze(1), float("-inf"))
        return entries, bias


class IndexerScorer(nn.Module):
    """sum_h w_{t,h} ReLU(q_{t,h} . k_s): per-head weights from the hidden state."""

    def __init__(self, config):
        super().__init__()
        self.softmax_scale = config.index_head_dim ** -0.5
        self.weights_scaling = config.index_n_heads ** -0.5
        self.weights_proj = Linear(config.hidden_size, config.index_n_heads, bias=False)

    def forward(self, q, keys, hidden):
        scores = torch.matmul(q.float(), keys.transpose(-1, -2).float().unsqueeze(1))      # [B, S, h, W]
        scores = F.relu(scores) * self.softmax_scale
        weights = self.weights_proj(hidden).float() * self.weights_scaling                  # [B, S, h]
        return (scores * weights.unsqueeze(-1)).sum(dim=2)                                  # [B, S, W]


def first_topk(scores, k, dim=-1, largest=True, sorted=True):
    """``torch.topk`` with a fixed rule for ties: the earliest index first (a stable
    sort). torch.topk leaves the order among equal values unspecified, and on CPU it
    follows the row's length, so a decode step (one query against W entries) and the
    full forward (all queries, the final W) could pick different entries among the
    ReLU-zero scores that are common at initialisation; with this rule both pick alike.
    Same signature and result type as torch.topk (``sorted`` is always honoured)."""
    order = scores.sort(dim=dim, descending=largest, stable=True)
    return torch.return_types.topk((order.values.narrow(dim, 0, k), order.indices.narrow(dim, 0, k)))


class Indexer(nn.Module):
    """CSA's lightning indexer: its own overlapping compressor at ``index_head_dim``,
    queries from the attention's query latent, scores, and the top ``index_topk``
    visible entries per query (-1 where fewer are visible)."""

    def __init__(self, config, *, rate):
        super().__init__()
        self.rate, self.heads, self.head_dim, self.topk = rate, config.index_n_heads, config.index_head_dim, \
            config.index_topk
        self.kv_proj = Linear(config.hidden_size, 2 * self.head_dim, bias=False)
        self.gate_proj = Linear(config.hidden_size, 2 * self.head_dim, bias=False)
        self.position_bias = muon_exempt(nn.Parameter(torch.zeros(rate, 2 * self.head_dim, dtype=torch.float32)))
        self.kv_norm = Fp32RMSNorm(self.head_dim, config.rms_norm_eps)
        self.q_b_proj = Linear(config.q_lora_rank, self.heads * self.head_dim, bias=False)
        self.scorer = IndexerScorer(config)

    def scores(self, hidden, q_residual, positions, rotary):
        """Index scores [B, S, W] (fp32), -inf where an entry is not yet visible."""
        keys = _compress(self.kv_proj(hidden), self.gate_proj(hidden), self.position_bias, rate=self.rate,
                         overlap=True, head_dim=self.head_dim, norm=self.kv_norm)
        return self.score_keys(rotated_entries(keys, rotary, self.rate), hidden, q_residual, positions, rotary)

    def score_keys(self, keys, hidden, q_residual, positions, rotary):
        """Scores of queries at ``positions`` against the rotated keys [B, W, D]."""
        batch, seq = hidden.shape[:2]
        cos_q, sin_q = rotary(positions, "compress", hidden.dtype)
        q = self.q_b_proj(q_residual).view(batch, seq, -1, self.head_dim).transpose(1, 2)
        q = rotate_tail(q, cos_q, sin_q).transpose(1, 2)
        scores = self.scorer(q, keys, hidden)
        return scores.masked_fill(~_visible(positions, keys.shape[1], self.rate), float("-inf"))

    def select(self, scores, positions):
        """The top min(index_topk, W) entries per query, -1 for picks not visible; among
        equal scores the earliest entry first (``first_topk``)."""
        top = first_topk(scores, min(self.topk, scores.shape[-1])).indices
        visible = ((positions + 1) // self.rate).unsqueeze(-1)
        return torch.where(top >= visible, torch.full_like(top, -1), top)


class SparseCompressor(nn.Module):
    """CSA: overlapping windows of 2 x ``rate`` every ``rate`` tokens, and the indexer's
    choice of entries per query."""

    def __init__(self, config, *, rate):
        super().__init__()
        self.rate, self.head_dim = rate, config.head_dim
        self.kv_proj = Linear(config.hidden_size, 2 * config.head_dim, bias=False)
        self.gate_proj = Linear(config.hidden_size, 2 * config.head_dim, bias=False)
        self.position_bias = muon_exempt(nn.Parameter(torch.zeros(rate, 2 * config.head_dim, dtype=torch.float32)))
        self.kv_norm = Fp32RMSNorm(config.head_dim, config.rms_norm_eps)
        self.indexer = Indexer(config, rate=rate)

    def forward(self, hidden, q_residual, positions, rotary, *, dense=False, learns=False):
        """-> (entries [B, 1, W, D], additive bias [B, 1, S, W], (index scores [B, S, W],
        attended bool [B, S, W])). The indexer reads detached inputs (it learns from its
        KL loss only, with a graph when ``learns``); ``dense`` (the warm-up): every
        visible entry is attended, else the indexer's picks."""
        entries = _compress(self.kv_proj(hidden), self.gate_proj(hidden), self.position_bias, rate=self.rate,
                            overlap=True, head_dim=self.head_dim, norm=self.kv_norm)
        entries = rotated_entries(entries, rotary, self.rate).unsqueeze(1)
        with torch.set_grad_enabled(learns):
            scores = self.indexer.scores(hidden.detach(), q_residual.detach(), positions, rotary)
        attended = self.attended(scores, positions, dense=dense)
        return entries, entry_bias(attended, entries.dtype), (scores, attended)

    def attended(self, scores, positions, *, dense):
        """bool [B, S, W]: the entries each query attends (all visible ones when ``dense``)."""
        windows = scores.shape[-1]
        if dense:
            return _visible(positions, windows, self.rate)
        picks = self.indexer.select(scores.detach(), positions)
        safe = torch.where(picks >= 0, picks, torch.full_like(picks, windows))
        return torch.zeros(picks.shape[:-1] + (windows + 1, ), dtype=torch.bool,
                           device=picks.device).scatter_(-1, safe, True)[..., :windows]


def entry_bias(attended, dtype):
    """Additive [B, 1, S, W]: 0 where a query attends an entry, -inf elsewhere."""
    return torch.zeros(attended.shape, dtype=dtype, device=attended.device).masked_fill(
        ~attended, float("-inf")).unsqueeze(1)


def sliding_mask(positions, window, dtype, key_positions=None):
    """Additive [B, 1, S, T]: query t sees keys t - window < s <= t; the keys are the
    queries themselves unless ``key_positions`` [B, T] says otherwise (a cache's window)."""
    t = positions.unsqueeze(-1)
    s = (positions if key_positions is None else key_positions).unsqueeze(-2)
    seen = (s <= t) & (s > t - window)
    return torch.zeros(seen.shape, dtype=dtype, device=positions.device).masked_fill(~seen, float("-inf")).unsqueeze(1)


class GroupedProjection(nn.Module):
    """o_a_proj: each of ``groups`` groups of heads projected on its own to ``rank``
    channels (one block of a block-diagonal matrix); weight [groups x rank, in / groups]
    as transformers stores it."""

    def __init__(self, in_per_group, rank, groups):
        super().__init__()
        self.groups = groups
        self.weight = nn.Parameter(torch.empty(groups * rank, in_per_group))

    def forward(self, x):
        """x [..., groups, in / groups] -> [..., groups, rank]."""
        shape, width = x.shape[:-2], x.shape[-1]
        w = self.weight.view(self.groups, -1, width).transpose(1, 2)
        y = torch.bmm(x.reshape(-1, self.groups, width).transpose(0, 1), w).transpose(0, 1)
        return y.reshape(*shape, self.groups, -1)


class HybridAttention(IndexerLoss, nn.Module):
    """One V4 attention layer of ``layer_type``; names as transformers' DeepseekV4Attention.
    In CSA layers the indexer learns from L_I (recipes/layers/dsa.py: stage, KL weight,
    recording), the KL of its scores against the main attention's probabilities of the
    compressed entries, summed over heads and renormalised over the attended ones."""

    def __init__(self, config, *, layer_type):
        super().__init__()
        self.init_indexer_loss()
        c = config
        self.layer_type, self.heads, self.head_dim = layer_type, c.num_attention_heads, c.head_dim
        self.window, self.o_groups, self.norm_eps = c.sliding_window, c.o_groups, c.rms_norm_eps
        self.rope_kind = "main" if layer_type == SLIDING else "compress"
        self.q_a_proj = Linear(c.hidden_size, c.q_lora_rank, bias=False)
        self.q_a_norm = Fp32RMSNorm(c.q_lora_rank, c.rms_norm_eps)
        self.q_b_proj = Linear(c.q_lora_rank, c.num_attention_heads * c.head_dim, bias=False)
        self.kv_proj = Linear(c.hidden_size, c.head_dim, bias=False)
        self.kv_norm = Fp32RMSNorm(c.head_dim, c.rms_norm_eps)
        self.o_a_proj = GroupedProjection(c.num_attention_heads * c.head_dim // c.o_groups, c.o_lora_rank, c.o_groups)
        self.o_b_proj = Linear(c.o_groups * c.o_lora_rank, c.hidden_size, bias=False)
        self.sinks = nn.Parameter(torch.zeros(c.num_attention_heads, dtype=torch.float32))
        if layer_type == CSA:
            self.compressor = SparseCompressor(c, rate=c.compress_rates[CSA])
        elif layer_type == HCA:
            self.compressor = HeavyCompressor(c, rate=c.compress_rates[HCA])
        else:
            self.compressor = None
        self.rotary = Rotary(c)

    @property
    def has_indexer(self):
        return self.layer_type == CSA

    def project(self, hidden, positions):
        """The rotated queries [B, heads, S, D], the rotated K = V [B, 1, S, D], the query
        latent, and the rotation (cos, sin) of ``positions``."""
        batch, seq = hidden.shape[:2]
        cos, sin = self.rotary(positions, self.rope_kind, hidden.dtype)
        q_residual = self.q_a_norm(self.q_a_proj(hidden))
        q = self.q_b_proj(q_residual).view(batch, seq, -1, self.head_dim).transpose(1, 2)
        q = rotate_tail(unweighted_rms_norm(q, self.norm_eps), cos, sin)
        kv = self.kv_norm(self.kv_proj(hidden)).view(batch, seq, -1, self.head_dim).transpose(1, 2)
        return q, rotate_tail(kv, cos, sin), q_residual, (cos, sin)

    def output(self, out, rotation):
        """The attention output [B, S, heads, D] back-rotated, then the grouped projection."""
        cos, sin = rotation
        batch, seq = out.shape[:2]
        out = rotate_tail(out.transpose(1, 2), cos, -sin).transpose(1, 2)
        grouped = self.o_a_proj(out.reshape(batch, seq, self.o_groups, -1)).flatten(2)
        return self.o_b_proj(grouped)

    def forward(self, hidden, positions):
        """hidden [B, S, H], positions [B, S] -> ([B, S, H], L_I or None)."""
        batch, seq = hidden.shape[:2]
        q, kv, q_residual, rotation = self.project(hidden, positions)
        mask = sliding_mask(positions, self.window, hidden.dtype)
        learns = self.indexer_learns()
        self.note_forward(learns)
        index = None
        if self.layer_type == CSA:
            entries, bias, index = self.compressor(hidden, q_residual, positions, self.rotary,
                                                   dense=self.stage == "warmup", learns=learns)
        elif self.compressor is not None:
            entries, bias = self.compressor(hidden, q_residual, positions, self.rotary)
        if self.compressor is not None:
            kv = torch.cat([kv, entries], dim=2)
            mask = torch.cat([mask.expand(batch, -1, -1, -1), bias.to(mask.dtype)], dim=-1)
        out, probs = self._attend(q, kv, mask)                                # [B, S, heads, D]
        loss = None
        if learns:
            loss = self.kl_weight * self._indexer_loss(probs[..., seq:].detach(), *index)
            self.record(loss)
        return self.output(out, rotation), loss

    def _attend(self, q, kv, mask):
        """Softmax over the keys and the head's sink (the sink's probability dropped),
        as transformers' eager attention: ([B, S, heads, D], the probabilities)."""
        logits = torch.matmul(q, kv.expand(-1, self.heads, -1, -1).transpose(2, 3)) * self.head_dim ** -0.5 + mask
        sinks = self.sinks.reshape(1, -1, 1, 1).expand(q.shape[0], -1, q.shape[-2], -1)
        combined = torch.cat([logits, sinks.to(logits.dtype)], dim=-1)
        combined = combined - combined.max(dim=-1, keepdim=True).values
        probs = F.softmax(combined, dim=-1, dtype=combined.dtype)[..., :-1].to(kv.dtype)
        return torch.matmul(probs, kv.expand(-1, self.heads, -1, -1)).transpose(1, 2).contiguous(), probs

    @staticmethod
    def _indexer_loss(entry_probs, scores, attended):
        """Mean over the queries that attend at least one entry of KL(p_t || softmax(I_t))
        over the attended entries: p_t the main attention's probabilities of the
        entries (``entry_probs`` [B, heads, S, W]) summed over heads and renormalised."""
        target = entry_probs.float().sum(dim=1).masked_fill(~attended, 0.0)
        rows = attended.any(dim=-1) & (target.sum(dim=-1) > 0)
        if not rows.any():          # no query sees an entry yet (sequences shorter than the rate)
            return scores.sum() * 0.0
        target = target[rows]
        return indexer_kl(target / target.sum(dim=-1, keepdim=True), scores[rows], attended[rows])


def check_layer_types(config, where):
    """layer_types: one known kind per layer; compress_rates: the CSA and HCA rates."""
    types = list(config.layer_types)
    if len(types) != config.num_hidden_layers:
        raise ConfigError(f"{where}.layer_types has {len(types)} entries and num_hidden_layers is "
                          f"{config.num_hidden_layers}: give one attention kind per layer (of {list(LAYER_TYPES)})")
    bad = sorted({t for t in types if t not in LAYER_TYPES})
    if bad:
        raise ConfigError(f"{where}.layer_types names {bad}: each entry must be one of {list(LAYER_TYPES)}")
    rates = config.compress_rates
    if set(rates) != {CSA, HCA} or any(not isinstance(r, int) or r < 1 for r in rates.values()):
        raise ConfigError(f"{where}.compress_rates must give positive integer rates for {CSA!r} and {HCA!r} "
                          f"(DeepSeek-V4: 4 and 128), got {rates!r}")


def layer_types_from_ratios(ratios, where):
    """transformers' legacy per-layer compress_ratios (0 sliding, 4 CSA, 128 HCA) as layer_types."""
    bad = sorted({r for r in ratios if r not in RATIO_TO_LAYER_TYPE})
    if bad:
        raise ConfigError(f"{where}.compress_ratios has {bad}: each entry must be 0 (sliding window), 4 (CSA) or "
                          f"128 (HCA); set layer_types instead for other rates")
    return [RATIO_TO_LAYER_TYPE[r] for r in ratios]


def attention_entries(config, layer_type, *, seq_len):
    """Keys a query attends to at the sequence's end: the window plus the visible
    compressed entries (HCA: all of them, CSA: at most index_topk)."""
    window = min(config.sliding_window, seq_len)
    if layer_type == SLIDING:
        return window
    rate = config.compress_rates[layer_type]
    entries = seq_len // rate
    return window + (min(entries, config.index_topk) if layer_type == CSA else entries)

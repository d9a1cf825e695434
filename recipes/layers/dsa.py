"""DeepSeek Sparse Attention (DeepSeek-V3.2): MLA whose queries attend only to the
``index_topk`` keys a lightning indexer picks for them.

The indexer of each attention layer has its own small projections (names as
transformers' DeepseekV32Indexer, so weights map one to one):

    q_j   = wq_b(q_resid)_j, j < index_n_heads      q_resid: MLA's normalised query latent
    k     = k_norm(wk(h))                             one key per token (LayerNorm, eps 1e-6)
    w_j   = weights_proj(h)_j / sqrt(index_n_heads)   per-head weights, fp32
    I_ts  = sum_j w_tj ReLU(q_tj . k_s / sqrt(index_head_dim))

with non-interleaved RoPE on the first qk_rope_head_dim dimensions of q and k (the
main MLA rotates interleaved pairs). Query t keeps the top ``index_topk`` keys s <= t
by I_ts (all of them while t < index_topk); the main attention is a scaled-dot-product
attention masked to those keys.

Training, as the DeepSeek-V3.2 report (sec. 2.1.1) does it, in two stages:

- ``"warmup"`` (dense warm-up): attention stays dense and only the indexer learns
  (``freeze_for_warmup``), from L_I = KL(p_t || softmax(I_t)) over all causal keys,
  where p_t is the main attention's distribution of query t summed over heads and
  L1-normalised (a detached target). The main path carries no graph: each layer runs
  on its detached input and hands its input a zero gradient (``_WarmupLink``), so the
  backward visits only the indexers.
- ``"sparse"``: attention uses the selected keys S_t only, every parameter trains,
  and L_I = KL(p_t,S_t || softmax(I_t,S_t)), both restricted to and renormalised over
  S_t. The indexer reads detached inputs, so it learns from L_I only and the main
  model from the language-model loss only.

L_I per layer is ``kl_weight`` times the mean over queries (the report writes the
sum over t; the mean divides it by batch x sequence, which keeps the weight
independent of both, as the language-model loss is a mean too). Like DeepSeekMoE's
balance loss (recipes/layers/moe.py), it trains without being returned: an identity on
the layer's output whose backward sends ``aux_grad_scale`` as L_I's gradient, which
works in every pipeline schedule and under activation checkpointing, and is
recorded once per micro-batch for ``take_indexer_loss``.

``DSADecoder`` generates with MLA's latent KV cache plus each layer's indexer keys.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ds_ext.errors import ConfigError
from ds_ext.pipe.zero_bubble import Linear
from recipes.step import StepFigures, StepHook

from . import rope
from .latent_kv import LatentKVCache, MLADecoder, absorbed_attention
from .mla import MLAttention
from .moe import _AddAuxLossGrad, _in_backward
from .pipe import DecoderLayerPipe, MTPLayerPipe

DSA_STAGES = ("warmup", "sparse")
_HEAD_CHUNK = 16      # heads per softmax when forming the KL target (bounds its [B, heads, S, S] transient)


def _rope_first_dims(x, cos, sin):
    """Non-interleaved RoPE on the first cos.shape[-1] dimensions of x [B, S, heads, D]
    (cos, sin [1 or B, S, d])."""
    dim = cos.shape[-1]
    rot, rest = torch.split(x, [dim, x.shape[-1] - dim], dim=-1)
    cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
    rotated = (rot * cos) + (torch.cat((-rot[..., dim // 2:], rot[..., :dim // 2]), dim=-1) * sin)
    return torch.cat([rotated, rest], dim=-1)


class _IndexScores(torch.autograd.Function):
    """I [B, S, T] = sum_j w_j ReLU(q_j . k * scale) from queries [B, S, h, D], keys
    [B, T, D] and fp32 weights [B, S, h], in fp32 and in transformers' order of
    products (q . k per head, scale, ReLU, then the weighted sum over heads as one
    matmul), so the same inputs select the same keys. Keeps q, k and w only and
    recomputes the [B, S, h, T] per-head scores in the backward (autograd would keep
    them and a copy of k per query)."""

    @staticmethod
    def forward(ctx, q, k, weights, scale):
        ctx.save_for_backward(q, k, weights)
        ctx.scale = scale
        per_head = F.relu(torch.matmul(q.float(), k.transpose(-1, -2).float().unsqueeze(1)) * scale)
        return torch.matmul(weights.unsqueeze(-2), per_head).squeeze(-2)

    @staticmethod
    def backward(ctx, grad):
        q, k, weights = ctx.saved_tensors
        qf, kf = q.float(), k.float()
        logits = torch.matmul(qf, kf.transpose(-1, -2).unsqueeze(1)) * ctx.scale       # [B, S, h, T]
        grad_w = torch.matmul(F.relu(logits), grad.unsqueeze(-1)).squeeze(-1)
        grad_logits = (weights.unsqueeze(-1) * grad.unsqueeze(-2)).masked_fill_(logits <= 0, 0.0).mul_(ctx.scale)
        del logits
        grad_q = torch.matmul(grad_logits, kf.unsqueeze(1))
        grad_k = torch.einsum("bsht,bshd->btd", grad_logits, qf)
        return grad_q.to(q.dtype), grad_k.to(k.dtype), grad_w, None


class LightningIndexer(nn.Module):
    """Index scores I [B, S, T] of queries against keys (fp32)."""

    def __init__(self, config):
        super().__init__()
        c = config
        self.num_heads = c.index_n_heads
        self.head_dim = c.index_head_dim
        self.wq_b = Linear(c.q_lora_rank, self.num_heads * self.head_dim, bias=False)
        self.wk = Linear(c.hidden_size, self.head_dim, bias=False)
        self.k_norm = nn.LayerNorm(self.head_dim, eps=1e-6)
        self.weights_proj = Linear(c.hidden_size, self.num_heads, bias=False)
        self.softmax_scale = self.head_dim ** -0.5

    def queries(self, q_resid, cos, sin):
        """[B, S, index_n_heads, index_head_dim]"""
        batch, seq, _ = q_resid.shape
        q = self.wq_b(q_resid).view(batch, seq, self.num_heads, self.head_dim)
        return _rope_first_dims(q, cos, sin)

    def keys(self, x, cos, sin):
        """[B, S, index_head_dim]: what a cache keeps per token."""
        return _rope_first_dims(self.k_norm(self.wk(x)).unsqueeze(2), cos, sin).squeeze(2)

    def head_weights(self, x):
        """[B, S, index_n_heads] fp32"""
        w = self.weights_proj.weight
        return self.weights_proj(x.to(w.dtype)).float() * self.num_heads ** -0.5

    def scores(self, q, k, weights):
        """I [B, S, T] from queries [B, S, h, D], keys [B, T, D] and weights [B, S, h]."""
        return _IndexScores.apply(q, k, weights, self.softmax_scale)

    def forward(self, x, q_resid, cos, sin):
        return self.scores(self.queries(q_resid, cos, sin), self.keys(x, cos, sin), self.head_weights(x))


def select_topk(index_scores, allowed, topk):
    """bool [B, 1, S, T]: ``allowed`` (bool [B or 1, 1, S, T]) restricted to each query's
    ``topk`` best keys by ``index_scores`` [B, S, T]."""
    masked = index_scores.detach().masked_fill(~allowed[:, 0], float("-inf"))
    chosen = masked.topk(min(topk, masked.shape[-1]), dim=-1).indices
    keep = torch.zeros(masked.shape, dtype=torch.bool, device=masked.device).scatter(-1, chosen, True)
    return allowed & keep.unsqueeze(1)


@torch.no_grad()
def attention_target(q, k, attended, scaling):
    """p [B, S, T] fp32: the main attention's probabilities (queries q, keys k [B, h, S|T,
    D], softmax over the keys ``attended`` allows, bool [B or 1, 1, S, T]) summed over
    heads and L1-normalised over the keys."""
    total = None
    for h in range(0, q.shape[1], _HEAD_CHUNK):
        logits = torch.matmul(q[:, h:h + _HEAD_CHUNK].float(), k[:, h:h + _HEAD_CHUNK].float().transpose(-1, -2))
        probs = torch.softmax((logits * scaling).masked_fill(~attended, float("-inf")), dim=-1).sum(dim=1)
        total = probs if total is None else total + probs
    return total / total.sum(dim=-1, keepdim=True)


class _IndexerKL(torch.autograd.Function):
    """Mean over queries of KL(p_t || softmax(I_t)), both over the keys ``attended``
    allows (bool [B or 1, S, T]); ``target`` p sums to 1 over them. Keeps only the
    gradient (softmax(I_t) - p_t) / queries, known in the forward."""

    @staticmethod
    def forward(ctx, index_scores, target, attended):
        log_q = torch.log_softmax(index_scores.masked_fill(~attended, float("-inf")), dim=-1)
        kl = torch.special.xlogy(target, target) - target * log_q.masked_fill(~attended, 0.0)
        rows = kl.sum(dim=-1)
        ctx.save_for_backward((log_q.exp_() - target).div_(rows.numel()))
        return rows.mean()

    @staticmethod
    def backward(ctx, grad):
        (grad_scores,) = ctx.saved_tensors
        return grad * grad_scores, None, None


def indexer_kl(target, index_scores, attended):
    """Mean over queries of KL(target_t || softmax(I_t)) over the keys ``attended`` allows."""
    return _IndexerKL.apply(index_scores, target, attended)


class IndexerLoss:
    """The state of an attention whose lightning indexer learns from L_I: the stage,
    L_I's weight and gradient scale, and L_I as recorded once per micro-batch (also
    under activation checkpointing, whose recomputation records what the first pass,
    without a graph, could not). Mixed into DeepSeek-V3.2's DSAttention and V4's
    hybrid attention (its CSA layers: ``has_indexer``)."""

    has_indexer = True

    def init_indexer_loss(self):
        self.stage = "sparse"
        self.kl_weight = 0.0
        self.aux_grad_scale = 1.0       # the engine's loss scaling of one micro-batch (1 / accumulation)
        self.kl_sum, self.kl_count = 0.0, 0
        self._unrecorded = 0            # forwards without a graph whose recomputation records L_I

    def indexer_learns(self):
        return self.has_indexer and self.training and self.kl_weight > 0 and torch.is_grad_enabled()

    def note_forward(self, learns):
        """Call once per forward, before L_I: counts a graph-less training forward whose
        recomputation will record L_I."""
        if self.has_indexer and self.training and self.kl_weight > 0 and not learns and not _in_backward():
            self._unrecorded += 1       # e.g. reentrant checkpointing's first pass: recorded when recomputed

    def record(self, loss):
        """Record L_I of this forward once (not again when a checkpoint recomputes it)."""
        if not _in_backward():
            self._record(loss)
        elif self._unrecorded:
            self._unrecorded -= 1
            self._record(loss)

    def _record(self, loss):
        self.kl_sum = self.kl_sum + loss.detach()
        self.kl_count += 1


class DSAttention(IndexerLoss, MLAttention):
    """MLA with the lightning indexer (``indexer``). ``forward`` returns (output,
    L_I or None): L_I when the indexer learns (training, grad on, kl_weight > 0)."""

    def __init__(self, config):
        super().__init__(config)
        if config.q_lora_rank is None:
            raise ValueError("DeepSeek Sparse Attention reads the query latent: set q_lora_rank")
        self.indexer = LightningIndexer(config)
        self.index_topk = config.index_topk
        self.init_indexer_loss()

    def forward(self, x, mask=None):
        """``mask`` (bool [B, 1, S, S], True where a query may attend a key) replaces the
        causal mask (document-bounded attention); selection stays inside it."""
        seq = x.shape[1]
        q, k, v, q_resid = self.project(x)
        learns = self.indexer_learns()
        self.note_forward(learns)
        sparse = self.stage == "sparse" and seq > self.index_topk
        allowed = mask
        if allowed is None and (sparse or learns):
            allowed = torch.ones(seq, seq, dtype=torch.bool, device=x.device).tril().view(1, 1, seq, seq)
        index_scores = None
        if sparse or learns:
            cos, sin = rope.cos_sin(self.inv_freq, self.rope_attention_factor, seq_len=seq, dtype=x.dtype,
                                    device=x.device)
            with torch.set_grad_enabled(learns):
                # detached: the indexer learns from L_I only, the main model never from it
                index_scores = self.indexer(x.detach(), q_resid.detach(), cos, sin)
        attended = select_topk(index_scores, allowed, self.index_topk) if sparse else allowed
        if mask is None and not sparse:     # plain causal attention: SDPA's causal kernels
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scaling)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=attended, scale=self.scaling)
        loss = None
        if learns:
            target = attention_target(q.detach(), k.detach(), attended, self.scaling)
            loss = self.kl_weight * indexer_kl(target, index_scores, attended[:, 0])
            self.record(loss)
        return self.output(out), loss


class _WarmupLink(torch.autograd.Function):
    """The dense warm-up's layer output: ``out`` (computed without a graph) whose
    backward sends ``scale`` as the gradient of the layer's L_I and a zero gradient to
    the layer's input ``x``, so the backward reaches every earlier layer's link without
    going through the frozen model. Nothing that trains depends on the layer's output:
    the indexers do not change the dense forward."""

    @staticmethod
    def forward(ctx, out, loss, x, scale):
        ctx.save_for_backward(loss)
        ctx.scale = scale
        ctx.x_meta = (x.shape, x.dtype, x.device)
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):
        (loss,) = ctx.saved_tensors
        shape, dtype, device = ctx.x_meta
        grad_x = torch.zeros(shape, dtype=dtype, device=device) if ctx.needs_input_grad[2] else None
        return None, torch.full_like(loss, ctx.scale), grad_x, None


class _DSABlock:
    """The pre-norm block of DecoderLayerPipe around DSAttention, delivering L_I's
    gradient (see the module docstring). Mixed into the decoder and MTP layers."""

    attention_class = DSAttention

    def __init__(self, config, *, dsa_stage="sparse", indexer_kl_weight=0.0, **kwargs):
        super().__init__(config, **kwargs)
        configure_indexer(self, weight=indexer_kl_weight, stage=dsa_stage)

    def _pre_norm(self, hidden, mask):
        attn_out, loss = self.self_attn(self.input_layernorm(hidden), mask=mask)
        hidden = hidden + attn_out
        return hidden + self.mlp(self.post_attention_layernorm(hidden)), loss

    def block(self, hidden, mask=None):
        attn = self.self_attn
        if attn.stage == "warmup" and attn.indexer_learns():
            out, loss = self._pre_norm(hidden.detach(), mask)
            return _WarmupLink.apply(out, loss, hidden, attn.aux_grad_scale)
        out, loss = self._pre_norm(hidden, mask)
        return out if loss is None else _AddAuxLossGrad.apply(out, loss, attn.aux_grad_scale)


class DSADecoderLayerPipe(_DSABlock, DecoderLayerPipe):
    """DecoderLayerPipe with DeepSeek Sparse Attention (``type:DecoderLayerPipe``
    partitioning matches it)."""


class DSAMTPLayerPipe(_DSABlock, MTPLayerPipe):
    """DeepSeek-V3's depth-1 multi-token prediction module with a DSA block."""


# ---- training controls --------------------------------------------------------------

def attentions(module):
    """(name, attention) of ``module``'s attentions with a learning indexer
    (IndexerLoss), in a fixed order (the same on every rank of a stage)."""
    return [(n, m) for n, m in sorted(module.named_modules(), key=lambda kv: kv[0])
            if isinstance(m, IndexerLoss) and m.has_indexer]


def configure_indexer(module, *, weight=None, grad_scale=None, stage=None):
    """Set the DSA layers' KL weight, the gradient scale of L_I (the engine's loss
    scaling of one micro-batch: 1 / gradient accumulation steps) and the stage; None
    leaves a setting as it is."""
    if stage is not None and stage not in DSA_STAGES:
        raise ValueError(f"DSA stage {stage!r} is unknown: use one of {list(DSA_STAGES)}")
    if weight is not None and weight < 0:
        raise ValueError(f"the indexer's KL weight must be >= 0, got {weight}")
    for _, attn in attentions(module):
        if stage is not None:
            attn.stage = stage
        if weight is not None:
            attn.kl_weight = float(weight)
        if grad_scale is not None:
            attn.aux_grad_scale = float(grad_scale)
        if attn.stage == "warmup" and attn.kl_weight <= 0:
            raise ValueError("the dense warm-up trains the indexer only, from its KL loss: set the KL weight > 0")


def is_indexer_parameter(name):
    return ".indexer." in f".{name}"


def freeze_for_warmup(module):
    """The dense warm-up: every parameter of ``module`` but the indexers' stops
    requiring a gradient. Returns the number of parameters that still train."""
    trainable = 0
    for name, p in module.named_parameters():
        p.requires_grad_(is_indexer_parameter(name))
        trainable += p.numel() if p.requires_grad else 0
    return trainable


def take_indexer_loss(module):
    """L_I (weight included) of ``module``'s DSA layers since the last call: per layer
    the mean over its micro-batches, summed over layers (None if no layer recorded one)."""
    total, seen = 0.0, False
    for _, attn in attentions(module):
        if attn.kl_count:
            total += float(attn.kl_sum) / attn.kl_count
            seen = True
        attn.kl_sum, attn.kl_count, attn._unrecorded = 0.0, 0, 0
    return total if seen else None


# ---- the recipes' config section and step hook ----------------------------------------

@dataclass(kw_only=True)
class DsaSection:
    """``seekspeed.dsa``: training a lightning indexer (DeepSeek-V3.2's sparse attention,
    DeepSeek-V4's CSA), as the DeepSeek-V3.2 report trains it. Unset fields take the
    recipe's defaults."""
    # "warmup": dense attention, only the indexer learns (KL to the main attention over all keys);
    # "sparse": attention over the indexer's top-k keys, the indexer learns from the KL over them
    stage: str | None = None
    # weight of the indexer's KL loss (it trains only the indexer: its input is detached)
    indexer_loss_weight: float | None = None

    def check(self, where):
        if self.stage is not None and self.stage not in DSA_STAGES:
            raise ConfigError(f"{where}.stage {self.stage!r} is not one of {list(DSA_STAGES)}")
        if self.indexer_loss_weight is not None and not self.indexer_loss_weight > 0:
            raise ConfigError(f"{where}.indexer_loss_weight must be > 0 (the indexer learns only from it), got "
                              f"{self.indexer_loss_weight}")

    def is_set(self):
        return self.stage is not None or self.indexer_loss_weight is not None


def check_dsa(dsa_stage, indexer_kl_weight):
    if dsa_stage not in DSA_STAGES:
        raise ConfigError(f"DSA stage {dsa_stage!r} is unknown: use one of {list(DSA_STAGES)}")
    if indexer_kl_weight < 0 or (dsa_stage == "warmup" and indexer_kl_weight <= 0):
        raise ConfigError(f"the indexer KL weight must be >= 0 (> 0 for the warm-up, which trains the indexer only "
                          f"from it), got {indexer_kl_weight}")


def train_options(section):
    """seekspeed.dsa: the stage ("sparse" unless set) and the indexer's KL weight (1.0)."""
    dsa_section = section.recipe_section("dsa", DsaSection)
    stage = dsa_section.stage or "sparse"
    if stage == "warmup" and section.moe.bias_update_speed > 0:
        raise ConfigError(f"seekspeed.dsa.stage 'warmup' trains only the indexers, and seekspeed.moe.bias_update_speed "
                          f"{section.moe.bias_update_speed} would still move the frozen routers' biases: set it to 0 "
                          f"for the warm-up")
    weight = dsa_section.indexer_loss_weight
    return {"dsa_stage": stage, "indexer_kl_weight": 1.0 if weight is None else weight}


def _indexer_setup(engine, *, section, grad_accum):
    configure_indexer(engine.module, grad_scale=1.0 / grad_accum)


def _indexer_after_step(engine, *, section):
    value = take_indexer_loss(engine.module)
    return StepFigures(losses={} if value is None else {"indexer": value})


# the lightning indexer's KL loss, computed inside the layers and reported as loss_indexer
INDEXER_LOSS = StepHook(name="indexer loss", setup=_indexer_setup, after_step=_indexer_after_step,
                        losses=("indexer",))


# ---- generation ---------------------------------------------------------------------

class DSAKVCache(LatentKVCache):
    """The latent KV cache plus each layer's indexer keys [B, T, index_head_dim]."""

    def __init__(self, config, *, batch, max_tokens, dtype, device="cpu"):
        super().__init__(config, batch=batch, max_tokens=max_tokens, dtype=dtype, device=device)
        self.index_keys = torch.zeros(config.num_hidden_layers, batch, max_tokens, config.index_head_dim, dtype=dtype,
                                      device=device)

    def bytes_per_token(self):
        return super().bytes_per_token() + self.index_keys.shape[0] * self.index_keys.shape[-1] * \
            self.index_keys.element_size()


def cached_selection(attn, x, cache, layer, start):
    """bool [B, S, end] of the cached keys new tokens ``x`` at positions start.. attend
    to (None while every query keeps all its causal keys), extending layer ``layer``'s
    indexer keys in ``cache``."""
    batch, seq, _ = x.shape
    end = start + seq
    cos, sin = rope.cos_sin(attn.inv_freq, attn.rope_attention_factor, seq_len=end, dtype=x.dtype, device=x.device)
    cos, sin = cos[:, start:], sin[:, start:]
    indexer = attn.indexer
    cache.index_keys[layer, :batch, start:end] = indexer.keys(x, cos, sin)
    if attn.stage != "sparse" or end <= attn.index_topk:
        return None
    q_resid = attn.q_a_layernorm(attn.q_a_proj(x))
    scores = indexer.scores(indexer.queries(q_resid, cos, sin), cache.index_keys[layer, :batch, :end],
                            indexer.head_weights(x))
    causal = torch.arange(end, device=x.device)[None, :] <= torch.arange(start, end, device=x.device)[:, None]
    return select_topk(scores, causal.view(1, 1, seq, end), attn.index_topk)[:, 0]


class DSADecoder(MLADecoder):
    """Generation for a DeepSeek-V3.2 recipe module: absorbed MLA over the latent cache,
    each new query attending only to the cached keys its layer's indexer selects."""

    cache_class = DSAKVCache

    @torch.no_grad()
    def forward_cached(self, ids, cache):
        start = cache.length
        hidden = self.embedding.embed_tokens(ids)
        for index, layer in enumerate(self.layers):
            x = layer.input_layernorm(hidden)
            keep = cached_selection(layer.self_attn, x, cache, index, start)
            hidden = hidden + absorbed_attention(layer.self_attn, x, cache, index, start, keep=keep)
            hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
        cache.length = start + ids.shape[1]
        return self._logits(hidden)

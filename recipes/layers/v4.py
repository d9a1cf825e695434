"""DeepSeek-V4's pipeline layers: the residual stream is ``hc_mult`` copies of the
hidden state (recipes/layers/hyper.py), and the token ids travel with it from the
embedding to every decoder layer, since the first layers route by token id (hash
routing) and in a pipeline the ids exist only on the first stage.

    V4EmbeddingPipe       ids -> (streams [B, S, N, H], ids)
    V4DecoderLayerPipe    (streams, ids) -> (streams, ids): the hybrid attention and the
                          MoE, each between hyper-connections
    V4HeadNormPipe        (streams, ids) -> hidden [B, S, H]: HyperHead, then the norm

then recipes.layers.pipe's LMHeadPipe and CausalLMLoss. Names and initialisation follow
transformers' DeepseekV4 (recipes/layers/hf.py maps the tensors by each layer's
``hf_prefix``); each layer initialises from its own seed, as recipes/layers/pipe.py's.
"""

import torch
from torch import nn

from .dispatch import DEFAULT_DISPATCH
from .dsa import _WarmupLink, configure_indexer
from .hybrid_attention import Fp32RMSNorm, GroupedProjection, HybridAttention
from .hyper import HyperConnection, HyperHead, hyper_residual
from .moe import DeepSeekMoE, HashRouter, TopkRouter, _AddAuxLossGrad
from .pipe import EmbeddingPipe, _init_weights, layer_seed

HASH, SCORED = "hash_moe", "moe"
MLP_LAYER_TYPES = (HASH, SCORED)


def init_v4(module, *, seed, std):
    """transformers' DeepseekV4 initialisation from ``seed``'s own RNG stream: normal(std)
    projections, embeddings, routers, experts, hyper-connection projections; zeros for
    biases, sinks and position biases; ones for norm weights and the hyper-connection
    scales; a hash layer's token table a balanced random assignment from the same seed."""
    if any(p.is_meta for p in module.parameters()):
        return
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        _init_weights(module, std, seed)
        for m in module.modules():
            if isinstance(m, GroupedProjection):
                nn.init.normal_(m.weight, mean=0.0, std=std)
            elif isinstance(m, (HyperConnection, HyperHead)):
                m.reset_parameters(std)
            elif isinstance(m, HashRouter):
                nn.init.normal_(m.weight, mean=0.0, std=std)
                m.assign_balanced(torch.Generator().manual_seed(seed))


def _positions(streams):
    batch, seq = streams.shape[:2]
    return torch.arange(seq, device=streams.device).unsqueeze(0).expand(batch, -1)


class V4EmbeddingPipe(EmbeddingPipe):
    """Token ids -> (hc_mult copies of their embedding, the ids)."""

    def __init__(self, config, *, seed):
        super().__init__(config, seed=seed, carry_ids=True)
        self.hc_mult = config.hc_mult

    def forward(self, input_ids):
        hidden = self.embed_tokens(input_ids)
        return hidden.unsqueeze(2).expand(-1, -1, self.hc_mult, -1).contiguous(), input_ids


class V4DecoderLayerPipe(nn.Module):
    """One V4 block: streams -> attention between ``attn_hc``'s mix and spread, then the
    MoE (hash-routed or score-routed, ``mlp_layer_types``) between ``ffn_hc``'s.

    A CSA layer's indexer learns from its KL loss (``indexer_kl_weight``), delivered
    through an identity's backward, in DeepSeek-V3.2's two stages (``dsa_stage``,
    recipes/layers/dsa.py): "sparse", and "warmup", where attention is dense over the
    visible entries and only the indexers learn: every layer then runs on its detached
    input and hands it a zero gradient, so the backward visits the indexers only."""

    @staticmethod
    def hf_prefix(config, *, layer_idx, **module_kwargs):
        return f"model.layers.{layer_idx}."

    def __init__(self, config, *, layer_idx, seed, ep_size=1, ep_rank=0, moe_dispatch=DEFAULT_DISPATCH,
                 dsa_stage="sparse", indexer_kl_weight=0.0):
        super().__init__()
        c = config
        self.layer_idx, self.warmup = layer_idx, dsa_stage == "warmup"
        self.self_attn = HybridAttention(c, layer_type=c.layer_types[layer_idx])
        router = HashRouter if c.mlp_layer_types[layer_idx] == HASH else TopkRouter
        # V4's shared expert is one SwiGLU of moe_intermediate_size, whatever n_shared_experts says
        self.mlp = DeepSeekMoE(c, ep_size=ep_size, ep_rank=ep_rank, dispatch=moe_dispatch, router=router,
                               shared_width=c.moe_intermediate_size)
        self.input_layernorm = Fp32RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = Fp32RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.attn_hc = HyperConnection(c)
        self.ffn_hc = HyperConnection(c)
        init_v4(self, seed=layer_seed(seed, 1 + layer_idx), std=c.initializer_range)
        configure_indexer(self, weight=indexer_kl_weight, stage=dsa_stage)

    def block(self, streams, ids, attend=None):
        """(streams after the block, the indexer's KL loss or None); ``attend`` (the
        normed input -> (output, loss)) replaces the attention over the whole sequence
        (generation's cached attention, recipes/layers/v4_cache.py)."""
        post, comb, collapsed = self.attn_hc(streams)
        x = self.input_layernorm(collapsed)
        attended, loss = attend(x) if attend is not None else self.self_attn(x, _positions(streams))
        streams = hyper_residual(streams, attended, post, comb)
        post, comb, collapsed = self.ffn_hc(streams)
        out = self.mlp(self.post_attention_layernorm(collapsed), ids=ids)
        return hyper_residual(streams, out, post, comb), loss

    def forward(self, x):
        streams, ids = x
        scale = self.self_attn.aux_grad_scale
        if self.warmup and self.training and torch.is_grad_enabled():
            out, loss = self.block(streams.detach(), ids)
            return _WarmupLink.apply(out, streams.new_zeros(()) if loss is None else loss, streams, scale), ids
        out, loss = self.block(streams, ids)
        return (out if loss is None else _AddAuxLossGrad.apply(out, loss, scale)), ids


class V4HeadNormPipe(nn.Module):
    """(streams, ids) -> the final hidden state: HyperHead's collapse, then the norm."""

    @staticmethod
    def hf_prefix(config, **module_kwargs):
        return "model."

    def __init__(self, config, *, seed):
        super().__init__()
        self.hc_head = HyperHead(config)
        self.norm = Fp32RMSNorm(config.hidden_size, config.rms_norm_eps)
        init_v4(self, seed=layer_seed(seed, 3 + config.num_hidden_layers), std=config.initializer_range)

    def forward(self, x):
        streams, _ = x
        return self.norm(self.hc_head(streams))

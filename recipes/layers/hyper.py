"""Manifold-constrained hyper-connections (mHC), DeepSeek-V4's residual stream: the
hidden state travels as ``hc_mult`` copies [B, S, N, H]. Before each sublayer a learned
mix reads them into one input (``pre``); after it, the sublayer's output is spread
back over the copies (``post``) and added to the copies recombined by a doubly-
stochastic matrix (``comb``, Sinkhorn-Knopp): out = post x y + comb^T streams.
``HyperHead`` collapses the copies once before the final norm.

The arithmetic follows transformers' DeepseekV4HyperConnection / DeepseekV4HyperHead
step by step (fp32 throughout, the same reductions in the same order), so the two agree
to rounding of the same operations.
"""

import torch
import torch.nn.functional as F
from torch import nn


def unweighted_rms_norm(x, eps):
    """x / rms(x) over the last dimension, the statistic in fp32, the product in x's dtype."""
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


class HyperConnection(nn.Module):
    """The weights of one sublayer's mix, from the N streams: ``fn`` [(2 + N) N, N H]
    projects the normed, flattened streams to pre (N), post (N) and comb (N x N)
    logits; ``base`` their biases; ``scale`` one scale each. Names as transformers'."""

    def __init__(self, config):
        super().__init__()
        n = config.hc_mult
        self.hc_mult, self.iters, self.eps, self.norm_eps = n, config.hc_sinkhorn_iters, config.hc_eps, config.rms_norm_eps
        self.fn = nn.Parameter(torch.empty((2 + n) * n, n * config.hidden_size, dtype=torch.float32))
        self.base = nn.Parameter(torch.empty((2 + n) * n, dtype=torch.float32))
        self.scale = nn.Parameter(torch.empty(3, dtype=torch.float32))

    def reset_parameters(self, std):
        nn.init.normal_(self.fn, mean=0.0, std=std)
        nn.init.zeros_(self.base)
        nn.init.ones_(self.scale)

    def forward(self, streams):
        """streams [B, S, N, H] -> (post [B, S, N], comb [B, S, N, N], the sublayer's
        input [B, S, H] in the streams' dtype); post and comb in fp32."""
        b, s, n = streams.shape[0], streams.shape[1], self.hc_mult
        flat = unweighted_rms_norm(streams.reshape(b, s, -1).float(), self.norm_eps)
        mixed = F.linear(flat, self.fn.float())
        pre_w, post_w, comb_w = mixed.split([n, n, n * n], dim=-1)
        pre_b, post_b, comb_b = self.base.split([n, n, n * n])
        pre_scale, post_scale, comb_scale = self.scale.unbind(0)
        pre = torch.sigmoid(pre_w * pre_scale + pre_b) + self.eps
        post = 2 * torch.sigmoid(post_w * post_scale + post_b)
        comb = torch.softmax(comb_w.view(b, s, n, n) * comb_scale + comb_b.view(n, n), dim=-1) + self.eps
        # Sinkhorn-Knopp: columns first, then rows and columns in turn
        comb = comb / (comb.sum(dim=-2, keepdim=True) + self.eps)
        for _ in range(self.iters - 1):
            comb = comb / (comb.sum(dim=-1, keepdim=True) + self.eps)
            comb = comb / (comb.sum(dim=-2, keepdim=True) + self.eps)
        collapsed = (pre.unsqueeze(-1) * streams).sum(dim=2).to(streams.dtype)
        return post, comb, collapsed


def hyper_residual(streams, output, post, comb):
    """The streams after a sublayer: post x its output + comb^T streams [B, S, N, H]
    (comb read as sum_j comb[j, k] streams[j]), in the streams' dtype."""
    dtype = streams.dtype
    return post.to(dtype).unsqueeze(-1) * output.unsqueeze(-2) + torch.matmul(comb.to(dtype).transpose(-1, -2),
                                                                                streams)


class HyperHead(nn.Module):
    """The final collapse of the N streams into one hidden state (before the final
    norm): a sigmoid mix from the normed streams; names as transformers'."""

    def __init__(self, config):
        super().__init__()
        n = config.hc_mult
        self.eps, self.norm_eps = config.hc_eps, config.rms_norm_eps
        self.hc_fn = nn.Parameter(torch.empty(n, n * config.hidden_size, dtype=torch.float32))
        self.hc_base = nn.Parameter(torch.empty(n, dtype=torch.float32))
        self.hc_scale = nn.Parameter(torch.empty(1, dtype=torch.float32))

    def reset_parameters(self, std):
        nn.init.normal_(self.hc_fn, mean=0.0, std=std)
        nn.init.zeros_(self.hc_base)
        nn.init.ones_(self.hc_scale)

    def forward(self, streams):
        flat = unweighted_rms_norm(streams.flatten(2).float(), self.norm_eps)
        mixes = F.linear(flat, self.hc_fn.float())
        pre = torch.sigmoid(mixes * self.hc_scale.float() + self.hc_base.float()) + self.eps
        return (pre.unsqueeze(-1) * streams).sum(dim=2).to(streams.dtype)

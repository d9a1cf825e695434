"""DeepSeekMoE as transformers' DeepseekV3MoE computes it: shared experts plus routed
SwiGLU experts, a sigmoid router in fp32 whose ``e_score_correction_bias`` only
chooses experts, group-limited top-k, optional normalisation and a routed scaling
factor. No token is dropped.

Experts are stored packed (``gate_up_proj`` [E, 2I, H], ``down_proj`` [E, H, I]) as in
transformers. This is the single-rank layer; expert parallelism, auxiliary-loss-free
bias updates and the balance loss are not implemented yet (see the README).
"""

import torch
import torch.nn.functional as F
from torch import nn

from .mlp import ACTIVATIONS, SwiGLU


class TopkRouter(nn.Module):
    # DeepSpeed keeps buffers named here in fp32 when training in bf16/fp16
    # (deepspeed/runtime/keep_in_fp32.py), as transformers' DeepseekV3 asks for.
    _keep_in_fp32_modules_strict = ["e_score_correction_bias"]

    def __init__(self, config):
        super().__init__()
        c = config
        self.top_k = c.num_experts_per_tok
        self.num_experts = c.n_routed_experts
        self.n_group = c.n_group
        self.topk_group = c.topk_group
        self.norm_topk_prob = c.norm_topk_prob
        self.routed_scaling_factor = c.routed_scaling_factor
        self.weight = nn.Parameter(torch.zeros(c.n_routed_experts, c.hidden_size, dtype=torch.float32))
        self.register_buffer("e_score_correction_bias", torch.zeros(c.n_routed_experts, dtype=torch.float32))

    def forward(self, x):
        """x [T, H] -> (weights [T, k], indices [T, k])."""
        scores = F.linear(x.float(), self.weight.float()).sigmoid()
        choice = scores + self.e_score_correction_bias
        per_group = self.num_experts // self.n_group
        group_scores = choice.view(-1, self.n_group, per_group).topk(2, dim=-1)[0].sum(dim=-1)
        group_idx = torch.topk(group_scores, k=self.topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
        expert_mask = group_mask.unsqueeze(-1).expand(-1, self.n_group, per_group).reshape(-1, self.num_experts)
        choice = choice.masked_fill(~expert_mask.bool(), float("-inf"))
        indices = torch.topk(choice, k=self.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, indices)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.routed_scaling_factor, indices


class RoutedExperts(nn.Module):

    def __init__(self, config):
        super().__init__()
        c = config
        self.num_experts = c.n_routed_experts
        self.gate_up_proj = nn.Parameter(torch.empty(c.n_routed_experts, 2 * c.moe_intermediate_size, c.hidden_size))
        self.down_proj = nn.Parameter(torch.empty(c.n_routed_experts, c.hidden_size, c.moe_intermediate_size))
        self.act_fn = ACTIVATIONS[c.hidden_act]

    def forward(self, x, weights, indices):
        out = torch.zeros_like(x)
        with torch.no_grad():
            hit = torch.bincount(indices.flatten(), minlength=self.num_experts).nonzero().flatten().tolist()
        for expert in hit:
            token_idx, slot = torch.where(indices == expert)
            gate, up = F.linear(x[token_idx], self.gate_up_proj[expert]).chunk(2, dim=-1)
            y = F.linear(self.act_fn(gate) * up, self.down_proj[expert])
            out.index_add_(0, token_idx, (y * weights[token_idx, slot, None]).to(out.dtype))
        return out


class DeepSeekMoE(nn.Module):

    def __init__(self, config):
        super().__init__()
        c = config
        self.gate = TopkRouter(c)
        self.experts = RoutedExperts(c)
        self.shared_experts = SwiGLU(c.hidden_size, c.moe_intermediate_size * c.n_shared_experts, c.hidden_act)

    def forward(self, x):
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        weights, indices = self.gate(flat)
        return self.experts(flat, weights, indices).view(shape) + self.shared_experts(x)

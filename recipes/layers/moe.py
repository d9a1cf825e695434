"""DeepSeekMoE as transformers' DeepseekV3MoE computes it: shared experts plus routed
SwiGLU experts, a sigmoid router in fp32 whose ``e_score_correction_bias`` only
chooses experts, group-limited top-k, optional normalisation and a routed scaling
factor. No token is dropped.

Experts are stored packed (``gate_up_proj`` [E, 2I, H], ``down_proj`` [E, H, I]) as in
transformers.

Load balancing as in the DeepSeek-V3 report:
- auxiliary-loss-free: the router counts the tokens each expert receives during a
  training step; ``update_expert_biases`` then moves each expert's
  ``e_score_correction_bias`` by ``speed`` towards balance (down when the expert got
  more than the mean load, up when less), with counts summed over data-parallel ranks;
- the sequence-wise balance loss ``alpha * sum_i f_i P_i`` (per sequence, averaged),
  added to the gradient through the routing weights, so no stage has to return it.
"""

import torch
import torch.nn.functional as F
from torch import nn

from .mlp import ACTIVATIONS, SwiGLU


def _in_backward():
    """True while autograd runs a backward pass (activation-checkpoint recomputation)."""
    return torch._C._current_graph_task_id() != -1


class _AddAuxLossGrad(torch.autograd.Function):
    """Identity on ``x`` whose backward also sends ``scale`` as the gradient of ``aux``,
    so an auxiliary loss computed inside a layer trains without being returned."""

    @staticmethod
    def forward(ctx, x, aux, scale):
        ctx.save_for_backward(aux)
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        (aux,) = ctx.saved_tensors
        return grad, torch.full_like(aux, ctx.scale), None


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
        # tokens routed to each expert since the last update_expert_biases (training only)
        self.register_buffer("expert_load", torch.zeros(c.n_routed_experts, dtype=torch.float32), persistent=False)
        self.balance_alpha = 0.0        # sequence-wise balance loss weight (set by configure_balancing)
        self.aux_grad_scale = 1.0       # the engine's loss scaling of one micro-batch (1 / accumulation)
        self.balance_loss_sum, self.balance_loss_count = 0.0, 0

    def forward(self, x, *, seq_len=None):
        """x [T, H] -> (weights [T, k], indices [T, k]); ``seq_len`` splits T into
        sequences for the balance loss."""
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
        weights = weights * self.routed_scaling_factor
        if self.training and not _in_backward():
            with torch.no_grad():
                self.expert_load += torch.bincount(indices.flatten(), minlength=self.num_experts).float()
        if self.training and self.balance_alpha > 0 and torch.is_grad_enabled():
            loss = self.sequence_balance_loss(scores, indices, seq_len=seq_len or scores.shape[0])
            if not _in_backward():
                self.balance_loss_sum += loss.item()
                self.balance_loss_count += 1
            weights = _AddAuxLossGrad.apply(weights, loss, self.aux_grad_scale)
        return weights, indices

    def sequence_balance_loss(self, scores, indices, *, seq_len):
        """alpha * mean over sequences of sum_i f_i P_i (DeepSeek-V3 report, eq. 17-20):
        f_i = E / (K T) * tokens of the sequence routed to i; P_i = mean over the
        sequence of the scores normalised over all experts."""
        experts, k = self.num_experts, self.top_k
        probs = (scores / scores.sum(dim=-1, keepdim=True)).view(-1, seq_len, experts)
        chosen = torch.zeros_like(scores).scatter_(1, indices, 1.0).view(-1, seq_len, experts)
        f = chosen.sum(dim=1) * experts / (k * seq_len)
        return self.balance_alpha * (f * probs.mean(dim=1)).sum(dim=-1).mean()


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
        weights, indices = self.gate(flat, seq_len=shape[-2] if x.dim() == 3 else None)
        return self.experts(flat, weights, indices).view(shape) + self.shared_experts(x)


def routers(module):
    """(name, router) for the MoE routers of ``module``, in a fixed order (the same
    on every rank of a stage)."""
    return [(n, m) for n, m in sorted(module.named_modules(), key=lambda kv: kv[0]) if isinstance(m, TopkRouter)]


def configure_balancing(module, *, alpha, grad_scale):
    for _, router in routers(module):
        router.balance_alpha = alpha
        router.aux_grad_scale = grad_scale


@torch.no_grad()
def update_expert_biases(module, *, speed, group=None):
    """After an optimizer step: sum each router's expert loads over ``group`` (the
    data-parallel ranks of this stage), move the biases by ``speed`` against the
    imbalance, clear the counts. Returns {router name: summed load}."""
    found = routers(module)
    if not found:
        return {}
    loads = torch.cat([r.expert_load for _, r in found])
    if group is not None and torch.distributed.is_initialized():
        torch.distributed.all_reduce(loads, group=group)
    out = {}
    for (name, router), load in zip(found, loads.split([r.num_experts for _, r in found])):
        if speed > 0:
            router.e_score_correction_bias += speed * torch.sign(load.mean() - load)
        router.expert_load.zero_()
        out[name] = load.cpu().tolist()
    return out


def take_balance_loss(module):
    """The sequence-wise balance loss of ``module``'s MoE layers since the last call:
    per layer the mean over its micro-batches, summed over layers (None if off)."""
    total, seen = 0.0, False
    for _, router in routers(module):
        if router.balance_loss_count:
            total += router.balance_loss_sum / router.balance_loss_count
            seen = True
        router.balance_loss_sum, router.balance_loss_count = 0.0, 0
    return total if seen else None

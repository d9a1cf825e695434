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

from ds_ext.comm import alltoall
from ds_ext.pipe.overlap import interleaving
from ds_ext.pipe.zero_bubble import linear

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


class ExpertMLP(nn.Module):
    """One routed SwiGLU expert; ``gate_up_proj`` [2I, H] and ``down_proj`` [H, I] are
    one row of transformers' packed [E, ...] expert tensors."""

    def __init__(self, config):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(2 * config.moe_intermediate_size, config.hidden_size))
        self.down_proj = nn.Parameter(torch.empty(config.hidden_size, config.moe_intermediate_size))
        self.act_fn = ACTIVATIONS[config.hidden_act]

    def forward(self, x):
        gate, up = linear(x, self.gate_up_proj).chunk(2, dim=-1)
        return linear(self.act_fn(gate) * up, self.down_proj)


def _moe_base():
    from deepspeed.moe.layer import MoE
    return MoE


class DeepSeekMoE(_moe_base()):
    """The MoE feed-forward. A DeepSpeed ``MoE`` module, so DeepSpeed's engine creates
    the expert-parallel groups (``set_deepspeed_parallelism``), reduces the routed
    experts' gradients only over the ranks holding the same experts, gives them their
    own ZeRO-1 partitions and checkpoints them per expert. Routed experts live under
    ``deepspeed_moe.experts.deepspeed_experts.<i>`` (the names DeepSpeed's checkpoint
    code expects); with expert-parallel degree P this rank holds experts
    [ep_rank * E/P, (ep_rank + 1) * E/P) and tokens reach them by all-to-all."""

    # its all-to-alls go through ds_ext.comm.alltoall: an interleaved F&B chunk can
    # switch halves at them (ds_ext/pipe/overlap.py)
    async_all_to_all = True

    def __init__(self, config, *, ep_size=1, ep_rank=0, seed=0):
        nn.Module.__init__(self)   # DeepSpeed's MoE.__init__ builds its own gate and experts; ours differ
        c = config
        if c.n_routed_experts % ep_size:
            raise ValueError(f"n_routed_experts {c.n_routed_experts} is not divisible by expert_parallel_size {ep_size}")
        self.num_experts = c.n_routed_experts
        self.ep_size, self.ep_rank = ep_size, ep_rank
        self.num_local_experts = c.n_routed_experts // ep_size
        self.expert_group_name = f"ep_size_{ep_size}"
        self.enable_expert_tensor_parallelism = False
        self.ep_group = None
        self.gate = TopkRouter(c)
        self.deepspeed_moe = nn.Module()
        self.deepspeed_moe.experts = nn.Module()
        self.deepspeed_moe.experts.deepspeed_experts = nn.ModuleList(ExpertMLP(c) for _ in range(self.num_local_experts))
        for p in self.deepspeed_moe.experts.parameters():
            p.allreduce = False
            p.group_name = self.expert_group_name
        # named without "expert": DeepSpeed treats every tensor whose name has it as routed
        self.shared_mlp = SwiGLU(c.hidden_size, c.moe_intermediate_size * c.n_shared_experts, c.hidden_act)
        self._init_std, self._seed = c.initializer_range, seed

    @property
    def experts(self):
        return self.deepspeed_moe.experts.deepspeed_experts

    def first_expert(self):
        return self.ep_rank * self.num_local_experts

    def init_experts(self, *, seed, std):
        """Each routed expert from its own RNG stream, keyed by its global index, so
        the model is the same for every expert-parallel degree."""
        for local, expert in enumerate(self.experts):
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed((seed * 1_000_003 + 7919 * (self.first_expert() + local + 1)) % (2**63 - 1))
                nn.init.normal_(expert.gate_up_proj, mean=0.0, std=std)
                nn.init.normal_(expert.down_proj, mean=0.0, std=std)

    def set_deepspeed_parallelism(self, use_data_before_expert_parallel_=False):
        """Called by DeepSpeed's engine: make (or reuse) the expert-parallel groups."""
        from deepspeed.utils import groups
        if self.expert_group_name not in groups._get_expert_parallel_group_dict():
            groups._create_expert_and_data_parallel(self.ep_size,
                                                    use_data_before_expert_parallel_=use_data_before_expert_parallel_)
        self.ep_group = groups._get_expert_parallel_group(self.expert_group_name)
        rank = groups._get_expert_parallel_rank(self.expert_group_name)
        if rank != self.ep_rank:
            raise RuntimeError(f"expert-parallel rank {rank} from DeepSpeed's groups differs from the {self.ep_rank} "
                               f"this layer was built for: the rank layout is not pipe x data")

    def forward(self, x):
        """Routed experts plus the shared expert. The token all-to-alls are asynchronous:
        the dispatch is in flight while the shared expert computes (forward, and in the
        backward the reverse dispatch while the shared expert's backward runs), and
        inside an interleaved F&B chunk (ds_ext.pipe.overlap) every dispatch and combine
        lets the other micro-batch compute. Tokens are permuted once each way (a gather sorted by
        expert before the dispatch, an index_add after the combine)."""
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        weights, indices = self.gate(flat, seq_len=shape[-2] if x.dim() == 3 else None)
        tokens, k = indices.shape
        flat_experts = indices.reshape(-1)
        order = torch.argsort(flat_experts, stable=True)        # by expert, so by destination rank
        token_of = order // k
        per_expert = torch.bincount(flat_experts, minlength=self.num_experts)
        group = self.ep_group if self.ep_size > 1 else None
        # Interleaved with another micro-batch's half (ds_ext/pipe/overlap.py), the dispatch
        # runs behind that half and the shared expert covers the counts exchange (its
        # latency, and a peer rank's lag behind this one); alone, it covers the dispatch.
        # Autograd adds the input's gradients in the same order either way.
        interleaved = interleaving()
        counts = alltoall.start(per_expert, out_splits=[self.num_local_experts] * self.ep_size,
                                in_splits=[self.num_local_experts] * self.ep_size, group=group, label="F counts",
                                hand_over=False)
        sent = flat[token_of]
        if interleaved:
            shared = self.shared_mlp(x)
        counts = counts.wait().view(self.ep_size, self.num_local_experts)   # [source, local expert] counts
        send_splits = per_expert.view(self.ep_size, -1).sum(1).tolist()
        recv_splits = counts.sum(1).tolist()
        route = dict(out_splits=recv_splits, in_splits=send_splits, group=group, label="dispatch")
        slot = alltoall.Slot()
        received = alltoall.dispatch(sent, slot, **route)
        if not interleaved:
            shared = self.shared_mlp(x)
        received = alltoall.arrive(received, slot, **route)
        outputs = self._run_experts(received, counts.tolist())
        back = dict(out_splits=send_splits, in_splits=recv_splits, group=group, label="combine")
        slot = alltoall.Slot()
        outputs = alltoall.arrive(alltoall.dispatch(outputs, slot, **back), slot, **back)
        scale = weights.reshape(-1)[order].unsqueeze(-1)
        routed = torch.zeros_like(flat).index_add(0, token_of, (outputs * scale).to(flat.dtype))
        return routed.view(shape) + shared

    def _run_experts(self, received, counts):
        """The routed experts on ``received``: rows grouped by source rank, then by local
        expert (``counts[source][expert]`` rows each, contiguous). Each (source, expert)
        segment is its own matrix multiply, the one the source rank would run on its own
        tokens with expert parallelism off: the same shapes, so the same arithmetic on
        every expert-parallel degree; only the weight-gradient sum over sources differs
        (a sum of two terms for degree 2, which commutes)."""
        pieces, ran = [], set()
        start = 0
        for source in counts:
            for j, n in enumerate(source):
                if n or j not in ran:
                    # an expert no token chose still runs (on zero rows): every expert then
                    # has a gradient, zeros or not, so all ranks reduce the same buckets
                    pieces.append(self.experts[j](received[start:start + n]).to(received.dtype))
                    ran.add(j)
                start += n
        return torch.cat(pieces)


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

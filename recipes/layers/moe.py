"""DeepSeekMoE as transformers' DeepseekV3MoE computes it: shared experts plus routed
SwiGLU experts, a sigmoid router in fp32 whose ``e_score_correction_bias`` only
chooses experts, group-limited top-k, optional normalisation and a routed scaling
factor. No token is dropped.

Each routed expert is its own module with transformers' per-expert rows
(``gate_up_proj`` [2I, H], ``down_proj`` [H, I] of its packed [E, ...] tensors), all of
a layer's experts laid out in one buffer (``pack_expert_parameters``).

Load balancing as in the DeepSeek-V3 report:
- auxiliary-loss-free: the router counts the tokens each expert receives during a
  training step; ``update_expert_biases`` then moves each expert's
  ``e_score_correction_bias`` by ``speed`` towards balance (down when the expert got
  more than the mean load, up when less), with counts summed over data-parallel ranks;
- the sequence-wise balance loss ``alpha * sum_i f_i P_i`` (per sequence, averaged),
  added to the gradient through the routing weights, so no stage has to return it.

Routed experts run as grouped matrix multiplies (``torch.nn.functional.grouped_mm``,
one group per (source rank, local expert) segment) where the device, dtype and shape
allow them, else as one Python iteration per segment (``experts_impl`` "loop"); see
``experts_implementation``.
"""

import sys

import torch
import torch.nn.functional as F
from torch import nn

from ds_ext.errors import ConfigError
from ds_ext.pipe.zero_bubble import WeightGradStore, _accumulate, linear

from .dispatch import DEFAULT_DISPATCH, check_node_limited, dispatch_and_combine
from .mlp import ACTIVATIONS, SwiGLU, clamped_swiglu


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


# the routers' score functions (a config's scoring_func; DeepSeek-V3 "sigmoid", V4 "sqrtsoftplus")
SCORE_FUNCTIONS = {"sigmoid": torch.sigmoid, "sqrtsoftplus": lambda logits: F.softplus(logits).sqrt()}


class TopkRouter(nn.Module):
    """Scores in fp32 (``scoring_func``: DeepSeek-V3's sigmoid, V4's sqrt(softplus)), the
    bias added for the choice only, group-limited top-k where ``n_group`` > 1."""

    # DeepSpeed keeps buffers named here in fp32 when training in bf16/fp16
    # (deepspeed/runtime/keep_in_fp32.py), as transformers' DeepseekV3 asks for.
    _keep_in_fp32_modules_strict = ["e_score_correction_bias"]
    needs_ids = False

    def __init__(self, config):
        super().__init__()
        c = config
        self.top_k = c.num_experts_per_tok
        self.num_experts = c.n_routed_experts
        self.n_group = getattr(c, "n_group", 1)
        self.topk_group = getattr(c, "topk_group", 1)
        self.score_fn = SCORE_FUNCTIONS[getattr(c, "scoring_func", "sigmoid")]
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
        scores = self.score_fn(F.linear(x.float(), self.weight.float()))
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


class HashRouter(nn.Module):
    """DeepSeek-V4's hash routing: a token's experts come from a fixed table of its id
    (``tid2eid`` [vocab, k], a persistent buffer: saved in checkpoints and exported),
    its weights from the learned scores of those experts, normalised and scaled. No
    bias, no load counting: the table decides the load. ``assign_balanced`` fills the
    table (transformers initialises it to zeros: every token to expert 0)."""

    needs_ids = True
    n_group = topk_group = 1

    def __init__(self, config):
        super().__init__()
        c = config
        self.top_k, self.num_experts = c.num_experts_per_tok, c.n_routed_experts
        self.routed_scaling_factor = c.routed_scaling_factor
        self.score_fn = SCORE_FUNCTIONS[c.scoring_func]
        self.weight = nn.Parameter(torch.zeros(c.n_routed_experts, c.hidden_size, dtype=torch.float32))
        self.register_buffer("tid2eid", torch.zeros(c.vocab_size, c.num_experts_per_tok, dtype=torch.long))

    def assign_balanced(self, generator):
        """Each token id to k distinct experts, every expert the same share of the
        vocabulary's k slots (to one slot): experts in a random order, repeated, cut into
        rows of k (k <= E consecutive entries of a cycle are distinct), the rows dealt to
        the token ids in a random order."""
        vocab, k, experts = self.tid2eid.shape[0], self.top_k, self.num_experts
        cycle = torch.randperm(experts, generator=generator)
        rows = cycle[torch.arange(vocab * k) % experts].view(vocab, k)
        self.tid2eid.copy_(rows[torch.randperm(vocab, generator=generator)])

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        table = state_dict.get(prefix + "tid2eid")
        if table is not None:
            check_hash_table(table, num_experts=self.num_experts, where=prefix + "tid2eid")
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def forward(self, x, *, seq_len=None, ids=None):
        if ids is None:
            raise ValueError("a hash-routed MoE layer needs the token ids, and none reached it: the recipe's pipeline "
                             "carries them to every decoder layer (mlp_layer_types 'hash_moe')")
        scores = self.score_fn(F.linear(x.float(), self.weight.float()))
        indices = self.tid2eid[ids.reshape(-1)]
        weights = scores.gather(1, indices)
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.routed_scaling_factor, indices


def check_hash_table(tid2eid, *, num_experts, where):
    """A loaded tid2eid names experts of the model only."""
    if tid2eid.numel() and (int(tid2eid.min()) < 0 or int(tid2eid.max()) >= num_experts):
        raise ConfigError(f"{where}: tid2eid names experts {int(tid2eid.min())}..{int(tid2eid.max())}, outside the "
                         f"{num_experts} of n_routed_experts: load a table made for this model (or leave it to the "
                         f"recipe's balanced assignment)")


class ExpertMLP(nn.Module):
    """One routed SwiGLU expert; ``gate_up_proj`` [2I, H] and ``down_proj`` [H, I] are
    one row of transformers' packed [E, ...] expert tensors; with the config's
    ``swiglu_limit`` (V4) the gate and up projections are clamped."""

    def __init__(self, config):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(2 * config.moe_intermediate_size, config.hidden_size))
        self.down_proj = nn.Parameter(torch.empty(config.hidden_size, config.moe_intermediate_size))
        self.act_fn = ACTIVATIONS[config.hidden_act]
        self.limit = getattr(config, "swiglu_limit", None)

    def forward(self, x):
        gate, up = linear(x, self.gate_up_proj).chunk(2, dim=-1)
        return linear(clamped_swiglu(self.act_fn, gate, up, self.limit), self.down_proj)


EXPERTS_IMPLS = ("auto", "grouped", "loop")
_CHOSEN = {}    # (device, dtype, weight dtype, hidden, moe_intermediate, requested) -> (implementation, why)


def pack_expert_parameters(experts):
    """Lay the experts' ``gate_up_proj`` and ``down_proj`` out in one buffer, expert after
    expert, each still its own Parameter (a view of it), so the grouped path reads them
    as [E, ...] tensors without copying (``stacked_view``). DeepSpeed's ZeRO flat
    buffers keep this order, so the layout usually survives its flattening too."""
    params = [p for e in experts for p in (e.gate_up_proj, e.down_proj)]
    if not params or _in_one_buffer(experts):
        return
    flat = torch.empty(sum(p.numel() for p in params), dtype=params[0].dtype, device=params[0].device)
    offset = 0
    for p in params:
        view = flat[offset:offset + p.numel()].view_as(p)
        if not p.is_meta:
            view.copy_(p.detach())
        p.data = view
        offset += p.numel()


def _in_one_buffer(experts):
    return all(stacked_view([getattr(e, name) for e in experts]) is not None for name in ("gate_up_proj", "down_proj"))


def stacked_view(tensors):
    """``torch.stack(tensors)`` as a view when the tensors (contiguous, one shape) lie
    equally spaced in one storage, else None."""
    first = tensors[0]
    if not all(t.is_contiguous() and t.shape == first.shape and t.dtype == first.dtype and t.device == first.device
               for t in tensors):
        return None
    if len(tensors) > 1:
        if first.is_meta or any(t.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()
                                for t in tensors):
            return None
        step = tensors[1].storage_offset() - first.storage_offset()
        if step < first.numel() or any(t.storage_offset() != first.storage_offset() + i * step
                                       for i, t in enumerate(tensors)):
            return None
    else:
        step = first.numel()
    return first.detach().as_strided((len(tensors),) + tuple(first.shape), (step,) + first.stride())


def _stacked(tensors):
    view = stacked_view(tensors)
    return torch.stack([t.detach() for t in tensors]) if view is None else view


def _probe_grouped_mm(*, gate_up, down, dtype):
    """None when grouped_mm runs the six grouped products of the experts' forward and
    backward on ``gate_up`` [G, 2I, H] and ``down`` [G, H, I] (groups of 0 and 2 rows),
    else why not."""
    if not hasattr(F, "grouped_mm"):
        return f"torch {torch.__version__} has no torch.nn.functional.grouped_mm"
    groups, hidden, inter = gate_up.shape[0], gate_up.shape[2], down.shape[2]
    offs = torch.tensor([0] * (groups - 1) + [2], dtype=torch.int32, device=gate_up.device)
    x = torch.zeros(2, hidden, dtype=dtype, device=gate_up.device)
    try:
        h = F.grouped_mm(x, gate_up.transpose(1, 2), offs=offs)
        y = F.grouped_mm(h[:, :inter].contiguous(), down.transpose(1, 2), offs=offs)
        F.grouped_mm(y, down, offs=offs)
        F.grouped_mm(h, gate_up, offs=offs)
        F.grouped_mm(y.t(), h[:, :inter].contiguous(), offs=offs)
        F.grouped_mm(h.t(), x, offs=offs)
    except (RuntimeError, NotImplementedError, TypeError) as exc:
        return f"grouped_mm refused it: {str(exc).splitlines()[0]}"
    return None


def experts_implementation(*, requested, experts, dtype):
    """("grouped" | "loop", why) for ``experts`` (the routed ExpertMLPs of a layer) on
    activations of ``dtype``. "auto" is grouped where grouped_mm runs the experts'
    products on this device, dtype and shape (probed once per process on the first
    two experts), else the per-expert loop. The choice is printed once per key."""
    if requested not in EXPERTS_IMPLS:
        raise ValueError(f"experts_impl {requested!r} is unknown: use one of {list(EXPERTS_IMPLS)}")
    first = experts[0]
    hidden, inter = first.down_proj.shape
    device = first.down_proj.device
    key = (device.type, dtype, first.down_proj.dtype, hidden, inter, requested)
    if key not in _CHOSEN:
        if requested == "loop":
            choice = ("loop", "experts_impl 'loop'")
        elif first.limit is not None and requested == "grouped":
            raise ValueError(f"experts_impl 'grouped': the experts clamp their SwiGLU (swiglu_limit {first.limit}), "
                             f"which the grouped path does not; use experts_impl 'auto' or 'loop'")
        elif first.limit is not None:
            choice = ("loop", f"swiglu_limit {first.limit}: the grouped path has no clamp")
        else:
            sample = list(experts)[:2]
            refused = None if first.down_proj.dtype == dtype else \
                f"expert weights are {first.down_proj.dtype}, activations {dtype}"
            refused = refused or _probe_grouped_mm(gate_up=_stacked([e.gate_up_proj for e in sample]),
                                                   down=_stacked([e.down_proj for e in sample]), dtype=dtype)
            if refused and requested == "grouped":
                raise ValueError(f"experts_impl 'grouped' on {device.type} {dtype} (hidden {hidden}, moe_intermediate "
                                 f"{inter}): {refused}; use experts_impl 'auto' (falls back to the per-expert loop) "
                                 f"or 'loop'")
            layout = "expert weights read in place" if _in_one_buffer(experts) else \
                "expert weights not in one buffer: stacked, a copy, on every call"
            choice = ("loop", refused) if refused else \
                ("grouped", f"torch.nn.functional.grouped_mm runs on it; {layout}")
        _CHOSEN[key] = choice
        _announce(f"seekspeed moe: routed experts on {device.type} {str(dtype).replace('torch.', '')} "
                  f"(hidden {hidden}, moe_intermediate {inter}): {choice[0]} ({choice[1]})")
    return _CHOSEN[key]


def _announce(line):
    """The choice, once, on rank 0, to stderr: a log line, not output (generate.py
    writes its text to stdout)."""
    if not torch.distributed.is_available() or not torch.distributed.is_initialized() or \
            torch.distributed.get_rank() == 0:
        print(line, file=sys.stderr, flush=True)


# glibc maps an allocation above its mmap threshold (which rises with use to at most
# 32 MiB) afresh each time, and the first touch faults its pages in one by one; below it
# freed blocks are reused. On CPU the grouped path therefore runs in calls whose largest
# activation stays under this size (V2-Lite's experts at hidden 512, one call: 104k
# page faults a step; a per-expert loop with small tensors: 18).
_CPU_CALL_BYTES = 16 * 2**20


def _cat(parts, empty):
    return parts[0] if len(parts) == 1 else torch.cat(parts) if parts else empty


class _Segments:
    """The experts' input rows, grouped by source rank, then by local expert (contiguous),
    and the grouped_mm calls covering them: per source, runs of consecutive local
    experts (all of them; on CPU as many as keep a run's rows times ``row_bytes`` under
    _CPU_CALL_BYTES), each call (first row, end row, first expert, int32 ends of its
    groups relative to the first row). Each group is one (source, expert) segment."""

    def __init__(self, counts, *, device, row_bytes):
        self.num_local = len(counts[0])
        self.calls, start = [], 0
        limit = _CPU_CALL_BYTES // row_bytes if device.type == "cpu" else None
        for source in counts:
            first, rows = 0, 0
            for j, n in enumerate(source):
                if limit is not None and rows and rows + n > limit:
                    start = self._call(start, source[first:j], first, device)
                    first, rows = j, 0
                rows += n
            start = self._call(start, source[first:], first, device)

    def _call(self, start, sizes, first, device):
        rows = sum(sizes)
        if rows:
            ends = torch.tensor(sizes, dtype=torch.int64).cumsum(0).to(device=device, dtype=torch.int32)
            self.calls.append((start, start + rows, first, ends))
        return start + rows

    def weight_grad(self, grads, inputs, *, shape, like):
        """Per local expert, the sum over its segments of grad^T @ input (``grads``,
        ``inputs``: a list with one tensor per call, or one tensor of every row): a list
        of E tensors of ``shape``, zeros (``like``'s dtype and device) for an expert no
        row reached. On CPU one mm per segment, each into its own tensor (what
        grouped_mm does there, without its one [E, *shape] result: 553 MB of fresh
        pages a step for V2-Lite's experts at hidden 512); elsewhere one grouped_mm
        per call."""
        total = [None] * self.num_local
        for c, (lo, hi, first, ends) in enumerate(self.calls):
            grad = grads[c] if isinstance(grads, list) else grads[lo:hi]
            x = inputs[c] if isinstance(inputs, list) else inputs[lo:hi]
            if grad.device.type == "cpu":
                bounds = zip([0] + ends[:-1].tolist(), ends.tolist())
                parts = [None if s == e and total[first + g] is not None else grad[s:e].t() @ x[s:e]
                         for g, (s, e) in enumerate(bounds)]
            else:
                parts = F.grouped_mm(grad.t(), x, offs=ends).unbind(0)
            for g, part in enumerate(parts):
                j = first + g
                if part is not None:
                    total[j] = part if total[j] is None else total[j] + part
        return [like.new_zeros(shape) if t is None else t for t in total]


def _activation_backward(act_fn, grad, gate, *, out):
    """``out`` = grad * act_fn'(gate), as autograd computes it for ``act_fn(gate)``."""
    if act_fn is F.silu:
        torch.ops.aten.silu_backward.grad_input(grad, gate, grad_input=out)
        return
    with torch.enable_grad():
        leaf = gate.detach().requires_grad_(True)
        out.copy_(torch.autograd.grad(act_fn(leaf), leaf, grad)[0])


class _GroupedSwiGLU(torch.autograd.Function):
    """The routed experts on their segments: h = x W_gu^T, a = act(gate) * up,
    y = a W_down^T, grouped matrix multiplies with one group per (source, expert)
    segment, on the same views of the same rows as ExpertMLP's ``linear`` calls (on CPU
    grouped_mm runs one mm per group), keeping what autograd keeps for the loop (x, h,
    act(gate), a). Backward gives the input gradient at once and the experts' weight
    gradients at once, or queues them with WeightGradStore.put when zero-bubble
    deferral is on, as ``linear`` does. Every expert gets a weight gradient, zeros
    when no token reached it."""

    @staticmethod
    def forward(ctx, x, counts, act_fn, *weights):
        experts = len(weights) // 2
        x = x.contiguous()
        gate_up, down = _stacked(weights[:experts]), _stacked(weights[experts:])
        segments = _Segments(counts, device=x.device, row_bytes=gate_up.shape[1] * x.element_size())
        hs, acts, outs = [], [], []
        for lo, hi, first, ends in segments.calls:
            h = F.grouped_mm(x[lo:hi], gate_up[first:first + len(ends)].transpose(1, 2), offs=ends)
            gate, up = h.chunk(2, dim=-1)
            hs.append(h)
            acts.append(act_fn(gate))
            outs.append(acts[-1] * up)
        ctx.save_for_backward(x, *hs, *acts, *outs, *weights)
        outs = [F.grouped_mm(a, down[first:first + len(ends)].transpose(1, 2), offs=ends)
                for a, (_, _, first, ends) in zip(outs, segments.calls)]
        ctx.segments, ctx.act_fn, ctx.experts = segments, act_fn, experts
        return _cat(outs, x.new_empty(0, down.shape[1]))

    @staticmethod
    def backward(ctx, grad_out):
        segments, experts, calls = ctx.segments, ctx.experts, len(ctx.segments.calls)
        x, *saved = ctx.saved_tensors
        hs, acts, as_, weights = saved[:calls], saved[calls:2 * calls], saved[2 * calls:3 * calls], saved[3 * calls:]
        gate_up_params, down_params = weights[:experts], weights[experts:]
        grad_out = grad_out.contiguous()
        gate_up, down = _stacked(gate_up_params), _stacked(down_params)
        grad_hs, grad_xs = [], []
        for (lo, hi, first, ends), h, act in zip(segments.calls, hs, acts):
            gate, up = h.chunk(2, dim=-1)
            grad_h = torch.empty_like(h)
            grad_gate, grad_up = grad_h.chunk(2, dim=-1)
            grad_a = F.grouped_mm(grad_out[lo:hi], down[first:first + len(ends)], offs=ends)
            torch.mul(grad_a, act, out=grad_up)
            _activation_backward(ctx.act_fn, grad_a.mul_(up), gate, out=grad_gate)
            del grad_a
            grad_hs.append(grad_h)
            if ctx.needs_input_grad[0]:
                grad_xs.append(F.grouped_mm(grad_h, gate_up[first:first + len(ends)], offs=ends))
        grad_x = _cat(grad_xs, x.new_empty(0, x.shape[1])) if ctx.needs_input_grad[0] else None
        if not any(ctx.needs_input_grad[3:]):
            return (grad_x, None, None) + (None,) * len(weights)
        gate_up_shape, down_shape = tuple(gate_up.shape[1:]), tuple(down.shape[1:])
        del gate_up, down       # a stacked copy (experts not in one buffer) is not kept for a W slot

        def weight_grads():
            return (segments.weight_grad(grad_hs, x, shape=gate_up_shape, like=x),
                    segments.weight_grad(grad_out, list(as_), shape=down_shape, like=x))

        if WeightGradStore.enabled:
            def deferred():
                grad_gate_up, grad_down = weight_grads()
                for param, grad in zip(gate_up_params, grad_gate_up):
                    _accumulate(param, grad)
                for param, grad in zip(down_params, grad_down):
                    _accumulate(param, grad)
            WeightGradStore.put(deferred)
            return (grad_x, None, None) + (None,) * len(weights)
        grad_gate_up, grad_down = weight_grads()
        return (grad_x, None, None) + tuple(grad_gate_up) + tuple(grad_down)


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

    def __init__(self, config, *, ep_size=1, ep_rank=0, seed=0, experts_impl="auto", dispatch=DEFAULT_DISPATCH,
                 router=TopkRouter, shared_width=None):
        """``router``: the router class (TopkRouter, or HashRouter for DeepSeek-V4's hash
        layers); ``shared_width``: the shared experts' width (default
        moe_intermediate_size x n_shared_experts)."""
        nn.Module.__init__(self)   # DeepSpeed's MoE.__init__ builds its own gate and experts; ours differ
        c = config
        if c.n_routed_experts % ep_size:
            raise ValueError(f"n_routed_experts {c.n_routed_experts} is not divisible by expert_parallel_size {ep_size}")
        if experts_impl not in EXPERTS_IMPLS:
            raise ValueError(f"experts_impl {experts_impl!r} is unknown: use one of {list(EXPERTS_IMPLS)}")
        dispatch.check(hidden_size=c.hidden_size)
        self.experts_impl, self.dispatch = experts_impl, dispatch
        self.num_experts = c.n_routed_experts
        self.ep_size, self.ep_rank = ep_size, ep_rank
        self.num_local_experts = c.n_routed_experts // ep_size
        self.expert_group_name = f"ep_size_{ep_size}"
        self.enable_expert_tensor_parallelism = False
        self.ep_group = None
        self.node_hops = None                # set by use_node_hops when the group spans nodes of several ranks
        self.gate = router(c)
        self.deepspeed_moe = nn.Module()
        self.deepspeed_moe.experts = nn.Module()
        self.deepspeed_moe.experts.deepspeed_experts = nn.ModuleList(ExpertMLP(c) for _ in range(self.num_local_experts))
        pack_expert_parameters(self.deepspeed_moe.experts.deepspeed_experts)
        for p in self.deepspeed_moe.experts.parameters():
            p.allreduce = False
            p.group_name = self.expert_group_name
        # named without "expert": DeepSpeed treats every tensor whose name has it as routed
        self.shared_mlp = SwiGLU(c.hidden_size, shared_width or c.moe_intermediate_size * c.n_shared_experts,
                                 c.hidden_act, limit=getattr(c, "swiglu_limit", None))
        self._init_std, self._seed = c.initializer_range, seed

    @property
    def experts(self):
        return self.deepspeed_moe.experts.deepspeed_experts

    def _apply(self, fn, recurse=True):
        """``module.to(...)`` and the like give every parameter its own new tensor; lay the
        experts out in one buffer again then (only then: a conversion that kept the
        tensors, e.g. to the device they are on, must not move them out of DeepSpeed's
        flat buffers)."""
        before = [p.data_ptr() for p in self.experts.parameters()]
        out = super()._apply(fn, recurse)
        if [p.data_ptr() for p in self.experts.parameters()] != before:
            pack_expert_parameters(self.experts)
        return out

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

    def forward(self, x, ids=None):
        """Routed experts plus the shared expert, the tokens moved by this layer's
        dispatcher (recipes/layers/dispatch.py). The token all-to-alls are asynchronous:
        the dispatch is in flight while the shared expert computes (forward, and in the
        backward the reverse dispatch while the shared expert's backward runs), and
        inside an interleaved F&B chunk (ds_ext.pipe.overlap) every dispatch and combine
        lets the other micro-batch compute."""
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        routing = {"ids": ids} if self.gate.needs_ids else {}
        weights, indices = self.gate(flat, seq_len=shape[-2] if x.dim() == 3 else None, **routing)
        routed, shared = dispatch_and_combine(self.dispatch, flat, weights, indices, experts=self._run_experts,
                                              shared=lambda: self.shared_mlp(x), num_experts=self.num_experts,
                                              ep_size=self.ep_size, group=self.ep_group if self.ep_size > 1 else None,
                                              hops=self.node_hops)
        return routed.view(shape) + shared

    def _run_experts(self, received, counts):
        """The routed experts on ``received``: rows grouped by source rank, then by local
        expert (``counts[source][expert]`` rows each, contiguous). Each (source, expert)
        segment is its own matrix multiply, the one the source rank would run on its own
        tokens with expert parallelism off: the same shapes, so the same arithmetic on
        every expert-parallel degree; only the weight-gradient sum over sources differs
        (a sum of two terms for degree 2, which commutes). The grouped path runs the same
        segments as grouped matrix multiplies (_GroupedSwiGLU)."""
        impl, _ = experts_implementation(requested=self.experts_impl, experts=self.experts, dtype=received.dtype)
        if impl == "grouped":
            weights = [e.gate_up_proj for e in self.experts] + [e.down_proj for e in self.experts]
            return _GroupedSwiGLU.apply(received, counts, self.experts[0].act_fn, *weights)
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
    data-parallel ranks of this stage; or several groups in turn, e.g. also the rank
    pair holding dualpipe's two copies of each stage, whose routers must move alike),
    move the biases by ``speed`` against the imbalance, clear the counts. Returns
    {router name: summed load}."""
    found = routers(module)
    if not found:
        return {}
    loads = torch.cat([r.expert_load for _, r in found])
    groups = group if isinstance(group, (list, tuple)) else [group]
    for g in groups:
        if g is not None and torch.distributed.is_initialized():
            torch.distributed.all_reduce(loads, group=g)
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


def routed_experts(module):
    """The routed experts of ``module``'s MoE blocks (RecipeSpec.routed_experts)."""
    from recipes.step import RoutedExperts
    return [RoutedExperts(parameters=tuple(m.experts.parameters()), top_k=m.gate.top_k,
                          num_experts=m.gate.num_experts, ep_rank=m.ep_rank, num_local=m.num_local_experts)
            for m in module.modules() if isinstance(m, DeepSeekMoE)]


def step_update(engine, *, speed):
    """After an optimizer step: the routers' bias update (loads summed over the stage's
    replicas) and this rank's balance loss. Under dualpipe each stage's two copies (a
    rank pair) see half the micro-batches each: their loads are summed too, so both
    copies' biases move alike, and each layer's balance loss is the mean of its copies'."""
    data, pair = engine.replica_groups()
    loads = update_expert_biases(engine.module, speed=speed, group=[data, pair])
    balance = take_balance_loss(engine.module)
    if pair is not None and balance is not None:
        balance /= 2
    return loads, balance


def _balancing_setup(engine, *, section, grad_accum):
    node_of = getattr(engine, "node_of", None)
    if node_of is not None:
        check_node_limits(engine.module, node_of)
        use_node_hops(engine.module, node_of)
    configure_balancing(engine.module, alpha=section.moe.balance_loss_alpha, grad_scale=1.0 / grad_accum)


def use_node_hops(module, node_of):
    """Give every MoE layer whose expert-parallel group spans nodes of several ranks each
    its NodeHops (the rail and in-node groups the deduplicated dispatcher forwards
    through). Collective over all ranks: each contributes its layers' groups, and every
    rank makes every group's subgroups in the same order."""
    from deepspeed import comm as dist

    from .dispatch import make_node_hops
    layers = [m for m in module.modules() if isinstance(m, DeepSeekMoE) and m.ep_group is not None and m.ep_size > 1]
    mine = sorted({tuple(dist.get_all_ranks_from_group(m.ep_group)) for m in layers})
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    groups = sorted({g for ranks in everyone for g in ranks})
    hops = make_node_hops([list(g) for g in groups], node_of, new_group=dist.new_group)
    for layer in layers:
        ranks = tuple(dist.get_all_ranks_from_group(layer.ep_group))
        if ranks in hops and layer.dispatch.name == "deduplicated":
            layer.node_hops = hops[ranks][layer.ep_rank]
    if hops and dist.get_rank() == 0 and any(layer.node_hops is not None for layer in layers):
        h = next(iter(hops.values()))[0]
        print(f"moe dispatch: deduplicated, forwarded inside the node (an expert-parallel group on {h.nodes} nodes "
              f"x {h.per_node} ranks: a token crosses to each node once)", flush=True)


def check_node_limits(module, node_of):
    """Node-limited routing as a checked placement: every MoE layer's groups of experts
    lie inside one node of its expert-parallel group (recipes/layers/dispatch.py,
    check_node_limited), so a token reaches at most topk_group nodes."""
    from deepspeed import comm as dist
    for layer in (m for m in module.modules() if isinstance(m, DeepSeekMoE) and m.ep_group is not None):
        check_node_limited(layer.gate, group_nodes=[node_of[r] for r in dist.get_all_ranks_from_group(layer.ep_group)])


def _balancing_after_step(engine, *, section):
    from recipes.step import StepFigures
    loads, balance = step_update(engine, speed=section.moe.bias_update_speed)
    return StepFigures(expert_loads=loads, balance_loss=balance)


def balancing_hook():
    """DeepSeek-V3's auxiliary-loss-free balancing as a step hook: the routers' bias
    update after each step (``seekspeed.moe.bias_update_speed``) and the sequence-wise
    balance loss (``balance_loss_alpha``), for models with MoE layers."""
    from recipes.step import StepHook
    return StepHook(name="moe balancing", applies=lambda config: config.num_moe_layers() > 0,
                    setup=_balancing_setup, after_step=_balancing_after_step)

"""``seekspeed.grad_norm: "exact"``: the global gradient norm as a function of the
gradients alone, not of how the ranks hold them.

DeepSpeed's norm sums squares in floating point per tensor piece, per rank, then
across ranks, so its last bits follow the layout: with expert parallelism 2 a
rank sums whole experts, with degree 1 each rank sums its half of ZeRO's flat
partition, and the two norms can differ by an ulp. Gradient clipping multiplies every
weight update by ``clip / norm``, so that ulp reaches the weights.

Here every element's square is cut into fixed-point limbs below a power of two
shared by all ranks (2**E above the largest square), and the limbs are summed as
integers: each element's limbs depend only on the element and E, and integer sums
associate, so the total is the same for every partitioning, order and rank count.
Squares of fp32/bf16/fp16 values are exact in fp64 (at most 48 significant bits);
``LIMBS`` limbs of ``LIMB_BITS`` bits keep everything down to 2**(E - 96), so what
is dropped is under (elements) x 2**-94 of the squared norm: below 2**-50 of it for
any model under 2**44 elements, far under fp32's 2**-24. A limb above them (units of
2**E) takes the carries (normalised after every 2**22 elements), so no sum overflows
int64 below 2**63 elements. The integers are
summed with DeepSpeed's own groups (ZeRO: the data-parallel then the model-parallel
group; the BF16 optimizer: model-parallel, and each expert group's expert-parallel
group, each rank counting its share of the gradients its data-parallel group holds
alike), then turned into one fp64 value, its square root rounded to fp32.

Installed on DeepSpeed's ZeRO stage 1/2 optimizer (``scaled_global_norm``) and on its
BF16 optimizer (bf16 with fp32 accumulation), which takes the norm through
``get_grads_for_norm``; the rest of each optimizer's step (overflow check, clipping,
Muon's loss-scale rule) is DeepSpeed's.
"""

import torch
from deepspeed import comm as dist

from ds_ext.errors import ConfigError

LIMB_BITS = 24
LIMBS = 4            # fraction limbs; limb 0, above them, holds the carries
# elements per pass: a limb's chunk sum stays under 2**(24 + 22) < 2**53, exact in fp64
_CHUNK = 1 << 22
# memory traffic per gradient element (the planner's cost; each op a memory-bound pass):
# the max (abs 8, amax 4), to fp64 (4 + 8), the square (16), the power-of-two scaling (16),
# and per limb a scaling (16), a floor (16), a sum (8) and a subtraction (24)
BYTES_PER_ELEMENT = 12 + 12 + 16 + 16 + LIMBS * (16 + 16 + 8 + 24)


def _pieces(tensors):
    for t in tensors:
        flat = t.detach().reshape(-1)
        for start in range(0, flat.numel(), _CHUNK):
            yield flat[start:start + _CHUNK]


def max_abs(tensors, *, scale=1.0, device):
    """[largest |x| * scale (0 if any element is inf/NaN), 1 if one is]: fp64 on
    ``device``. Rounding is monotone, so the largest |x| scaled is the largest of the
    scaled elements."""
    top = torch.zeros((), dtype=torch.float64, device=device)
    for piece in _pieces(tensors):
        top = torch.maximum(top, piece.abs().amax().to(torch.float64))   # NaN propagates
    top = top * scale
    finite = torch.isfinite(top)
    return torch.stack([torch.where(finite, top, 0.0), (~finite).to(torch.float64)])


def exponent_above(largest):
    """E with every square of an element of magnitude <= ``largest`` below 2**E."""
    _, e = torch.frexp(torch.tensor(float(largest), dtype=torch.float64) ** 2)
    return int(e)


def square_limbs(tensors, *, exponent, scale=1.0, device):
    """The sum of squares of every element of ``tensors`` (each times ``scale``, all
    finite, all below 2**(exponent / 2)) as ``LIMBS + 1`` int64 limbs, limb k counting
    units of 2**(exponent - LIMB_BITS * k), normalised."""
    limbs = torch.zeros(LIMBS + 1, dtype=torch.int64, device=device)
    unit = 2.0 ** LIMB_BITS
    for piece in _pieces(tensors):
        x = piece.to(torch.float64)
        if scale != 1.0:
            x = x * scale
        # exact: the square of a <= 24-bit significand, then a power-of-two scaling
        frac = (x * x) * 2.0 ** -exponent
        for k in range(1, LIMBS + 1):
            frac = frac * unit
            whole = torch.floor(frac)
            limbs[k] += whole.sum().to(torch.int64)   # integers below 2**46: the fp64 sum is exact
            frac = frac - whole
        normalise(limbs)        # each piece adds under 2**46 to a limb below 2**24: no int64 overflow
    return limbs


def normalise(limbs):
    """Carries moved up so every fraction limb is below 2**LIMB_BITS (in place)."""
    mask = (1 << LIMB_BITS) - 1
    for k in range(LIMBS, 0, -1):
        limbs[k - 1] += limbs[k] >> LIMB_BITS
        limbs[k] &= mask
    return limbs


def limbs_value(limbs, exponent):
    """The limbs' total as a Python float (fp64), smallest limb first."""
    values = [int(v) for v in limbs.tolist()]
    total = 0.0
    for k in range(LIMBS, -1, -1):
        total += float(values[k]) * 2.0 ** (exponent - LIMB_BITS * k)
    return total


class ExactNorm:
    """One norm over parts ``(tensors, scale, groups)``: each part's elements summed
    over ``groups`` (the process groups that together hold each element once)."""

    def __init__(self, device):
        self.device = device

    def __call__(self, parts):
        """The L2 norm (Python float, rounded to fp32) of every part's elements, or
        ``inf`` when any element anywhere is inf or NaN."""
        # E from the largest element over every rank (one MAX over the world): a function
        # of the gradients alone, so every layout cuts the squares at the same place
        top = torch.zeros(2, dtype=torch.float64, device=self.device)
        for tensors, scale, _ in parts:
            top = torch.maximum(top, max_abs(tensors, scale=scale, device=self.device))
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(top, op=dist.ReduceOp.MAX)
        if float(top[1]) > 0:
            return float("inf")
        if float(top[0]) == 0.0:
            return 0.0
        exponent = exponent_above(float(top[0]))
        total = torch.zeros(LIMBS + 1, dtype=torch.int64, device=self.device)
        for tensors, scale, groups in parts:
            limbs = square_limbs(tensors, exponent=exponent, scale=scale, device=self.device)
            for group in groups:
                dist.all_reduce(limbs, op=dist.ReduceOp.SUM, group=group)
                normalise(limbs)
            total += limbs
        return float(torch.tensor(limbs_value(normalise(total), exponent), dtype=torch.float64).sqrt()
                     .to(torch.float32))


def _is_parallel(group):
    return group is not None and dist.get_world_size(group=group) > 1


def _zero_parts(opt):
    """DeepSpeed's ZeRO stage 1/2 norm as parts: every group's gradient partition (the
    pieces get_grad_norm_direct counts), summed over the data-parallel then the
    model-parallel group (expert groups too: their expert-data-parallel partitions
    over the whole data-parallel group hold each expert element once)."""
    from deepspeed.runtime.utils import is_model_parallel_parameter
    groups = [g for g in (opt.dp_process_group, opt.model_parallel_group) if _is_parallel(g)]
    parts = []
    for i in range(len(opt.bit16_groups)):
        scale = opt.loss_scale if opt._muon_update_lacks_loss_scale(i) else 1.0
        tensors = []
        grads = (g for g in opt.averaged_gradients[i] if not getattr(g, "_zero_padding", False))
        for g, p in zip(grads, opt.params_in_partition[i]):
            if getattr(p, "ds_pipe_replicated", False):
                continue
            if is_model_parallel_parameter(p) or opt.model_parallel_rank == 0:
                tensors.append(g)
        parts.append((tensors, scale, groups))
    return parts


def _install_zero(opt):
    norm = ExactNorm(opt.device)

    def scaled_global_norm(norm_type=2):
        assert norm_type == 2, "only L2 norm supported"
        value = norm(_zero_parts(opt))
        return torch.tensor(-1.0 if value == float("inf") else value, dtype=torch.float32, device=opt.device)

    opt.scaled_global_norm = scaled_global_norm


def share(tensors, *, index, count):
    """This member's share of ``tensors`` viewed as one flat run of elements: views of
    the ``index``-th of ``count`` near-equal slices. Tensors every member of a group
    holds alike are then counted once across the group, each element by one member."""
    total = sum(t.numel() for t in tensors)
    begin, end = total * index // count, total * (index + 1) // count
    out, offset = [], 0
    for t in tensors:
        lo, hi = max(begin, offset), min(end, offset + t.numel())
        if lo < hi:
            out.append(t.detach().reshape(-1)[lo - offset:hi - offset])
        offset += t.numel()
    return out


def _install_bf16(opt):
    """The BF16 optimizer's step takes the norm of what ``get_grads_for_norm`` returns
    (non-expert gradients summed over the model-parallel group, each expert group's
    also over its expert-parallel group). Here that call returns the exact norm as one
    element on the model-parallel group's first rank and zeros on the others, and no
    expert groups: DeepSpeed's sum of their squares is then that element's square plus
    zeros, and its square root gives the norm back, the same function of the exact
    value on every layout. The gradients are whole on every data-parallel rank (experts:
    on every rank of their expert-data-parallel group); each rank counts its share of
    them and the sum runs over that group too."""
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
    from deepspeed.utils import groups as ds_groups
    from deepspeed.utils.bwc import bwc_pipeline_parallel_group
    device = opt.fp32_groups_gradients_flat[0].device
    norm = ExactNorm(device)
    mp_group = opt.mpu.get_model_parallel_group() if opt.mpu is not None else None
    pipe_group = bwc_pipeline_parallel_group(opt.mpu)
    expert_names = sorted(ds_groups._get_expert_parallel_group_dict()) if opt.has_moe_layers else []

    def shared(tensors, group, *others):
        mine = share(tensors, index=dist.get_rank(group=group), count=dist.get_world_size(group=group))
        return mine, 1.0, [g for g in (group, *others) if _is_parallel(g)]

    def get_grads_for_norm(for_clipping=False):
        if for_clipping:
            return BF16_Optimizer.get_grads_for_norm(opt, for_clipping=True)
        non_expert, expert = BF16_Optimizer.get_grads_for_norm(opt)
        parts = [shared(non_expert, opt.dp_process_group, mp_group)]
        for name in expert_names:
            parts.append(shared(expert.get(name, []), ds_groups._get_expert_data_parallel_group(name), pipe_group,
                                ds_groups._get_expert_parallel_group(name)))
        value = norm(parts)
        first = mp_group is None or dist.get_rank(group=mp_group) == 0
        one = torch.tensor([value if first else 0.0], dtype=torch.float32, device=device)
        return [one], {}

    opt.get_grads_for_norm = get_grads_for_norm


def check_grad_norm(ds, section, *, zero):
    """Refuse, in one line, ``seekspeed.grad_norm: "exact"`` where DeepSpeed would not
    run one of the two optimizers it replaces the norm of."""
    if section.grad_norm != "exact":
        return
    bf16 = ds.get("bf16", {}).get("enabled", False)
    if zero not in (1, 2) and not (zero == 0 and bf16):
        raise ConfigError(f"seekspeed.grad_norm 'exact' with ZeRO stage {zero} and "
                          f"{'fp16' if ds.get('fp16', {}).get('enabled', False) else 'fp32'} weights: it replaces the "
                          f"norm of DeepSpeed's ZeRO stage 1/2 and BF16 optimizers; set zero_optimization.stage 1 "
                          f"(or bf16.enabled with stage 0), or grad_norm 'deepspeed'")
    offload = ds.get("zero_optimization", {}).get("offload_optimizer", {}).get("device", "none")
    if offload not in (None, "none"):
        raise ConfigError(f"seekspeed.grad_norm 'exact' with zero_optimization.offload_optimizer.device {offload!r}: "
                          f"the offloaded norm is DeepSpeed's own; remove offload_optimizer, or set grad_norm "
                          f"'deepspeed'")


def install(engine):
    """Replace the norm of ``engine``'s optimizer with the exact one; returns a line for the log."""
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
    opt = engine.optimizer
    if isinstance(opt, BF16_Optimizer):
        _install_bf16(opt)
        kind = "BF16 optimizer"
    elif isinstance(opt, DeepSpeedZeroOptimizer) and not opt.cpu_offload:
        _install_zero(opt)
        kind = "ZeRO optimizer"
    else:
        raise ConfigError(f"seekspeed.grad_norm 'exact' cannot replace the norm of {type(opt).__name__}: use ZeRO "
                          f"stage 1 or 2 without offload, or grad_norm 'deepspeed'")
    return (f"grad_norm: exact ({kind}: squares summed as integers below 2**E, the same norm for every layout, "
            f"{LIMBS} x {LIMB_BITS}-bit limbs)")

"""``seekspeed.grad_norm: "exact"`` (ds_ext/grad_norm.py): the limbs of a set of
tensors do not depend on how they are cut into pieces or ordered (what ranks and ZeRO
partitions do), the value is the true norm to within the dropped bits' bound, inf/NaN
give inf; and DeepSpeed's BF16 optimizer (bf16 with fp32 accumulation, a pipeline
with expert parallelism) takes it: the fp64 norm of what it counts, rounded to fp32. The ZeRO optimizer's path is tested bitwise across expert-parallel degrees in
tests/test_expert_parallel.py."""

import math
from fractions import Fraction

import numpy as np
import pytest
import torch

from ds_ext import grad_norm as gn
from tests.distributed import run_ranks


def _tensors(seed):
    """fp32 tensors whose squares span ~60 binades (and zeros): what a summation order shows."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for n, spread in ((1000, 1), (257, 20), (4096, 8), (31, 30)):
        mag = torch.exp2(torch.randint(-spread, spread + 1, (n,), generator=g).float())
        out.append(torch.randn(n, generator=g) * mag)
    out[1][::7] = 0.0
    return out


def _exact_square_sum(tensors):
    return sum((Fraction(float(v)) ** 2 for t in tensors for v in t.tolist()), Fraction(0))


def _cut(tensors, seed):
    """The same elements as random pieces in a random order (as ranks and ZeRO partitions hold them)."""
    rng = np.random.default_rng(seed)
    flat = torch.cat([t.reshape(-1) for t in tensors])
    cuts = np.sort(rng.choice(np.arange(1, flat.numel()), size=9, replace=False))
    pieces = list(torch.tensor_split(flat, torch.as_tensor(cuts)))
    return [pieces[i] for i in rng.permutation(len(pieces))]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_limbs_are_the_same_for_every_cut_and_order_and_the_value_is_the_norm(seed):
    tensors = _tensors(seed)
    top = max(float(t.abs().max()) for t in tensors)
    e = gn.exponent_above(top)
    whole = gn.square_limbs(tensors, exponent=e, device="cpu")
    for cut_seed in range(4):
        pieces = _cut(tensors, 100 * seed + cut_seed)
        # each piece summed on its own (one per "rank"), then the integers added
        summed = sum((gn.square_limbs([p], exponent=e, device="cpu") for p in pieces),
                     torch.zeros(gn.LIMBS + 1, dtype=torch.int64))
        assert torch.equal(gn.normalise(summed), whole)
        assert gn.ExactNorm("cpu")([(pieces, 1.0, [])]) == gn.ExactNorm("cpu")([(tensors, 1.0, [])])
    exact = _exact_square_sum(tensors)
    # dropped: under (elements) x 2**-94 of the squared norm (each element loses less than one unit of
    # the last limb, 2**(E - 96), and the squared norm is at least the largest square, above 2**(E - 2));
    # the fp64 conversion adds 4 roundings of 2**-53 each
    n = sum(t.numel() for t in tensors)
    bound = n * 2.0 ** -94 + 4 * 2.0 ** -53
    value = gn.limbs_value(whole, e)
    assert abs(Fraction(value) - exact) <= Fraction(bound) * exact
    # the norm, rounded to fp32 from fp64: the correctly rounded square root of the exact sum
    # (the fp64 value is within 2**-50 of it, so only a tie band of that width could differ)
    want = float(np.float32(math.sqrt(float(exact))))
    assert gn.ExactNorm("cpu")([(tensors, 1.0, [])]) == want


def test_loss_scale_non_finite_and_zero():
    tensors = _tensors(5)
    norm = gn.ExactNorm("cpu")
    # a power-of-two scale is exact: the norm of the scaled elements is scale x the norm
    assert norm([(tensors, 1024.0, [])]) == 1024.0 * norm([(tensors, 1.0, [])])
    assert norm([([torch.zeros(10)], 1.0, [])]) == 0.0
    for bad in (float("inf"), float("nan")):
        broken = [t.clone() for t in tensors]
        broken[2][17] = bad
        assert norm([(broken, 1.0, [])]) == float("inf")


def _bf16_rank():
    """tiny-moe under the BF16 optimizer with the exact norm; per step (the exact norm, the
    fp64 norm of the tensors DeepSpeed's BF16 optimizer counts: its own
    get_grads_for_norm, summed over the groups its get_global_norm_of_tensors uses)."""
    from deepspeed import comm as dist
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
    from deepspeed.utils import groups
    from deepspeed.utils.bwc import bwc_pipeline_parallel_group
    from tests.test_expert_parallel import _ep_rank
    seen, exact_norm = [], gn.ExactNorm.__call__

    def fp64_norm(opt):
        non_expert, expert = BF16_Optimizer.get_grads_for_norm(opt)
        total = torch.zeros(1, dtype=torch.float64)
        part = sum(((t.double() ** 2).sum() for t in non_expert), torch.zeros(1, dtype=torch.float64))
        dist.all_reduce(part, group=opt.mpu.get_model_parallel_group())
        total += part
        for name in sorted(groups._get_expert_parallel_group_dict()):
            part = sum(((t.double() ** 2).sum() for t in expert.get(name, [])), torch.zeros(1, dtype=torch.float64))
            dist.all_reduce(part, group=bwc_pipeline_parallel_group(opt.mpu))
            dist.all_reduce(part, group=groups._get_expert_parallel_group(name))
            total += part
        return float(total.sqrt())

    step = BF16_Optimizer.step

    def recording_step(opt, closure=None):
        ref = fp64_norm(opt)
        out = step(opt, closure)
        seen[-1] = (seen[-1], ref)
        return out

    def recording_norm(self, parts):
        seen.append(exact_norm(self, parts))
        return seen[-1]
    BF16_Optimizer.step, gn.ExactNorm.__call__ = recording_step, recording_norm
    norms = _ep_rank(2, "deepseek_v3", 1.0, "exact", True)["norms"]
    return {"logged": norms, "exact_and_fp64": seen}


@pytest.mark.multirank
def test_bf16_optimizer_takes_the_exact_norm():
    """tiny-moe, 2 stages x 2 replicas, expert parallelism 2, bf16 with fp32 accumulation
    (DeepSpeed's BF16 optimizer), clipping at 1.0, 4 steps: every rank gets the same exact
    norm; it is the fp64 norm of the gradients DeepSpeed's BF16 optimizer counts rounded to
    fp32 (the fp64 sum of ~5e5 squares is within 5e5 x 2**-53 = 6e-11 of exact, far under
    half an fp32 ulp, 2**-24 relative); and the norm DeepSpeed logs and clips with is that
    value passed through its square and square root (sqrt(fl32(x**2)) in fp64), the same
    function of the exact norm on every layout."""
    ranks = run_ranks(_bf16_rank, world_size=4, timeout=300)
    assert all(r == ranks[0] for r in ranks)
    assert len(ranks[0]["exact_and_fp64"]) == len(ranks[0]["logged"]) == 4
    for (exact, ref), logged in zip(ranks[0]["exact_and_fp64"], ranks[0]["logged"]):
        assert ref > 1.0                                    # clipping acts
        assert abs(exact - ref) <= 2.0 ** -24 * ref + 1e-10, (exact, ref)
        assert logged == math.sqrt(float(np.float32(exact) * np.float32(exact)))

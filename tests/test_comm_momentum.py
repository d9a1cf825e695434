"""``seekspeed.comm.target: "momentum"`` (1-bit Adam's scheme: Adam's variance frozen
after a dense warm-up, each rank's momentum sent compressed with error feedback).

- the reducer's momentum against a float64 reference of the dense momentum (fp32
  compressor; the bound derived below), and the same M on every rank (sign);
- inside DeepSpeed's pipeline engine, 2 data-parallel ranks: ZeRO 1 bf16 with fp32
  accumulation and MoE expert groups, and dualpipev-zb on 2 stages x 2 replicas (ZeRO 1 fp32):
  the variance bitwise frozen from the warm-up's last step, the replicas' weights
  bitwise equal (every rank applies the same averaged momentum), the loss near the
  dense run's; gradient clipping (DeepSpeed clips the momentum the step gets) and a
  non-finite gradient after the warm-up (the step changes nothing);
- the momentum made of clipped gradients, as DeepSpeed's AdamW makes it, under 1f1b and
  under DualPipe (whose ranks hold two stages' copies);
- the refusals: another optimizer, Adam's L2 decay, no warm-up.
About 40 s."""

import numpy as np
import pytest
import torch

from tests.distributed import run_ranks
from tests.numerics import assert_within, gamma
from tests.test_comm_engine import MOE, engine_and_batches


def _step_grads(step, rank, shrink=False):
    """The gradients the reducer tests give ``rank`` at ``step`` (fp32: a 64 x 48 matrix
    and a 300-vector); ``shrink``: the matrix scaled by (1 + step)^-1/2."""
    g = torch.Generator().manual_seed(100 * step + rank)
    matrix = torch.randn(64, 48, generator=g)
    return [matrix * (1 + step) ** -0.5 if shrink else matrix, torch.randn(300, generator=g)]


def _flat64(step, rank, shrink=False):
    """``_step_grads`` laid end to end in float64 (the references)."""
    return torch.cat([t.double().reshape(-1) for t in _step_grads(step, rank, shrink)])


def _momentum_reducer_rank(compressor, steps, warmup, nodes=0, clip=0.0, ahead=False, clip_norm="rms", coefs=False):
    """``nodes`` > 0: hierarchical over that many simulated nodes of consecutive ranks;
    ``clip`` > 0: the momentum made of gradients clipped to that norm; ``ahead``: its
    coefficient found before the exchange (GradientReducer.clip_ahead); ``clip_norm``:
    seekspeed.comm's; ``coefs``: return each step's clip coefficient instead."""
    import torch.distributed as tdist
    from ds_ext.comm.reducer import GradientReducer
    from ds_ext.config import CommSection
    from ds_ext.topology.groups import NodeGroups
    rank, world = tdist.get_rank(), tdist.get_world_size()
    node_of = [r * max(nodes, 1) // world for r in range(world)]
    groups = NodeGroups.for_subsets(node_of, [list(range(world))]) if nodes else None
    reducer = GradientReducer(CommSection(compressor=compressor, target="momentum", warmup_steps=warmup,
                                          min_numel=1000, hierarchical=bool(nodes), clip_norm=clip_norm),
                              node_groups=groups, node_of=node_of)
    reducer.beta1 = 0.9
    reducer.clip = clip
    out = []
    for step in range(steps):
        grads = _step_grads(step, rank)
        reducer.begin_step()
        if ahead:
            reducer.clip_ahead([(grads, dict(group=tdist.group.WORLD, divide_by=world))])
        reducer.reduce(grads, group=tdist.group.WORLD, divide_by=world, key="dense")
        reducer.end_step()
        out.append(reducer.last.clip_coef if coefs else [x.clone() for x in grads])
    return out


def _buckets(x, k, power):
    """Per bucket of a count sketch with ``k`` buckets (element p of the concatenation
    in bucket p mod k): the sum of |x_p|^power, float64."""
    v = x.abs().pow(power)
    return torch.nn.functional.pad(v, (0, -len(v) % k)).view(-1, k).sum(0)


def test_count_sketch_is_one_linear_map_with_an_unbiased_squared_norm():
    """seekspeed.comm.clip_norm "sketch" (ds_ext/comm/norm_sketch.py). The ranks'
    sketches are all-reduced, so the sketch must be one linear map for a given seed:
    S(a) + S(b) = S(a + b), the same on every call (bitwise), another at another seed.
    Evaluated in float64, each bucket is a sum of at most m = rows + tensors + 2 terms
    of the bucket's |x| (a matrix-vector product per tensor, the tail, the per-tensor
    adds), so it lies within gamma_m(float64) x that sum of the exact value; the fp32 and
    bf16 routes within gamma_m(fp32) (bf16 inputs are exact in fp32). Unbiased: over N
    seeds the mean of |S x|^2 is within 5 standard errors of |x|^2, the variance being
    the estimator's own, 2 sum_b (m_b^2 - sum_{p in b} x_p^4) (derived in the module):
    a fixed set of seeds, so the check is deterministic; a sign shared inside a bucket
    would bias the mean by 2 x_p x_q, far outside it."""
    from ds_ext.comm.norm_sketch import count_sketch
    k = 64
    g = torch.Generator().manual_seed(7)
    lengths = (5, 100, 1000, 37, 64)       # under k, a row and a tail, many rows, exactly one row
    a = [torch.randn(n, generator=g, dtype=torch.float64) for n in lengths]
    a[2][:50] *= 10                        # mass spread unevenly over the buckets
    b = [torch.randn(n, generator=g, dtype=torch.float64) for n in lengths]
    flat_a, flat_b = torch.cat(a), torch.cat(b)
    m = max(lengths) // k + len(lengths) + 2
    s_a, s_b = count_sketch(a, k, seed=3), count_sketch(b, k, seed=3)
    s_ab = count_sketch([x + y for x, y in zip(a, b)], k, seed=3)
    bound = gamma(m, np.float64) * (_buckets(flat_a, k, 1) + _buckets(flat_b, k, 1) + _buckets(flat_a + flat_b, k, 1))
    assert_within(s_a + s_b, s_ab.numpy(), bound.numpy(), what="S(a) + S(b) against S(a + b)")
    assert torch.equal(count_sketch(a, k, seed=3), s_a) and not torch.equal(count_sketch(a, k, seed=4), s_a)
    for dtype in (torch.float32, torch.bfloat16):
        low = [x.to(dtype) for x in a]
        exact = count_sketch([x.double() for x in low], k, seed=3)
        got = count_sketch(low, k, seed=3)
        assert got.dtype == torch.float32
        assert_within(got.double(), exact.numpy(), (gamma(m) * _buckets(torch.cat(low).double(), k, 1)).numpy(),
                      what=f"{dtype} against float64")
    n_seeds, true = 500, float(flat_a.pow(2).sum())
    est = torch.tensor([float(count_sketch(a, k, seed=s).pow(2).sum()) for s in range(n_seeds)], dtype=torch.float64)
    var = float(2 * (_buckets(flat_a, k, 2).pow(2) - _buckets(flat_a, k, 4)).sum())
    assert abs(float(est.mean()) - true) <= 5 * (var / n_seeds) ** 0.5, (float(est.mean()), true, var)


def test_tensor_sketches_are_a_count_sketch_per_tensor():
    """var_rescale "tensor": tensor_sketches lays one count sketch per tensor end to end,
    min(numel, buckets) entries each, so each segment's squared norm estimates its own
    tensor's. A tensor no longer than ``buckets`` is its own sketch up to a sign per
    element, so its segment's squared norm is exact (float64 here: a sum of n squares,
    within gamma_n of the direct sum). Linear, as the all-reduce needs: S(a) + S(b) =
    S(a + b) within gamma_m of the buckets' |.| sums (as for count_sketch above). Each
    tensor's own seed: over N seeds, each large tensor's estimate is unbiased within 5
    standard errors of the estimator's own variance (count_sketch's), a fixed set of
    seeds."""
    from ds_ext.comm.norm_sketch import segment_norms, tensor_sketches
    k = 32
    g = torch.Generator().manual_seed(11)
    lengths = (640, 300, 20)              # many rows, rows and a tail, under k
    a = [torch.randn(n, generator=g, dtype=torch.float64) for n in lengths]
    b = [torch.randn(n, generator=g, dtype=torch.float64) for n in lengths]
    s_a, sizes = tensor_sketches(a, k, seed=3)
    assert sizes == [32, 32, 20] and s_a.numel() == 84
    s_b, _ = tensor_sketches(b, k, seed=3)
    s_ab, _ = tensor_sketches([x + y for x, y in zip(a, b)], k, seed=3)
    bound = torch.cat([gamma(n // k + 3, np.float64) * (_buckets(x, min(n, k), 1) + _buckets(y, min(n, k), 1)
                                                         + _buckets(x + y, min(n, k), 1))
                       for n, x, y in zip(lengths, a, b)])
    assert_within(s_a + s_b, s_ab.numpy(), bound.numpy(), what="S(a) + S(b) against S(a + b)")
    norms = segment_norms(s_a, sizes)
    exact = float(a[2].pow(2).sum())
    assert abs(float(norms[2]) - exact) <= gamma(20, np.float64) * exact
    n_seeds = 300
    est = torch.stack([segment_norms(tensor_sketches(a, k, seed=s)[0], sizes) for s in range(n_seeds)])
    for i in (0, 1):
        true = float(a[i].pow(2).sum())
        var = float(2 * (_buckets(a[i], k, 2).pow(2) - _buckets(a[i], k, 4)).sum())
        assert abs(float(est[:, i].mean()) - true) <= 5 * (var / n_seeds) ** 0.5, (i, float(est[:, i].mean()), true)


def _clip_coefficients_rank(compressor, steps, warmup, clip):
    """Each step's clip coefficient, per (ahead, clip_norm): found before the exchange or
    mixed after it, from the root mean square or the sketch (one launch for the four)."""
    return {(ahead, norm): _momentum_reducer_rank(compressor, steps, warmup, 0, clip, ahead, norm, True)
            for ahead in (True, False) for norm in ("rms", "sketch")}


@pytest.mark.multirank
def test_sketched_clip_norm_is_the_averages_where_rms_clips_harder():
    """clip_norm "sketch" on 2 ranks, the fp32 path, the coefficient found ahead of the
    exchange and mixed after it, every momentum step clipping (clip
    30: the gradients' norms are near 58 a rank and 41 averaged). The coefficient the
    step took, c = clip / (norm + 1e-6), gives back the norm it used; its square is the
    sketch's estimate of the average's squared norm, whose relative standard deviation
    is sqrt(2 sum_b (m_b^2 - sum x^4)) / |x|^2 (about sqrt(2 / 1024) = 4.4 %), computed
    here from the float64 average: within 6 of them (a fixed draw: Chebyshev puts a
    6-sigma miss at under 3 %, and it either holds on every machine or on none, up to
    the fp32 sums' rounding, ~1e-6). "rms" (the default) uses the root mean square of
    the two ranks' norms, 40 % above the average's: its coefficient is DeepSpeed's
    formula on that norm."""
    steps, warmup, clip, k = 5, 2, 30.0, 1024
    per_rank = run_ranks(_clip_coefficients_rank, world_size=2, args=("fp32", steps, warmup, clip))
    assert per_rank[0] == per_rank[1]       # one scalar all-reduce: every rank's c alike
    for ahead in (True, False):
        _check_clip_coefficients(per_rank[0][(ahead, "sketch")], per_rank[0][(ahead, "rms")], steps, warmup, clip, k)


def _check_clip_coefficients(sketched, rms, steps, warmup, clip, k):
    for step in range(warmup, steps):
        grads = [_flat64(step, rank) for rank in range(2)]
        mean = (grads[0] + grads[1]) / 2
        true = float(mean.pow(2).sum())
        sigma = float(2 * (_buckets(mean, k, 2).pow(2) - _buckets(mean, k, 4)).sum()) ** 0.5 / true
        used = (clip / sketched[step] - 1e-6) ** 2
        assert abs(used / true - 1) <= 6 * sigma, (step, used, true, sigma)
        rms_norm = float((grads[0].pow(2).sum() + grads[1].pow(2).sum()) / 2) ** 0.5
        # its norm an fp32 sum of 3,372 squares a rank (two partial sums, the weight, the
        # 2-rank sum, the root): relative error under gamma_(n + 6), as above
        np.testing.assert_allclose(rms[step], clip / (rms_norm + 1e-6), rtol=gamma(3372 + 6))
        assert rms_norm > 1.3 * true ** 0.5


@pytest.mark.multirank
@pytest.mark.parametrize("clip, ahead", [(0.0, False), (30.0, False), (45.0, False), (45.0, True)])
def test_momentum_follows_the_dense_momentum_through_the_fp32_path(clip, ahead):
    """M_t = b1 M_{t-1} + (1 - b1) c_t mean_i g_i, kept through the warm-up (which
    returns the mean gradient) and returned after it. c_t = 1 without clipping; with
    it, min(1, clip / (norm + 1e-6)), the norm that of the mean gradient in the warm-up
    (as DeepSpeed clips it) and after it the root mean square of the ranks' own
    gradient norms (the gradients here have norms near 58 a rank and 41 averaged: clip
    30 clips every step, clip 45 only the momentum steps).

    Per element and step the fp32 path rounds at most 6 times without clipping (the
    local momentum's scale and add, the 2-rank sum, the mean's scale; the warm-up's
    update) and 10 with it (c M_t + (1 - c) b1 M_{t-1} after the exchange: two scales,
    an add, the coefficient's own rounding), each relative to A_t = b1 |M| + (1 - b1)
    sum_i |g_i| / n at most (c <= 1); an error carried from the last step shrinks by
    b1. c_t itself comes from an fp32 sum of n = 3372 squares per rank, two per-tensor
    partial sums, the weight, the 2-rank sum and a square root: relative error under
    gamma_(n + 6), which reaches M through (1 - b1) c_t |mean g|. So E_t = b1 E_{t-1} +
    gamma_k A_t + gamma_(n + 6) (1 - b1) c_t sum_i |g_i| / n, computed alongside the
    reference. ``ahead`` (c_t found before the exchange, each rank's momentum formed as
    b1 M + ((1 - b1) c_t) g_i) rounds fewer times than the mix after it: the same bound."""
    steps, warmup, b1 = 6, 2, 0.9
    results = run_ranks(_momentum_reducer_rank, world_size=2, args=("fp32", steps, warmup, 0, clip, ahead))
    grads = [[], []]
    for rank in range(2):
        for step in range(steps):
            grads[rank].append([t.double() for t in _step_grads(step, rank)])
    numel = sum(g.numel() for g in grads[0][0])
    coef = []
    for step in range(steps):
        if not clip:
            coef.append(1.0)
            continue
        if step < warmup:
            norm = sum(((grads[0][step][i] + grads[1][step][i]) / 2).pow(2).sum() for i in range(2)).sqrt()
        else:
            norm = (sum(g.pow(2).sum() for r in range(2) for g in grads[r][step]) / 2).sqrt()
        coef.append(min(1.0, clip / (float(norm) + 1e-6)))
    if clip:
        clipped = [c < 1 for c in coef]
        assert all(clipped) if clip == 30.0 else clipped == [False] * warmup + [True] * (steps - warmup), coef
    k = 10 if clip else 6
    for i in range(2):
        m = bound = 0.0
        for step in range(steps):
            c = coef[step]
            mean = (grads[0][step][i] + grads[1][step][i]) / 2
            absmean = (grads[0][step][i].abs() + grads[1][step][i].abs()) / 2
            a = b1 * abs(m) + (1 - b1) * absmean
            m = b1 * m + (1 - b1) * c * mean
            bound = b1 * bound + gamma(k) * a + (gamma(numel + 6) * (1 - b1) * c * absmean if clip else 0.0)
            for r in results:
                if step < warmup:      # the warm-up returns the averaged gradient: DeepSpeed's Adam steps
                    assert_within(r[step][i], mean.numpy(), (gamma(2) * absmean).numpy(), what=f"warm-up {step}")
                else:
                    assert_within(r[step][i], m.numpy(), bound.numpy(), what=f"tensor {i} step {step}")


@pytest.mark.multirank
@pytest.mark.parametrize("compressor, world, nodes", [("sign", 2, 0), ("int4", 2, 0), ("sign", 4, 2)])
def test_compressed_momentum_is_the_same_on_every_rank(compressor, world, nodes):
    """The two-phase exchange ends in an all-gather of the same encoded segments (and,
    hierarchical over 2 nodes x 2 ranks, a broadcast inside the node), so every rank
    decodes the same M (bitwise): the replicas stay in step."""
    results = run_ranks(_momentum_reducer_rank, world_size=world, args=(compressor, 5, 2, nodes))
    for step in range(5):
        for other in results[1:]:
            for a, b in zip(results[0][step], other[step]):
                np.testing.assert_array_equal(a, b)
                assert np.isfinite(a).all()


def _engine_run(comm, *, zero, precision, stages, steps, schedule, overrides, clip=1.0, poison_step=None,
                same_data=False):
    engine, it = engine_and_batches(comm, zero=zero, precision=precision, stages=stages, gas=2 * stages, steps=steps,
                                    schedule=schedule, overrides=overrides, clip=clip, poison_step=poison_step,
                                    weight_decay=0.1, same_data=same_data)
    from ds_ext.comm.install import _inner_optimizer
    inner = _inner_optimizer(engine)

    def variance():
        return [inner.state[p]["exp_avg_sq"].clone() for grp in inner.param_groups for p in grp["params"]
                if p in inner.state]

    def weights():
        return {k: v.detach().float().clone() for k, v in engine.module.state_dict().items()}

    def momentum():
        return [inner.state[p]["exp_avg"].clone() for grp in inner.param_groups for p in grp["params"]
                if p in inner.state]

    losses, variances, states, momenta, coefs = [], [], [], [], []
    for _ in range(steps):
        losses.append(engine.train_batch(it).item())
        variances.append(variance())
        states.append(weights())
        momenta.append(momentum())
        reducer = getattr(engine, "grad_reducer", None)
        coefs.append(reducer.last.clip_coef if reducer is not None else None)
    momentum_norm = float(torch.cat([inner.state[p]["exp_avg"].reshape(-1) for grp in inner.param_groups
                                     for p in grp["params"] if p in inner.state]).norm())
    frozen = getattr(engine, "frozen_variance", None)
    reducer = getattr(engine, "grad_reducer", None)
    factors = getattr(reducer, "tensor_factors", None)
    return {"tensor_factors": None if factors is None else factors.tolist(),
            "tensor_slots": len(getattr(reducer, "tensor_slots", ())),"losses": losses, "variances": variances, "states": states, "momentum_norm": momentum_norm,
            "momenta": momenta, "clip_coefs": coefs, "numel": sum(p.numel() for p in engine.module.parameters()),
            "frozen_skipped": frozen.skipped_steps if frozen else 0, "ds_skipped": engine.skipped_steps,
            "stage": engine.stage_id if hasattr(engine, "stage_id") else 0}


def _pair(comm, kw):
    return {"ds": _engine_run(None, **kw), "ours": _engine_run(comm, **kw)}


SIGN = {"compressor": "sign", "target": "momentum", "warmup_steps": 2, "min_numel": 256}
# (world, engine settings, seekspeed.comm beyond SIGN): the MoE case clips by the sketched
# norm (clip_norm "sketch": a sketch per reduce call, the experts' group's too) and scales
# the frozen variance per tensor (var_rescale "tensor": BF16_Optimizer's flat partitions
# hold the reduced tensors), the DualPipe case by the ranks' root mean square
ENGINE_CASES = {
    "zero1-bf16-fp32-accum-moe": (2, dict(zero=1, precision="bf16-fp32-accum", stages=1, schedule="1f1b",
                                          overrides=MOE), {"clip_norm": "sketch", "var_rescale": "tensor"}),
    "dualpipev-zb-2x2": (4, dict(zero=1, precision="fp32", stages=2, schedule="dualpipev-zb", overrides={}), {}),
}


@pytest.mark.multirank
@pytest.mark.parametrize("case", sorted(ENGINE_CASES))
def test_momentum_mode_in_the_engine(case):
    world, kw, comm = ENGINE_CASES[case]
    steps, warmup = 5, SIGN["warmup_steps"]
    results = run_ranks(_pair, world_size=world, args=(SIGN | comm, dict(kw, steps=steps)), timeout=300)
    for r in results:
        ours, ds = r["ours"], r["ds"]
        # the warm-up is DeepSpeed's own training: bitwise in fp32 (losses come before each
        # step); under bf16 DeepSpeed's ZeRO 1 reduces in another precision than seekspeed's
        # fp32 path, so there only the first loss, before any reduction
        same = warmup + 1 if kw["precision"] == "fp32" else 1
        assert ours["losses"][:same] == ds["losses"][:same]
        # the variance as the warm-up's last dense step left it, bitwise, on every later step
        for later in ours["variances"][warmup:]:
            for a, b in zip(later, ours["variances"][warmup - 1]):
                np.testing.assert_array_equal(a, b)
        assert any(not np.array_equal(a, b) for a, b in zip(ds["variances"][-1], ds["variances"][warmup - 1]))
        # lossy, so not equal: the same training, within 5 % (a behavioural check; the
        # convergence benchmark measures it over 300 steps)
        np.testing.assert_allclose(ours["losses"], ds["losses"], rtol=0.05)
        # the clip bites on every momentum step (the tiny runs' norms are several times 1.0),
        # so the step's norm, sketched or not, decided each of them
        assert all(c < 1 for c in ours["clip_coefs"][warmup:]), ours["clip_coefs"]
        if comm.get("var_rescale") == "tensor":     # a factor per reduced tensor, the experts' too, not all one
            factors = ours["tensor_factors"]
            assert len(factors) == ours["tensor_slots"] > 2 and len(set(factors)) > 2, factors
    # replicas of a stage hold the same weights, bitwise, after every step
    by_stage = {}
    for r in results:
        by_stage.setdefault(r["ours"]["stage"], []).append(r["ours"]["states"])
    for replicas in by_stage.values():
        assert len(replicas) == 2
        for step_a, step_b in zip(*replicas):
            for name in step_a:
                np.testing.assert_array_equal(step_a[name], step_b[name], err_msg=name)


def test_zero_one_adam_refresh_steps_follow_its_rule():
    """0/1 Adam's variance schedule (DeepSpeed's ZeroOneAdam): a refresh at every multiple
    of the interval, which starts at 1 and doubles after every kappa refreshes; none
    after var_freeze_step. With kappa 4: 1-4, then every 2nd to 12, every 4th to 28, every
    8th to 56; kappa 1: the powers of two."""
    from ds_ext.comm.reducer import is_refresh_step
    def steps(kappa, until, last=64):
        return [s for s in range(1, last + 1) if is_refresh_step(s, kappa=kappa, until=until)]
    assert steps(4, 1000) == [1, 2, 3, 4, 6, 8, 10, 12, 16, 20, 24, 28, 32, 40, 48, 56, 64]
    assert steps(4, 30) == [1, 2, 3, 4, 6, 8, 10, 12, 16, 20, 24, 28]
    assert steps(1, 1000) == [1, 2, 4, 8, 16, 32, 64]
    # var_update_max_interval: the interval stops doubling at the cap (every 16th step after 16)
    assert [s for s in range(1, 101) if is_refresh_step(s, kappa=1, until=1000, cap=16)] == \
        [1, 2, 4, 8, 16, 32, 48, 64, 80, 96]


def _refresh_rank(steps):
    """Each step's averaged gradients (or, on momentum steps, None) and wire bytes, from a
    sign momentum reducer whose refreshes go through int4 (refresh_compressor), beside an
    int4 gradient reducer without error feedback on the same gradients, and the sign
    reducer's M after each step."""
    import torch.distributed as tdist
    from ds_ext.comm.reducer import GradientReducer
    from ds_ext.config import CommSection
    rank, world = tdist.get_rank(), tdist.get_world_size()
    ours = GradientReducer(CommSection(compressor="sign", target="momentum", warmup_steps=1, var_update_scaler=1,
                                       refresh_compressor="int4", min_numel=1000), node_of=[0] * world)
    ref = GradientReducer(CommSection(compressor="int4", error_feedback=False, min_numel=1000), node_of=[0] * world)
    ours.beta1 = 0.9
    out = []
    for step in range(steps):
        grads, twin = _step_grads(step, rank), _step_grads(step, rank)
        for reducer, g in ((ours, grads), (ref, twin)):
            reducer.begin_step()
            reducer.reduce(g, group=tdist.group.WORLD, divide_by=world, key="dense")
            reducer.end_step()
        sent = ours.sent_momentum
        out.append({"sent": sent, "ours": None if sent else [g.clone() for g in grads], "int4": twin,
                    "bytes": ours.last.wire_bytes, "int4_bytes": ref.last.wire_bytes,
                    "m": ours.momentum_tensor(("dense", "compressed")).clone()})
    return out


@pytest.mark.multirank
def test_refreshes_cross_the_wire_through_refresh_compressor():
    """refresh_compressor "int4": 0/1 Adam's refreshes after the warm-up (kappa 1: steps 2
    and 4 here) average the gradients as int4's two-phase exchange without error feedback
    does, bitwise (the same exchange as a gradient reducer of int4), for int4's bytes; the
    warm-up (step 1) stays fp32 (more bytes than int4's); the refresh's average enters M
    as a dense step's does, M <- b1 M + (1 - b1) G (one multiply-add an entry: gamma_2
    of its terms against float64)."""
    steps = 4
    got = run_ranks(_refresh_rank, world_size=2, args=(steps,))
    for r in got:
        assert [s["sent"] for s in r] == [False, False, True, False]
        for step in (1, 3):
            for a, b in zip(r[step]["ours"], r[step]["int4"]):
                np.testing.assert_array_equal(a, b, err_msg=f"step {step + 1}")
            assert r[step]["bytes"] == r[step]["int4_bytes"]
        assert r[0]["bytes"] > 4 * r[1]["bytes"]        # the warm-up: fp32
        m1, g2 = (np.asarray(x, dtype=np.float64).reshape(-1) for x in (r[0]["m"], r[1]["ours"][0]))
        want = 0.9 * m1 + 0.1 * g2
        assert_within(np.asarray(r[1]["m"], dtype=np.float64), want, gamma(2) * (0.9 * np.abs(m1) + 0.1 * np.abs(g2)),
                      what="M after refresh")


ZERO_ONE = {"compressor": "sign", "target": "momentum", "warmup_steps": 0, "var_update_scaler": 1, "min_numel": 256}


def _zero_one_run(kw, comm=ZERO_ONE):
    return _engine_run(comm, **kw)


@pytest.mark.multirank
def test_zero_one_adam_refreshes_the_variance_on_its_schedule():
    """ZeRO 1 fp32, 2 replicas, no warm-up, kappa 1 (refreshes at steps 1, 2, 4 of 6): the
    variance changes on exactly those steps (the first two DeepSpeed's own Adam steps,
    step 4 FrozenVarianceAdam's refresh with the momentum's step count) and is bitwise
    frozen on the others; the replicas stay bitwise equal; the losses stay within 5 % of
    DeepSpeed's dense run (a behavioural check; the benchmark measures convergence)."""
    kw = dict(zero=1, precision="fp32", stages=1, steps=6, schedule="1f1b", overrides={})
    results = run_ranks(_zero_one_run, world_size=2, args=(kw,), timeout=240)
    dense = run_ranks(_zero_one_run, world_size=2, args=(kw, None), timeout=240)[0]
    for r in results:
        v = r["variances"]
        changed = [step + 1 for step in range(1, 6)
                   if any(not np.array_equal(a, b) for a, b in zip(v[step], v[step - 1]))]
        assert changed == [2, 4], changed
        np.testing.assert_allclose(r["losses"], dense["losses"], rtol=0.05)
        assert all(np.isfinite(r["losses"]))
    for name, want in results[0]["states"][-1].items():
        np.testing.assert_array_equal(results[1]["states"][-1][name], want, err_msg=name)


def _same_data_pair(comm, kw):
    return {"ds": _engine_run(None, same_data=True, **kw), "ours": _engine_run(comm, same_data=True, **kw)}


CLIP_CASES = {
    # (world, layout, the largest clip coefficient expected: the clip far under the norm)
    "1f1b": (2, dict(stages=1, schedule="1f1b"), 1e-3),
    # each rank holds two stages' copies whose gradients are summed: the squared norms
    # the world adds count every element twice (the reducer's ``copies``)
    "dualpipe-2x2": (4, dict(stages=2, schedule="dualpipe"), 2e-3),
}


@pytest.mark.multirank
@pytest.mark.parametrize("case", sorted(CLIP_CASES))
def test_momentum_is_made_of_clipped_gradients_as_adams(case):
    """ZeRO 1 fp32, 2 replicas given the same data, a clip far under the gradients' norm
    (every step's coefficient about 1e-3), the momentum sent uncompressed. The
    replicas' gradients are equal, so the root mean square of their norms is the
    average's norm, and the first momentum step's M (the step after a 2-step warm-up, from
    the same weights as DeepSpeed's run) is DeepSpeed's AdamW momentum, made of clipped
    gradients, up to rounding: per element, each step's b1 m + (1 - b1) c g rounds a few
    times on each side (gamma_10 of A = b1 |m| + (1 - b1) |c g|, both sides), and each
    side's clip coefficient comes from a sum of n squares (n the model's elements:
    relative error under gamma_(n + 6), reaching m through (1 - b1) c |g|); errors carried
    shrink by b1. A momentum of unclipped gradients, or a norm on another scale than the
    optimizer's (ZeRO 1 divides the sum after the reduction), is off by far more."""
    comm = {"compressor": "fp32", "target": "momentum", "warmup_steps": 2, "min_numel": 256}
    world, layout, largest = CLIP_CASES[case]
    kw = dict(zero=1, precision="fp32", steps=3, overrides={}, clip=2e-3, **layout)
    b1 = 0.9
    for r in run_ranks(_same_data_pair, world_size=world, args=(comm, kw), timeout=300):
        ours, ds = r["ours"], r["ds"]
        assert ours["losses"] == ds["losses"]       # the warm-up is DeepSpeed's own; step 3's loss comes before it
        assert all(c < largest for c in ours["clip_coefs"]), ours["clip_coefs"]
        n = ours["numel"]
        for got, m1, m2, want in zip(ours["momenta"][2], *(ds["momenta"][step] for step in range(3))):
            seq = [np.asarray(x, dtype=np.float64) for x in (m1, m2, want)]
            bound, prev = 0.0, 0.0
            for m in seq:
                cg = np.abs(m - b1 * prev) / (1 - b1)      # |c g| of that step, from DeepSpeed's momenta
                a = b1 * np.abs(prev) + (1 - b1) * cg
                bound = b1 * bound + 2 * (gamma(10) * a + gamma(n + 6) * (1 - b1) * cg)
                prev = m
            assert_within(np.asarray(got, dtype=np.float64), seq[-1], bound, what="first momentum step's M")


def _clipped_and_poisoned(kw):
    return _engine_run(SIGN, clip=1e-3, poison_step=3, **kw)


@pytest.mark.multirank
def test_clipping_and_a_non_finite_step_under_momentum():
    """ZeRO 0 fp32, clip 1e-3, an inf in rank 1's gradient at step 4 (after the 2-step
    warm-up). DeepSpeed clips what reaches the optimizer, the averaged momentum: its norm
    (exp_avg holds it as the step used it) is at most the clip, up to rounding. The inf
    makes every rank's momentum non-finite: FrozenVarianceAdam skips the step on every
    rank (weights as they were) and the next step trains on, finite; the variance stays
    frozen and the replicas equal throughout."""
    kw = dict(zero=0, precision="fp32", stages=1, steps=5, schedule="1f1b", overrides={})
    results = run_ranks(_clipped_and_poisoned, world_size=2, args=(kw,), timeout=240)
    for r in results:
        assert r["momentum_norm"] <= 1e-3 * (1 + 1e-5), r["momentum_norm"]
        assert r["frozen_skipped"] == 1
        before, at, after = r["states"][2], r["states"][3], r["states"][4]
        for name in before:
            np.testing.assert_array_equal(at[name], before[name], err_msg=name)
            assert np.isfinite(after[name]).all()
        assert any(not np.array_equal(after[n], at[n]) for n in at)
        for later in r["variances"][2:]:
            for a, b in zip(later, r["variances"][1]):
                np.testing.assert_array_equal(a, b)
    for name, want in results[0]["states"][-1].items():
        np.testing.assert_array_equal(results[1]["states"][-1][name], want, err_msg=name)


# -- refusals ----------------------------------------------------------------------------

def test_momentum_target_refuses_other_optimizers_in_one_line():
    from ds_ext.comm.install import check_momentum_optimizer
    from ds_ext.config import CommSection, check_momentum_target
    from ds_ext.errors import ConfigError
    comm = CommSection(compressor="sign", target="momentum", warmup_steps=10)
    with pytest.raises(ConfigError, match=r"optimizer is SGD: set optimizer.type to AdamW") as info:
        check_momentum_target({"optimizer": {"type": "SGD", "params": {"lr": 0.1}}}, comm)
    assert "\n" not in str(info.value)
    with pytest.raises(ConfigError, match=r"L2 weight decay"):
        check_momentum_target({"optimizer": {"type": "Adam", "params": {"weight_decay": 0.1, "adam_w_mode": False}}},
                              comm)
    check_momentum_target({"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}, comm)
    w = torch.nn.Parameter(torch.zeros(2))
    with pytest.raises(ConfigError, match=r"the optimizer is SGD"):
        check_momentum_optimizer(torch.optim.SGD([w], lr=0.1))
    with pytest.raises(ConfigError, match=r"Adam's L2 weight decay"):
        check_momentum_optimizer(torch.optim.Adam([w], weight_decay=0.1))
    assert check_momentum_optimizer(torch.optim.AdamW([w], betas=(0.8, 0.95))) == 0.8


@pytest.mark.parametrize("raw, match", [
    ({"compressor": "sign", "target": "momentum", "warmup_steps": 0}, r"set warmup_steps >= 1"),
    ({"compressor": "none", "target": "momentum", "warmup_steps": 5}, r"needs a compressor"),
    ({"compressor": "topk", "target": "momentum", "warmup_steps": 5, "momentum": 0.9}, r"set momentum 0"),
    ({"compressor": "sign", "block_size": 100}, r"multiple of 8"),
    ({"target": "moment"}, r"target 'moment' is not one of"),
    ({"compressor": "sign", "var_update_scaler": 16}, r"var_update_scaler refreshes Adam's frozen variance, which only "
                                                      r"target 'momentum' freezes"),
    ({"compressor": "sign", "target": "momentum", "var_update_scaler": 0}, r"var_update_scaler 0: .* must be >= 1"),
    ({"compressor": "sign", "target": "momentum", "var_update_scaler": 1, "var_update_max_interval": 0},
     r"var_update_max_interval 0: .* >= 1"),
    ({"compressor": "sign", "target": "momentum", "var_update_scaler": 1, "refresh_compressor": "sign"},
     r"refresh_compressor 'sign' is not one of \['fp32', 'bf16', 'int8', 'int4'\]"),
    ({"compressor": "sign", "target": "momentum", "warmup_steps": 5, "refresh_compressor": "int4"},
     r"refresh_compressor compresses .* set var_update_scaler or remove refresh_compressor"),
    ({"compressor": "sign", "target": "momentum", "var_update_scaler": 1, "var_refresh_decay": "steps"},
     r"var_refresh_decay 'steps' is not one of \['refresh', 'elapsed'\]"),
    ({"compressor": "sign", "target": "momentum", "warmup_steps": 5, "var_refresh_decay": "elapsed"},
     r"var_refresh_decay decays .* set var_update_scaler or remove var_refresh_decay"),
    ({"compressor": "sign", "target": "momentum", "warmup_steps": 5, "var_update_max_interval": 64},
     r"var_update_max_interval caps .* set var_update_scaler or remove var_update_max_interval"),
    ({"compressor": "sign", "target": "momentum", "var_update_scaler": 4, "var_freeze_step": 0},
     r"var_freeze_step 0: .* must be >= 1"),
    ({"compressor": "sign", "target": "momentum", "warmup_steps": 5, "clip_norm": "exact"},
     r"clip_norm 'exact' is not one of \['rms', 'sketch'\]"),
    ({"compressor": "sign", "clip_norm": "sketch"}, r"clip_norm 'sketch' .* remove clip_norm or set target 'momentum'"),
    ({"compressor": "sign", "target": "momentum", "warmup_steps": 5, "clip_norm": "sketch", "clip_sketch_buckets": 8},
     r"clip_sketch_buckets 8: .* use 1024"),
    ({"compressor": "sign", "var_rescale": True}, r"var_rescale rescales the variance .* remove var_rescale"),
    ({"compressor": "sign", "target": "momentum", "warmup_steps": 5, "var_rescale": True},
     r"var_rescale .* clip_norm 'rms' .* set clip_norm 'sketch'"),
    ({"compressor": "sign", "target": "momentum", "warmup_steps": 5, "var_rescale": "total"},
     r"var_rescale: expected bool \| 'tensor', got 'total'"),
    ({"compressor": "sign", "target": "momentum", "warmup_steps": 5, "clip_norm": "sketch", "var_rescale": "tensor",
      "var_rescale_buckets": 4}, r"var_rescale_buckets 4: .* use 32"),
])
def test_bad_momentum_settings_are_one_line_errors(raw, match):
    from ds_ext.config import SeekspeedSection
    from ds_ext.errors import ConfigError
    from ds_ext.schema import from_dict
    with pytest.raises(ConfigError, match=match) as info:
        from_dict(SeekspeedSection, {"train": {"steps": 1}, "comm": raw}, where="seekspeed")
    assert "\n" not in str(info.value)


def _level_rank(steps, warmup, clip):
    """Each step's (sent momentum, variance_scale, scale_before) under var_rescale true,
    the fp32 path, the root-mean-square norm, 0/1 Adam's kappa 1 (dense steps 1, 2, 4 and
    the warm-up); and, in the same launch, each step's tensor_factors under var_rescale
    "tensor" (the sketched norm, no clip, buckets beyond the tensors' sizes)."""
    import torch.distributed as tdist
    from ds_ext.comm.reducer import GradientReducer
    from ds_ext.config import CommSection
    rank, world = tdist.get_rank(), tdist.get_world_size()
    out = {}
    for mode, c, extra in ((True, clip, {}), ("tensor", 0.0, {"clip_norm": "sketch", "var_rescale_buckets": 4096})):
        reducer = GradientReducer(CommSection(compressor="fp32", target="momentum", warmup_steps=warmup,
                                              var_update_scaler=1, min_numel=1000, var_rescale=mode, **extra),
                                  node_of=[0] * world)
        reducer.beta1, reducer.beta2, reducer.clip = 0.9, 0.95, c
        out[mode] = []
        for step in range(steps):
            grads = _step_grads(step, rank, shrink=True)
            reducer.begin_step()
            reducer.clip_ahead([(grads, dict(group=tdist.group.WORLD, divide_by=world))])
            reducer.reduce(grads, group=tdist.group.WORLD, divide_by=world, key="dense")
            reducer.end_step()
            out[mode].append((reducer.sent_momentum, reducer.variance_scale, reducer.scale_before)
                             if mode is True else reducer.tensor_factors.tolist())
    return out


@pytest.mark.multirank
def test_var_rescale_tracks_dense_adams_summed_variance():
    """var_rescale: the sum over elements of dense Adam's v is a beta2 moving average of
    c^2 |G|^2; the reducer tracks it from each step's norm (exact on dense steps, the
    ranks' root mean square on momentum steps, the clip's), bias-corrected as Adam does.
    A dense step becomes the reference; a momentum step's variance_scale is the level
    now over the reference; scale_before (what a refresh multiplies the frozen v by) the
    level before the step's gradient over it. The arithmetic is checked with the root
    mean square (exactly computable here; the config accepts var_rescale only with the
    sketched norm, the root mean square being biased by the ranks' noise). Against a float64 reference from the same
    gradients: every x_t = c_t^2 |.|^2 carries the relative error of an fp32 sum of
    n = 3372 squares and a few scalings (gamma_(n + 6), as in the momentum test above);
    a moving average of positive terms keeps that relative bound, and a ratio of two
    adds them: 2 gamma_(n + 6)."""
    steps, warmup, clip, b2 = 8, 1, 30.0, 0.95
    both = run_ranks(_level_rank, world_size=2, args=(steps, warmup, clip))
    assert both[0] == both[1]
    got = [both[0][True]]
    level, count, ref, want = 0.0, 0, 0.0, []
    for step in range(steps):
        grads = [_flat64(step, rank, shrink=True) for rank in range(2)]
        sent = got[0][step][0]
        squared = float(((grads[0] + grads[1]) / 2).pow(2).sum()) if not sent else \
            float((grads[0].pow(2).sum() + grads[1].pow(2).sum()) / 2)
        c = min(1.0, clip / (squared ** 0.5 + 1e-6))
        before = level / (1 - b2 ** count) if count else 0.0
        level, count = b2 * level + (1 - b2) * c * c * squared, count + 1
        now = level / (1 - b2 ** count)
        want.append((sent, now / ref if sent else 1.0, before / ref if ref and before else 1.0))
        if not sent:
            ref = now
    assert [w[0] for w in want] == [False, False, True, False, True, True, True, False]   # dense 1, 2, 4, 8
    bound = 2 * gamma(3372 + 6)
    for step, ((_, scale, before), (_, w_scale, w_before)) in enumerate(zip(got[0], want)):
        np.testing.assert_allclose([scale, before], [w_scale, w_before], rtol=bound, err_msg=f"step {step + 1}")
    assert all(abs(s - 1) > 1e-3 for sent, s, _ in got[0] if sent)      # the factor is not a no-op here
    # var_rescale "tensor": the same arithmetic per tensor (the 64 x 48 matrix, the
    # 300-vector), each from its own squared norm: exact here on every step, the buckets
    # (4096) being more than the elements (the sketch of a short tensor is the tensor up to
    # signs; the sketch's statistics are test_tensor_sketches_...'s), no clip (c = 1). The
    # sums are n = 3072 and 300 squares: 2 gamma_(3072 + 6) bounds both.
    level, count, ref = torch.zeros(2, dtype=torch.float64), 0, torch.zeros(2, dtype=torch.float64)
    for step, (sent, factors) in enumerate(zip([w[0] for w in want], both[0]["tensor"])):
        mean = [(a.double() + b.double()) / 2 for a, b in zip(_step_grads(step, 0, True), _step_grads(step, 1, True))]
        x = torch.tensor([float(t.pow(2).sum()) for t in mean], dtype=torch.float64)
        before = level / (1 - b2 ** count) if count else torch.zeros(2, dtype=torch.float64)
        level, count = b2 * level + (1 - b2) * x, count + 1
        now = level / (1 - b2 ** count)
        expect = now / ref if sent else (before / ref if count > 1 else torch.ones(2, dtype=torch.float64))
        if not sent:
            ref = now
        np.testing.assert_allclose(factors, expect.numpy(), rtol=bound, err_msg=f"tensor factors, step {step + 1}")
        if sent:       # the two tensors' factors differ: one factor could not follow both
            assert abs(factors[0] / factors[1] - 1) > 1e-2, factors


def test_frozen_variance_adam_takes_each_tensors_factor():
    """var_rescale "tensor": FrozenVarianceAdam scales each element's denominator by the
    square root of the factor of the reduced tensor it lies in (and a refresh's v by the
    factor), found by the gradient's storage: separate parameters each take their own; a
    flat parameter whose gradient holds several reduced tensors end to end (DeepSpeed's
    BF16_Optimizer) takes each tensor's on its elements, padding none; a parameter whose
    gradient is none of them is refused in one line. The step's roundings as in the test
    below: gamma_8 of each term."""
    from ds_ext.comm.install import FrozenVarianceAdam
    from ds_ext.comm.reducer import GradientReducer
    from ds_ext.config import CommSection
    g = torch.Generator().manual_seed(9)
    flat = torch.nn.Parameter(torch.randn(1280, generator=g))       # two tensors of 1200 and 77, 3 of padding
    alone = torch.nn.Parameter(torch.randn(50, generator=g))
    opt = torch.optim.AdamW([flat, alone], lr=0.01, betas=(0.9, 0.95), weight_decay=0.0)
    for _ in range(2):
        flat.grad, alone.grad = torch.randn(1280, generator=g), torch.randn(50, generator=g)
        opt.step()
    reducer = GradientReducer(CommSection(compressor="fp32", target="momentum", warmup_steps=1, var_rescale="tensor",
                                          clip_norm="sketch"), node_of=[0])
    frozen = FrozenVarianceAdam(opt, reducer)
    flat.grad, alone.grad = torch.randn(1280, generator=g) * 0.1, torch.randn(50, generator=g) * 0.1
    views = [flat.grad[:1200].view(40, 30), flat.grad[1200:1277], alone.grad]
    reducer.tensor_slots = [(t.untyped_storage().data_ptr(), t.storage_offset(), t.numel(), 4) for t in views]
    reducer.tensor_factors = torch.tensor([0.25, 4.0, 9.0], dtype=torch.float64)
    reducer.steps, reducer.sent_momentum, reducer.refreshed = 3, True, False
    before = [(p.detach().double().clone(), opt.state[p]["exp_avg_sq"].double().clone()) for p in (flat, alone)]
    frozen.step()
    scale = [torch.cat([torch.full((1200,), 0.25), torch.full((77,), 4.0), torch.ones(3)]).double(),
             torch.full((50,), 9.0).double()]
    lr, b1, b2, eps = 0.01, 0.9, 0.95, 1e-8
    bc1, bc2 = 1 - b1 ** 3, (1 - b2 ** 2) ** 0.5
    for p, (w, v), f in zip((flat, alone), before, scale):
        m = p.grad.double() / bc1
        denom = torch.maximum((f * v).sqrt() / bc2 + eps, m.abs())
        want = w - lr * m / denom
        assert_within(p.detach().double(), want.numpy(), (gamma(8) * (w.abs() + 2 * lr * (m / denom).abs())).numpy(),
                      what="per-tensor factors")
    # a refresh: v <- b2 f v + (1 - b2) g^2 on each tensor's elements
    reducer.sent_momentum, reducer.refreshed, reducer.steps = False, True, 4
    v_before = [opt.state[p]["exp_avg_sq"].double().clone() for p in (flat, alone)]
    frozen.step()
    for p, v, f in zip((flat, alone), v_before, scale):
        want = b2 * f * v + (1 - b2) * p.grad.double() ** 2
        assert_within(opt.state[p]["exp_avg_sq"].double(), want.numpy(), (gamma(4) * want).numpy(), what="refresh")
    reducer.sent_momentum, reducer.refreshed = True, False
    reducer.tensor_slots = reducer.tensor_slots[:2]      # alone's gradient not among the reduced ones
    reducer.tensor_factors = reducer.tensor_factors[:2]
    with pytest.raises(RuntimeError, match=r"none of the tensors the reducer reduced .* use var_rescale true") as info:
        frozen.step()
    assert "\n" not in str(info.value)


def test_tensor_rescale_is_refused_where_the_optimizer_steps_a_copy():
    """var_rescale "tensor" under ZeRO 1's DeepSpeedZeroOptimizer (it steps fp32 copies of
    the reduced gradients) is refused in one line at install; no ZeRO, or an optimizer
    with BF16_Optimizer's flat groups, passes; var_rescale true passes everywhere."""
    from ds_ext.comm.install import check_tensor_rescale
    from ds_ext.config import CommSection
    from ds_ext.errors import ConfigError
    tensor = CommSection(compressor="sign", target="momentum", warmup_steps=1, clip_norm="sketch", var_rescale="tensor")
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))])
    with pytest.raises(ConfigError, match=r"var_rescale 'tensor' .* ZeRO stage 1's optimizer \(AdamW\) .* set "
                                          r"var_rescale true") as info:
        check_tensor_rescale(tensor, 1, opt)
    assert "\n" not in str(info.value)
    check_tensor_rescale(tensor, 0, opt)
    opt.bf16_groups = []
    check_tensor_rescale(tensor, 1, opt)
    check_tensor_rescale(CommSection(compressor="sign", target="momentum", warmup_steps=1, clip_norm="sketch",
                                     var_rescale=True), 1, torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))]))


def test_elapsed_refresh_decay_keeps_the_variance_in_steps():
    """var_refresh_decay "elapsed": a refresh k steps after the dense step before it
    decays v by b2^k, v <- b2^k v + (1 - b2^k) g^2, and the variance's step count becomes
    the step's own (its bias correction in steps); 0/1 Adam's "refresh" decays by b2 and
    counts refreshes. k from the schedule (kappa 1, capped at 16: dense at 1, 2, 4, 8, 16,
    32, 48, ...), so a resumed run finds it from its step alone. v's roundings: gamma_4
    of each term against float64."""
    from ds_ext.comm.install import FrozenVarianceAdam
    from ds_ext.comm.reducer import GradientReducer
    from ds_ext.config import CommSection
    section = CommSection(compressor="sign", target="momentum", var_update_scaler=1, var_update_max_interval=16,
                          var_refresh_decay="elapsed")
    reducer = GradientReducer(section, node_of=[0])
    gaps = {}
    for step in (1, 2, 4, 8, 16, 32, 48, 64):
        reducer.steps = step
        gaps[step] = reducer.refresh_gap()
    assert gaps == {1: 1, 2: 1, 4: 2, 8: 4, 16: 8, 32: 16, 48: 16, 64: 16}
    g = torch.Generator().manual_seed(3)
    w = torch.nn.Parameter(torch.randn(200, generator=g))
    opt = torch.optim.AdamW([w], lr=0.01, betas=(0.9, 0.95), weight_decay=0.0)
    for _ in range(2):
        w.grad = torch.randn(200, generator=g)
        opt.step()
    frozen = FrozenVarianceAdam(opt, reducer)
    for decay, count in (("elapsed", 48), ("refresh", 3)):
        reducer.section = CommSection(**{**section.__dict__, "var_refresh_decay": decay})
        reducer.steps, reducer.sent_momentum, reducer.refreshed = 48, False, True
        v = opt.state[w]["exp_avg_sq"].double().clone()
        opt.state[w]["step"] = torch.tensor(2.0)
        w.grad = torch.randn(200, generator=g)
        frozen.step()
        keep = 0.95 ** 16 if decay == "elapsed" else 0.95
        want = keep * v + (1 - keep) * w.grad.double() ** 2
        assert_within(opt.state[w]["exp_avg_sq"].double(), want.numpy(), (gamma(4) * want).numpy(), what=decay)
        assert FrozenVarianceAdam.variance_steps(opt.state[w]) == count


def test_frozen_variance_adam_takes_the_rescaled_variance():
    """FrozenVarianceAdam with var_rescale: on a momentum step the denominator is
    sqrt(s v / (1 - b2^T)) + eps (s the reducer's variance_scale), clamped below by |m'|
    as without it; on a refresh the frozen v is first brought to where dense Adam's
    stood, v <- b2 s' v + (1 - b2) g^2 (s' its scale_before). Against float64: the
    step's few roundings (a square root, two scalings, an add, a max, a divide, the
    weight update) at most gamma_8 of each term; the refresh's v gamma_4."""
    from ds_ext.comm.install import FrozenVarianceAdam
    from ds_ext.comm.reducer import GradientReducer
    from ds_ext.config import CommSection
    g = torch.Generator().manual_seed(5)
    params = [torch.nn.Parameter(torch.randn(40, 30, generator=g)), torch.nn.Parameter(torch.randn(77, generator=g))]
    opt = torch.optim.AdamW(params, lr=0.01, betas=(0.9, 0.95), weight_decay=0.1)
    for _ in range(3):           # three dense steps: the variance to freeze
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()
    reducer = GradientReducer(CommSection(compressor="fp32", target="momentum", warmup_steps=1, var_rescale=True),
                              node_of=[0])
    frozen = FrozenVarianceAdam(opt, reducer)
    lr, b1, b2, eps, wd = 0.01, 0.9, 0.95, 1e-8, 0.1
    # a momentum step at the reducer's step 5, the variance taken at a quarter
    reducer.steps, reducer.sent_momentum, reducer.refreshed, reducer.variance_scale = 5, True, False, 0.25
    before = [(p.detach().double().clone(), opt.state[p]["exp_avg_sq"].double().clone()) for p in params]
    for p in params:
        p.grad = torch.randn(p.shape, generator=g) * 0.1
    frozen.step()
    bc1, bc2 = 1 - b1 ** 5, (1 - b2 ** 3) ** 0.5
    for p, (w, v) in zip(params, before):
        m = p.grad.double() / bc1
        denom = torch.maximum((0.25 * v).sqrt() / bc2 + eps, m.abs())
        want = w * (1 - lr * wd) - lr * m / denom
        bound = gamma(8) * (w.abs() * (1 + lr * wd) + 2 * lr * (m / denom).abs())
        assert_within(p.detach().double(), want.numpy(), bound.numpy(), what="momentum step")
    # a refresh: the frozen v at scale_before 0.5 first, then the step's squared gradient
    reducer.steps, reducer.sent_momentum, reducer.refreshed, reducer.scale_before = 6, False, True, 0.5
    v_before = [opt.state[p]["exp_avg_sq"].double().clone() for p in params]
    for p in params:
        p.grad = torch.randn(p.shape, generator=g) * 0.1
    frozen.step()
    for p, v in zip(params, v_before):
        grad2 = p.grad.double() ** 2
        want = b2 * 0.5 * v + (1 - b2) * grad2
        assert_within(opt.state[p]["exp_avg_sq"].double(), want.numpy(), (gamma(4) * want).numpy(), what="refresh")

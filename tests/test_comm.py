"""Compressed gradient communication (ds_ext/comm): config errors, each compressor's
all-reduce against the dense sum (exact where lossless, bounded where lossy), error
feedback, chunked/pipelined and hierarchical arrangements, NaN propagation.
Multi-rank cases use 2 or 4 gloo ranks; about 40 s in all.

A lossless path (fp32, top-k at ratio 1, a top-k sum of every rank's selection) adds the
same terms as the reference in another order (gloo's ring, chunks, the hierarchy), so it
is compared within the bound derived from fp32's unit roundoff and the number of terms
(tests/numerics.py: gamma(k - 1) * sum|terms|), not with a tolerance tuned on one CPU."""

import math
import numpy as np
import pytest
import torch

from tests.distributed import run_ranks
from tests.numerics import assert_sum_close, assert_within, gamma


def _section(**kw):
    from ds_ext.config import CommSection
    return CommSection(**kw)


# -- config ----------------------------------------------------------------------------

@pytest.mark.parametrize("raw, match", [
    ({"compressor": "topK"}, r"seekspeed.comm.compressor 'topK' is unknown \(did you mean 'topk'\?\)"),
    ({"compressor": "topk", "ratio": 0.0}, r"seekspeed.comm.ratio must be in \(0, 1\]"),
    ({"compressor": "topk", "ratio": 1.5}, r"seekspeed.comm.ratio must be in \(0, 1\]"),
    ({"compressor": "powersgd", "rank": 0}, r"seekspeed.comm.rank must be >= 1"),
    ({"selection": "approx"}, r"seekspeed.comm.selection 'approx'"),
    ({"pipeline_depth": 0}, r"seekspeed.comm.pipeline_depth must be >= 1"),
    ({"kernel": "cuda"}, r"seekspeed.comm.kernel 'cuda' is not one of \['auto', 'fused', 'torch'\]"),
    ({"ratio_": 0.1}, r"seekspeed.comm"),
    ({"dense_params": "*embed*"}, r"seekspeed.comm.dense_params: expected list of str \| null, got '\*embed\*'"),
    ({"dense_params": [" "]}, r"seekspeed.comm.dense_params holds an empty pattern"),
    ({"compressor": "sign", "residual_dtype": "fp16"}, r"seekspeed.comm.residual_dtype 'fp16' is not one of"),
    ({"compressor": "topk", "residual_dtype": "bf16"},
     r"seekspeed.comm.residual_dtype 'bf16' is for the residuals of sign and int4 .*compressor 'topk'"),
    ({"compressor": "sign", "residual_dtype": "bf16", "error_feedback": False},
     r"seekspeed.comm.residual_dtype 'bf16' with error_feedback false: there is no residual"),
])
def test_bad_comm_section_is_one_line_error(raw, match):
    from ds_ext.config import SeekspeedSection
    from ds_ext.errors import ConfigError
    from ds_ext.schema import from_dict
    with pytest.raises(ConfigError, match=match) as info:
        from_dict(SeekspeedSection, {"train": {"steps": 1}, "comm": raw}, where="seekspeed")
    assert "\n" not in str(info.value)


# -- single-process pieces ---------------------------------------------------------------

@pytest.mark.parametrize("name", ["sign", "sign-fused", "int4"])
def test_block_codecs_decode_what_they_encode(name):
    """sign: every entry decodes to its block's mean magnitude with the entry's sign (0
    counts as +), in torch ops (one multiply packs 8 signs, a table per byte decodes) and
    in the fused C++ kernel (csrc/sign_codec.cpp), which packs the same bytes and leaves
    the same residual up to its scale's summation order; int4: round(x / s) clamped to
    [-7, 7] times s, s = the block's max |x| / 7."""
    from ds_ext.comm.compressors import _Int4Codec, _SignCodec
    g = torch.Generator().manual_seed(0)
    rows = torch.randn(40, 64, generator=g) * torch.logspace(-3, 2, 40)[:, None]
    rows[3, ::3] = 0.0
    codec = {"sign": _SignCodec(kernel="torch"), "sign-fused": _SignCodec(kernel="fused"), "int4": _Int4Codec()}[name]
    held_back = rows.clone()
    scales, codes = codec.encode(held_back, residual=True)
    assert codes.dtype == torch.uint8 and codes.numel() == rows.numel() // codec.per_byte
    got = codec.decode_into(scales, codes, torch.empty_like(rows))
    np.testing.assert_array_equal(held_back, rows - got)        # the residual: what the encoding held back
    added = codec.decode_into(scales, codes, rows.clone(), accumulate=True, factor=0.5)
    np.testing.assert_array_equal(added, rows + codec.decode_into(scales * 0.5, codes, torch.empty_like(rows)))
    if name.startswith("sign"):
        mean = rows.abs().mean(dim=1, keepdim=True)
        want = torch.where(rows >= 0, mean, -mean)
        np.testing.assert_allclose(scales, mean[:, 0], rtol=gamma(64))
        torch.testing.assert_close(got, torch.where(rows >= 0, scales[:, None], -scales[:, None]), rtol=0, atol=0)
        torch.testing.assert_close(got, want, rtol=2 * gamma(64), atol=0)
    else:
        step = rows.abs().amax(dim=1, keepdim=True) / 7
        want = (rows / step).round().clamp(-7, 7) * step
        # x / s and x * (1 / s) may round to either side of a .5 boundary: at most one step apart
        assert ((got - want).abs() <= step * (1 + 1e-6)).all()
        assert ((got - want).abs() > 1e-6 * step).float().mean() < 1e-3
        assert ((got - rows).abs() <= step / 2 * (1 + 1e-5)).all()


def test_sampled_selection_keeps_at_most_k_of_the_largest():
    from ds_ext.comm.compressors import TopK
    torch.manual_seed(0)
    x = torch.randn(200_000)
    comp = TopK(ratio=0.01, selection="sampled", sample_ratio=0.01)
    k = comp.count(x.numel())
    idx = comp.select(x.abs(), k)
    assert 0.5 * k <= idx.numel() <= k
    exact = torch.topk(x.abs(), k).values
    # what the sample lets through is among the large entries: above the 2k-th largest magnitude
    assert x[idx].abs().min() >= torch.topk(x.abs(), 2 * k).values[-1]
    assert x[idx].abs().max() == exact[0]


def test_powersgd_sends_small_and_vector_tensors_dense():
    from ds_ext.comm.compressors import PowerSGD
    comp = PowerSGD(rank=4)
    assert comp.wants((1024, 512)) and not comp.wants((1024,)) and not comp.wants((8, 8))


# -- multi-rank all-reduces ---------------------------------------------------------------

def _grads(rank, shapes, seed=0):
    g = torch.Generator().manual_seed(1000 * seed + rank)
    return [torch.randn(*s, generator=g) for s in shapes]


SHAPES = [(96, 64), (300,), (64, 128), (5000,)]


def _reduce_rank(section_kw, steps=1, hierarchical_nodes=0, seed=0, poison_step=None):
    """Each rank reduces its own random gradients; returns every step's results. At
    ``poison_step`` rank 1's first gradient holds a NaN (the step is to be skipped)."""
    import torch.distributed as tdist
    from ds_ext.comm.reducer import GradientReducer
    from ds_ext.topology.groups import NodeGroups
    rank, world = tdist.get_rank(), tdist.get_world_size()
    section = _section(**section_kw)
    groups = None
    node_of = [r * max(hierarchical_nodes, 1) // world for r in range(world)]
    if section.hierarchical:
        groups = NodeGroups.for_subsets(node_of, [list(range(world))])
    reducer = GradientReducer(section, node_groups=groups, node_of=node_of)
    out = []
    for step in range(steps):
        grads = _grads(rank, SHAPES, seed=seed + step)
        if step == poison_step and rank == 1:
            grads[0][3, 5] = float("nan")
        reducer.begin_step()
        reducer.reduce(grads, group=tdist.group.WORLD, divide_by=world, key="dense")
        stats = reducer.end_step()
        out.append({"grads": [g.clone() for g in grads], "stats": stats.figures()})
    return out


def _dense_terms(world, seed=0):
    """Per tensor: every rank's gradient (the terms of the dense sum)."""
    per_rank = [_grads(r, SHAPES, seed=seed) for r in range(world)]
    return [[p[i].numpy() for p in per_rank] for i in range(len(SHAPES))]


def _assert_means(grads, terms, world):
    for i, (got, t) in enumerate(zip(grads, terms)):
        assert_sum_close(got, t, divide_by=world, what=f"tensor {i}")


@pytest.mark.multirank
def test_fp32_path_matches_the_dense_mean_chunked_pipelined_and_hierarchical():
    flat = run_ranks(_reduce_rank, world_size=4, args=({"compressor": "fp32", "min_numel": 1000,
                                                         "chunk_mb": 0.01, "pipeline_depth": 3}, 1, 2))
    hier = run_ranks(_hier_rank, world_size=4, args=({"compressor": "fp32", "min_numel": 1000, "chunk_mb": 0.01},))
    terms = _dense_terms(4)
    for results in (flat, hier):
        for r in results:
            _assert_means(r[0]["grads"], terms, 4)
    # what each rank sends on groups that span nodes: its share of the rails vs the whole flat ring
    assert hier[0][0]["stats"]["inter_node_bytes"] < flat[0][0]["stats"]["inter_node_bytes"]


def _hier_rank(section_kw, steps=1):
    return _reduce_rank({**section_kw, "hierarchical": True}, steps=steps, hierarchical_nodes=2)


def _topk_terms(world, ratio, seed=0):
    """Per tensor: every rank's exact per-tensor top-k selection, zeros elsewhere (the
    terms of the sparse sum); tensors under min_numel are sent dense."""
    per_rank = [_grads(r, SHAPES, seed=seed) for r in range(world)]
    out = []
    for i, shape in enumerate(SHAPES):
        if math.prod(shape) < 1000:          # dense
            out.append([p[i].numpy() for p in per_rank])
            continue
        terms = []
        for p in per_rank:
            flat = p[i].reshape(-1)
            idx = torch.topk(flat.abs(), max(1, math.ceil(flat.numel() * ratio))).indices
            term = torch.zeros(math.prod(shape))
            term[idx] = flat[idx]
            terms.append(term.view(shape).numpy())
        out.append(terms)
    return out


@pytest.mark.multirank
def test_topk_sparse_all_reduce_sums_every_ranks_selection():
    results = run_ranks(_reduce_rank, world_size=2, args=({"compressor": "topk", "ratio": 0.05,
                                                            "selection": "exact", "min_numel": 1000,
                                                            "chunk_mb": 1},))
    terms = _topk_terms(2, 0.05)
    for r in results:
        _assert_means(r[0]["grads"], terms, 2)
    # lossless at ratio 1
    full = run_ranks(_reduce_rank, world_size=2, args=({"compressor": "topk", "ratio": 1.0, "min_numel": 1000},))
    _assert_means(full[0][0]["grads"], _dense_terms(2), 2)


FUSED_VARIANTS = [{}, {"momentum": 0.9}, {"error_feedback": False}, {"momentum": 0.9, "error_feedback": False}]


def _variants_rank(kernel):
    base = {"compressor": "topk", "ratio": 0.01, "selection": "sampled", "min_numel": 1000, "chunk_mb": 0.02,
            "kernel": kernel}
    return [_reduce_rank({**base, **extra}, 5, poison_step=2) for extra in FUSED_VARIANTS]


@pytest.mark.multirank
def test_fused_topk_kernel_equals_torch_ops_bitwise():
    """The one-pass C++ accumulate-and-select (ds_ext/comm/csrc) against the same
    selection in torch ops, over 5 steps (residuals and momentum carried) of which the
    third has a NaN (skipped: state and sampling left as they were), with tensors cut
    across chunks, with and without error feedback and momentum: the same gradients,
    bit for bit."""
    fused = run_ranks(_variants_rank, world_size=2, args=("fused",))
    plain = run_ranks(_variants_rank, world_size=2, args=("torch",))
    for rank_a, rank_b in zip(fused, plain):
        for extra, a, b in zip(FUSED_VARIANTS, rank_a, rank_b):
            for step_a, step_b in zip(a, b):
                for ga, gb in zip(step_a["grads"], step_b["grads"]):
                    np.testing.assert_array_equal(ga, gb, err_msg=str(extra))
    # and it is a real sparse reduction: most entries of the large tensors are zero
    assert (fused[0][0][0]["grads"][0] == 0).mean() > 0.9
    # the poisoned step: the NaN's chunk (5,242 of the first tensor's 6,144 entries) is NaN on
    # every rank; the step after it is finite again
    for r in fused:
        assert np.isnan(r[0][2]["grads"][0].ravel()[:5242]).all()
        assert np.isfinite(r[0][3]["grads"][0]).all()


def test_fused_selection_equals_torch_ops_over_many_blocks_and_threads():
    """Single process, 2 threads: tensors spanning several of the kernel's 64K-entry
    blocks and one small enough for the exact branch, against the torch path."""
    from ds_ext.comm.compressors import TopK
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        sizes = [8, 200_000, 70_000]
        g = torch.Generator().manual_seed(0)
        flat = torch.randn(sum(sizes), generator=g)
        residual = 0.1 * torch.randn(sum(sizes), generator=g)
        fused, plain = TopK(ratio=0.01, kernel="fused"), TopK(ratio=0.01, kernel="torch")
        new, acc, idx, finite = fused._accumulate_select_fused(fused._fused(flat.device), flat,
                                                               {"residual": residual}, sizes)
        want = plain._accumulate(flat, {"residual": residual})
        assert finite and torch.equal(acc, want["residual"]) and new["residual"] is acc
        assert torch.equal(idx, plain._select_per_tensor(want["residual"].abs(), sizes))
        k = sum(fused.count(n) for n in sizes)
        assert 0.5 * k <= idx.numel() <= k
    finally:
        torch.set_num_threads(threads)


def _error_feedback_rank(name, error_feedback):
    """The same gradient every step: with error feedback, what was sent over T steps
    plus the residual left is exactly T times the gradient."""
    import torch.distributed as tdist
    from ds_ext.comm.reducer import GradientReducer
    section = _section(compressor=name, ratio=0.1, rank=2, error_feedback=error_feedback, min_numel=1,
                       selection="exact")
    reducer = GradientReducer(section)
    g = _grads(0, [(64, 96)])[0]         # the same on both ranks
    sent = torch.zeros_like(g)
    steps = 40
    for _ in range(steps):
        x = g.clone()
        reducer.begin_step()
        reducer.reduce([x], group=tdist.group.WORLD, divide_by=tdist.get_world_size(), key="dense")
        reducer.end_step()
        sent += x
    comp = reducer.compressor
    st = next(iter(comp.state.values())) if comp.state else {}
    residual = st.get("residual", st.get("e"))
    return {"rel_err": float((sent / steps - g).norm() / g.norm()),
            "invariant": float((sent + (residual.view_as(g) if residual is not None else 0) - steps * g).abs().max())}


@pytest.mark.multirank
@pytest.mark.parametrize("name", ["topk", "powersgd", "int8", "int4", "sign"])
def test_error_feedback_delivers_what_compression_held_back(name):
    with_ef = run_ranks(_error_feedback_rank, world_size=2, args=(name, True))[0]
    without = run_ranks(_error_feedback_rank, world_size=2, args=(name, False))[0]
    assert with_ef["rel_err"] < 0.5 * without["rel_err"], (with_ef, without)
    if name == "topk":                      # exact bookkeeping: sent + residual == T g
        assert with_ef["invariant"] < 1e-3


def _powersgd_low_rank(rank_):
    import torch.distributed as tdist
    from ds_ext.comm.reducer import GradientReducer
    me = tdist.get_rank()
    u, v = torch.randn(128, 1, generator=torch.Generator().manual_seed(1)), torch.randn(
        1, 96, generator=torch.Generator().manual_seed(2))
    x = (me + 1.0) * (u @ v)
    reducer = GradientReducer(_section(compressor="powersgd", rank=rank_, min_numel=1))
    reducer.begin_step()
    reducer.reduce([x], group=tdist.group.WORLD, divide_by=2, key="dense")
    return {"err": float((x - 1.5 * (u @ v)).abs().max() / (u @ v).abs().max())}


@pytest.mark.multirank
def test_powersgd_is_exact_on_gradients_of_its_rank():
    results = run_ranks(_powersgd_low_rank, world_size=2, args=(2,))
    assert all(r["err"] < 1e-5 for r in results)


def _against_torch_powersgd_hook(steps, warmup):
    """Each step, every rank's gradient of a small MLP goes through torch's own
    ``powerSGD_hook`` (DDP, one bucket) and through our reducer; both start from the
    same Q (ours, written into the hook's warm-start memory before its first
    compressed step). Returns the largest relative difference per step."""
    import torch.distributed as tdist
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as ps
    from torch.nn.parallel import DistributedDataParallel
    from ds_ext.comm.reducer import GradientReducer
    rank, world = tdist.get_rank(), tdist.get_world_size()
    torch.manual_seed(0)                      # the same weights on every rank
    model = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.Tanh(), torch.nn.Linear(96, 48),
                                torch.nn.Tanh(), torch.nn.Linear(48, 40))
    params = list(model.parameters())
    ddp = DistributedDataParallel(model, bucket_cap_mb=200)
    state = ps.PowerSGDState(process_group=None, matrix_approximation_rank=4, start_powerSGD_iter=warmup,
                             use_error_feedback=True, warm_start=True)
    reducer = GradientReducer(_section(compressor="powersgd", rank=4, min_numel=1, warmup_steps=warmup))
    comp = reducer.compressor
    big = [p for p in params if p.dim() == 2]     # our reducer's compressed views, in this order

    def hook(st, bucket):
        if st.iter == st.start_powerSGD_iter and bucket.index() not in st.q_memory_dict:
            # the hook's order: shapes grouped in order of first appearance; Q (cols x rank) each
            mats = [g.view(g.shape[0], -1) for g in bucket.gradients()]
            mats = [m for m in mats if comp.wants(tuple(m.shape))]
            by_shape = {}
            for m in mats:
                by_shape.setdefault(tuple(m.shape), []).append(m)
            qs = []
            for shape, ms in by_shape.items():
                for m in ms:
                    i = next(i for i, p in enumerate(big) if tuple(p.shape) == shape)
                    qs.append(comp._q((("g", 0), i), m.shape[1], m.device).reshape(-1))
            st.q_memory_dict[bucket.index()] = torch.cat(qs)
            st.p_memory_dict[bucket.index()] = torch.empty(sum(m.shape[0] * 4 for m in mats))
        return ps.powerSGD_hook(st, bucket)

    ddp.register_comm_hook(state, hook)
    worst = []
    for step in range(steps):
        g = torch.Generator().manual_seed(100 * step + rank)
        x, y = torch.randn(32, 64, generator=g), torch.randn(32, 40, generator=g)
        local = torch.autograd.grad(torch.nn.functional.mse_loss(model(x), y), params)
        ddp.zero_grad(set_to_none=True)
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        ours = [t.clone() for t in local]
        reducer.begin_step()
        reducer.reduce(ours, group=tdist.group.WORLD, divide_by=world, key="g")
        reducer.end_step()
        worst.append(max(float((o - p.grad).abs().max() / p.grad.abs().max()) for o, p in zip(ours, params)))
    return worst


@pytest.mark.multirank
def test_powersgd_equals_torch_powersgd_hook():
    """The reference: torch's PowerSGD DDP hook (rank 4, error feedback, warm start)
    on the same gradients gives the same averaged gradients, step after step (both
    dense steps and compressed ones, the errors carried between them)."""
    results = run_ranks(_against_torch_powersgd_hook, world_size=2, args=(6, 2))
    for worst in results:
        assert max(worst) < 1e-4, worst


def _quantisation_bound(name, terms, world):
    """Elementwise bound on a quantised all-reduce's mean of ``terms`` (one per rank).
    bf16/fp16 on the wire: each rank's value is rounded to the wire type and gloo adds
    in it, 2 * world - 1 roundings of unit roundoff 2^-8 (bf16: 8 significant bits) or
    2^-11 (fp16: 11), so
    gamma_(2w-1) * sum|terms| in that unit. int8: each rank's code is off by at most half
    its block's step, max|x| / 127 over a block of 256 entries of its region (bounded by
    the largest |x| the rank sends at all), plus fp32 roundings of the divide, the
    dequantising multiply and the sum. int4 (two phases): each rank's code is off by at
    most half its block's step, max|x| / 14, and the server's re-encoding of the mean by
    half of its step, max|mean| / 14 <= (sum of the ranks' max|x|) / (14 world)."""
    stack = np.stack([np.asarray(t, dtype=np.float64) for t in terms])
    abs_sum = np.abs(stack).sum(axis=0)
    if name == "int8":
        per_rank_step = [max(float(np.abs(np.asarray(x)).max()) for x in rank) / 127.0 for rank in _by_rank(world)]
        return (sum(per_rank_step) / 2 + (gamma(world) + 2 * gamma(1)) * abs_sum) / world
    if name == "int4":
        per_rank = [max(float(np.abs(np.asarray(x)).max()) for x in rank) for rank in _by_rank(world)]
        return 2 * sum(per_rank) / (14 * world) + (gamma(world) + 3 * gamma(1)) * abs_sum / world
    u = {"bf16": 2.0**-8, "fp16": 2.0**-11}[name]
    k = 2 * world - 1
    return k * u / (1 - k * u) * abs_sum / world


def _by_rank(world, seed=0):
    return [[t.numpy() for t in _grads(r, SHAPES, seed=seed)] for r in range(world)]


@pytest.mark.multirank
@pytest.mark.parametrize("name", ["int8", "int4", "bf16", "fp16"])
def test_quantised_all_reduce_error_is_bounded(name):
    results = run_ranks(_reduce_rank, world_size=2, args=({"compressor": name, "min_numel": 1000},))
    for i, (got, terms) in enumerate(zip(results[0][0]["grads"], _dense_terms(2))):
        exact = np.stack(terms).astype(np.float64).sum(axis=0) / 2
        assert_within(got, exact, _quantisation_bound(name, terms, 2), what=f"{name}: tensor {i}")


@pytest.mark.multirank
@pytest.mark.parametrize("name", ["topk", "topk-fused", "powersgd", "int8", "int4", "sign", "bf16"])
def test_non_finite_gradient_reaches_every_rank(name):
    """An inf on one rank must not be hidden by compression: every rank's output is
    non-finite (as a dense all-reduce would make it), and the state is left alone."""
    results = run_ranks(_poisoned_rank, world_size=2, args=(name,))
    for r in results:
        assert not np.isfinite(r["first"]).all()
        if name.startswith("topk"):         # the whole compressed region, not only the NaN sent
            assert np.isnan(r["first"]).all()
        assert r["second_finite"]


def _poisoned_rank(name):
    import torch.distributed as tdist
    from ds_ext.comm.reducer import GradientReducer
    rank = tdist.get_rank()
    if name == "topk-fused":
        section = _section(compressor="topk", min_numel=1000, selection="sampled", kernel="fused")
    else:
        section = _section(compressor=name, min_numel=1000, selection="exact")
    reducer = GradientReducer(section)
    first = _grads(rank, [(96, 64)])
    if rank == 1:
        first[0][3, 5] = float("nan") if name == "topk-fused" else float("inf")
    reducer.reduce(first, group=tdist.group.WORLD, divide_by=2, key="dense")
    second = _grads(rank, [(96, 64)], seed=1)
    reducer.reduce(second, group=tdist.group.WORLD, divide_by=2, key="dense")
    return {"first": first[0], "second_finite": bool(torch.isfinite(second[0]).all())}


@pytest.mark.multirank
def test_hierarchical_topk_at_ratio_one_is_exact():
    results = run_ranks(_hier_rank, world_size=4, args=({"compressor": "topk", "ratio": 1.0, "min_numel": 1000,
                                                         "chunk_mb": 0.01},))
    for r in results:
        _assert_means(r[0]["grads"], _dense_terms(4), 4)


@pytest.mark.parametrize("with_worker", [True, False])
def test_sign_momentum_encoding_kernel_is_the_torch_ops_bit_for_bit(with_worker):
    """target momentum through sign: local x g + beta1 x m (+ the worker residual) formed in
    the encoding's pass by the C++ kernel is the torch ops' bit for bit (each product and
    sum rounded on its own, zero past g's length, a tail shorter than a block included), and
    so are the codes; the scales agree up to their summation order (as in
    test_block_codecs_decode_what_they_encode); the formed values are within gamma(3) of the
    float64 momentum (three roundings, each relative to the magnitudes summed)."""
    from ds_ext.comm.compressors import _SignCodec
    g = torch.Generator().manual_seed(3)
    n, block, blocks = 5000, 64, 80                     # 5120 padded: the last block is part tail
    grad = torch.randn(n, generator=g) * torch.logspace(-4, 1, n)
    m = torch.randn(n, generator=g) * 0.1
    w = torch.randn(blocks * block, generator=g) * 1e-3 if with_worker else None
    out = {}
    for kernel in ("torch", "fused"):
        rows = torch.full((blocks, block), float("nan"))       # whatever the buffer held before
        scales, codes = _SignCodec(kernel=kernel).encode_momentum(rows, grad, m, w, local=0.2, beta1=0.9)
        out[kernel] = (scales, codes, rows)
    torch.testing.assert_close(out["torch"][2], out["fused"][2], rtol=0, atol=0)      # the formed momentum
    torch.testing.assert_close(out["torch"][1], out["fused"][1], rtol=0, atol=0)      # its signs
    np.testing.assert_allclose(out["torch"][0], out["fused"][0], rtol=2 * gamma(block))
    formed = out["fused"][2].view(-1)
    assert (formed[n:] == 0).all()
    x = 0.2 * grad.double() + 0.9 * m.double() + (w[:n].double() if with_worker else 0)
    size = 0.2 * grad.double().abs() + 0.9 * m.double().abs() + (w[:n].double().abs() if with_worker else 0)
    assert ((formed[:n].double() - x).abs() <= gamma(3) * size).all()


@pytest.mark.parametrize("with_worker", [True, False])
def test_momentum_kept_as_codes_encodes_as_its_decoding_bit_for_bit(with_worker):
    """M kept as the all-gather delivered it (a codec's scales and codes on the encoding's
    block grid) forms and encodes this rank's momentum bit for bit as its fp32 decoding
    does: sign through the C++ kernel (reading M's bits) and through torch ops, int4
    through torch ops; the formed momentum, codes and scales (the torch ops' own, summed
    in the same order) identical, the kernel's scales within its summation order's
    bound as in test_sign_momentum_encoding_kernel_is_the_torch_ops_bit_for_bit."""
    from ds_ext.comm.compressors import _Int4Codec, _SignCodec
    g = torch.Generator().manual_seed(5)
    n, block, blocks = 5000, 64, 80                     # 5120 padded: the last block is part tail
    grad = torch.randn(n, generator=g) * torch.logspace(-4, 1, n)
    w = torch.randn(blocks * block, generator=g) * 1e-3 if with_worker else None
    for codec, kernels in ((_SignCodec, ("torch", "fused")), (_Int4Codec, ("torch",))):
        kept = codec(kernel="torch").encode(torch.randn(blocks, block, generator=g) * 0.1)
        decoded = codec(kernel="torch").decode_into(*kept, torch.empty(blocks, block)).view(-1)[:n]
        out = {}
        for kernel in kernels:
            for m in (decoded, kept):
                rows = torch.full((blocks, block), float("nan"))
                scales, codes = codec(kernel=kernel).encode_momentum(rows, grad, m, w, local=0.2, beta1=0.9)
                out[kernel, type(m)] = (rows, codes, scales)
        reference = out["torch", torch.Tensor]
        for (kernel, _), (rows, codes, scales) in out.items():
            torch.testing.assert_close(rows, reference[0], rtol=0, atol=0)
            torch.testing.assert_close(codes, reference[1], rtol=0, atol=0)
            if kernel == "torch":
                torch.testing.assert_close(scales, reference[2], rtol=0, atol=0)
            else:
                np.testing.assert_allclose(scales, reference[2], rtol=2 * gamma(block))


def _kept_momentum_rank(compressor, kernel, dtype, ahead=False):
    """Two reducers on the same gradients, target momentum with clipping and 0/1 Adam's
    refreshes (warm-up 2, kappa 1: dense steps 1, 2, 4 and 8, momentum steps 3, 5-7, 9):
    one keeps M as its compressor delivers it, the other has M decoded to fp32 after every
    step. Returns the steps on which their gradients or M differ, how M was kept after
    each step, and the steps whose clip coefficient was below 1. ``ahead``: the clip
    coefficient found before the exchange (GradientReducer.clip_ahead)."""
    import torch.distributed as tdist
    from ds_ext.comm.reducer import GradientReducer
    world, me = tdist.get_world_size(), tdist.get_rank()
    reducers = [GradientReducer(_section(compressor=compressor, target="momentum", warmup_steps=2,
                                         var_update_scaler=1, min_numel=1000, chunk_mb=0.125, kernel=kernel),
                                node_of=[0] * world) for _ in range(2)]
    for r in reducers:
        r.beta1, r.clip = 0.9, 2200.0     # the mean of 2 ranks |g_i| ~ 400 (1 + step): biting from step 6
    shapes, differ, kept, clipped = [(256, 300), (5000,), (300, 257)], [], [], []
    part = ("dense", "compressed")
    for step in range(9):
        out = []
        for i, r in enumerate(reducers):
            # the norm grows with the step, so that the clip starts biting part way
            grads = [(g * (1 + step)).to(dtype) for g in _grads(me, shapes, seed=step)]
            r.begin_step()
            if ahead:
                r.clip_ahead([(grads, dict(group=tdist.group.WORLD, divide_by=world))])
            r.reduce(grads, group=tdist.group.WORLD, divide_by=world, key="dense")
            r.end_step()
            if i == 1:
                r.momentum[part] = r.momentum_tensor(part).clone()
            out.append(grads)
        packed, dense = reducers
        kept.append(type(packed.momentum[part]).__name__)
        if packed.stats.clip_coef < 1:
            clipped.append(step + 1)
        same = all(torch.equal(a, b) for a, b in zip(*out))
        same &= all(torch.equal(packed.momentum_tensor(k), dense.momentum[k]) for k in dense.momentum)
        if not same:
            differ.append(step + 1)
    return {"differ": differ, "kept": kept, "clipped": clipped}


@pytest.mark.multirank
@pytest.mark.parametrize("compressor, kernel, dtype, ahead", [("sign", "fused", torch.float32, False),
                                                              ("sign", "torch", torch.bfloat16, False),
                                                              ("int4", "auto", torch.float32, False),
                                                              ("sign", "fused", torch.float32, True)])
def test_momentum_kept_as_codes_is_bitwise_the_fp32_momentum(compressor, kernel, dtype, ahead):
    """Keeping M after a momentum step as the compressor's scales and codes (a bit an
    entry with sign, instead of 32) changes nothing: gradients and M bitwise those of the
    same reducer whose M is decoded to fp32 after every step, over dense warm-up steps, a
    momentum step, a variance refresh after it (M decoded again), momentum steps whose clip
    coefficient is 1 and below it (M then mixed with the M before it, in fp32), 2 ranks,
    chunks, the kernel's and the torch ops' passes, fp32 and bf16 gradients. With the
    clip coefficient found ahead of the exchange (the momentum formed clipped), every
    momentum step keeps M as codes, the clipped ones too."""
    for r in run_ranks(_kept_momentum_rank, world_size=2, args=(compressor, kernel, dtype, ahead)):
        assert r["differ"] == [], r
        assert r["kept"][2] == "dict" and r["kept"][3] == "Tensor", r      # kept as codes; a refresh's fp32
        assert 1 < len(r["clipped"]) < 6 and r["clipped"][-1] == 9, r     # steps of both kinds, clipped ones last
        assert any(r["kept"][s - 1] == "dict" for s in (3, 5, 6, 7, 9) if s not in r["clipped"]), r
        if ahead:
            assert all(r["kept"][s - 1] == "dict" for s in (3, 5, 6, 7, 9)), r


def _held_bytes_rank(compressor, target, chunk_mb, depth, residual="fp32", kernel="auto"):
    """Bytes the reducer and its compressor hold after 4 compressed steps, all tensors at
    least min_numel; under target momentum after 8 steps: the dense warm-up (1, 2), momentum
    steps (3, 5-7) and variance refreshes (4, 8; 0/1 Adam, kappa 1), ending on a refresh:
    the most it holds, M in fp32 again beside the residuals and the scratch the momentum
    steps pooled (between them M is kept as the compressor's codes)."""
    import torch.distributed as tdist
    from ds_ext.comm.reducer import GradientReducer
    world = tdist.get_world_size()
    momentum = {"warmup_steps": 2, "var_update_scaler": 1} if target == "momentum" else {"warmup_steps": 0}
    reducer = GradientReducer(_section(compressor=compressor, target=target, min_numel=1000, chunk_mb=chunk_mb,
                                       pipeline_depth=depth, residual_dtype=residual, kernel=kernel, **momentum),
                              node_of=[0] * world)
    reducer.beta1 = 0.9
    # tensors shorter than a chunk: every chunk spans two and goes through chunk scratch
    shapes = [(100, 300)] * 5 + [(5000,)]
    for step in range(8 if target == "momentum" else 4):
        grads = _grads(tdist.get_rank(), shapes, seed=step)
        reducer.begin_step()
        reducer.reduce(grads, group=tdist.group.WORLD, divide_by=world, key="dense")
        reducer.end_step()
    assert target != "momentum" or reducer.stats.dense == "refresh"
    comp = reducer.compressor
    held = sum(t.numel() * t.element_size() for st in comp.state.values() for t in st.values())
    held += comp.pool.bytes() + reducer._scratch.bytes() + sum(t.numel() * 4 for t in reducer.momentum.values())
    # one tensor of the same size: its chunks are exchanged in its own memory, no scratch
    one = GradientReducer(reducer.section, node_of=[0] * world)
    one.beta1 = 0.9
    for step in range(3):
        one.begin_step()
        one.reduce([torch.cat([g.reshape(-1) for g in _grads(tdist.get_rank(), shapes, seed=step)])],
                   group=tdist.group.WORLD, divide_by=world, key="dense")
        one.end_step()
    return {"held": held, "numel": sum(math.prod(s) for s in shapes), "dense_buffers": len(reducer._buffers),
            "one_tensor_scratch": one._scratch.bytes(), "one_tensor_steps": one.steps}


@pytest.mark.multirank
@pytest.mark.parametrize("compressor, target, residual", [("sign", "gradient", "fp32"), ("int4", "momentum", "fp32"),
                                                          ("sign", "momentum", "bf16"), ("topk", "gradient", "fp32")])
def test_the_planners_comm_state_is_what_the_reducer_holds(compressor, target, residual):
    """ds_ext.comm.traffic.state_bytes (the planner's comm state) against the bytes the
    reducer and its compressor hold after training steps (residuals, pooled scratch,
    the momentum): 2 ranks, 5 chunks of 32768 entries (the last shorter), 2 in flight,
    each spanning two tensors (the chunk scratch the planner counts, an upper bound: a
    chunk inside one fp32 tensor takes none, checked on one tensor of the same size).
    The planner does not count the two-phase padding (each chunk's segments are rounded
    up to whole blocks: at most world x block entries a chunk, for the worker residual and
    each pooled input, one block for the server residual and each pooled sum and tail;
    with bf16 residuals their padding is 2 bytes an entry, and the momentum's pooled
    inputs are two a chunk in flight, the encoded one and the widened residual),
    and counts a sum and a tail per chunk in flight, which the pool may reuse within a
    chunk (at most depth x 2 segments of chunk / world entries fewer). Top-k (torch ops):
    its residual, and pooled, the accumulators formed per chunk in flight and the
    magnitudes of one chunk of each size: exactly the planned bytes."""
    from ds_ext.comm.traffic import RESIDUAL_BYTES, default_block_size, state_bytes
    world, chunk_mb, depth = 2, 0.125, 2
    # top-k through torch ops, which take the magnitudes the planner counts (the CPU kernel takes none)
    kernel = "torch" if compressor == "topk" else "auto"
    ranks = run_ranks(_held_bytes_rank, world_size=world, args=(compressor, target, chunk_mb, depth, residual, kernel))
    chunk = int(chunk_mb * 2 ** 20 / 4)
    numel, block = ranks[0]["numel"], default_block_size(compressor)
    chunks = math.ceil(numel / chunk)
    kept = RESIDUAL_BYTES[residual]
    planned = sum(state_bytes(compressor, numel=numel, nodes=1, per_node=world, hierarchical=False, target=target,
                              chunk=chunk, depth=depth, residual_dtype=residual).values())
    padding = (kept * chunks + 4 * depth * (2 if target == "momentum" and kept != 4 else 1)) * (world + 2) * block
    if compressor == "topk":       # no blocks, no segments
        padding, unplanned = 0, 0
    else:
        unplanned = 4 * depth * 2 * chunk / world
    for r in ranks:
        assert r["dense_buffers"] == 0
        assert r["one_tensor_scratch"] == 0 and r["one_tensor_steps"] == 3
        assert planned - unplanned <= r["held"] <= planned + padding, (r["held"], planned, padding)


def _bf16_residual_rank(compressor, target, kernel):
    """Two reducers on the same gradients for 6 steps (target momentum: 2 dense warm-up
    steps): one keeping its residuals in bf16, one in fp32 whose residuals are rounded to
    bf16 and widened back before each step. Returns the steps on which their results, M
    and kept residuals differ, and the largest rounding relative to the residual's size."""
    import torch.distributed as tdist
    from ds_ext.comm.reducer import GradientReducer
    world, me = tdist.get_world_size(), tdist.get_rank()
    reducers = {dtype: GradientReducer(_section(compressor=compressor, target=target, residual_dtype=dtype,
                                                warmup_steps=2 if target == "momentum" else 0, min_numel=1000,
                                                chunk_mb=0.125, kernel=kernel), node_of=[0] * world)
                for dtype in ("bf16", "fp32")}
    for r in reducers.values():
        r.beta1 = 0.9
    shapes, differ, worst = [(256, 300), (5000,), (300, 257)], [], 0.0
    for step in range(6):
        wide = reducers["fp32"].compressor.state
        for st in wide.values():
            for name in ("worker", "server"):
                if name in st:
                    rounded = st[name].bfloat16().float()
                    worst = max(worst, float(((rounded - st[name]).abs() - 2.0 ** -8 * st[name].abs()).max()))
                    st[name].copy_(rounded)
        out = {}
        for dtype, r in reducers.items():
            grads = _grads(me, shapes, seed=step)
            r.begin_step()
            r.reduce(grads, group=tdist.group.WORLD, divide_by=world, key="dense")
            r.end_step()
            out[dtype] = grads
        narrow = reducers["bf16"].compressor.state
        same = all(torch.equal(a, b) for a, b in zip(out["bf16"], out["fp32"]))
        same &= all(torch.equal(reducers["bf16"].momentum_tensor(k), reducers["fp32"].momentum_tensor(k))
                    for k in reducers["fp32"].momentum)
        same &= all(narrow[k][name].dtype == torch.bfloat16 and torch.equal(narrow[k][name],
                                                                             wide[k][name].bfloat16())
                    for k in wide for name in ("worker", "server"))
        if not same:
            differ.append(step)
    return {"differ": differ, "worst": worst, "keys": len(narrow)}


@pytest.mark.multirank
@pytest.mark.parametrize("compressor, target, kernel", [("sign", "momentum", "fused"), ("sign", "momentum", "torch"),
                                                        ("int4", "gradient", "auto")])
def test_bf16_residuals_are_the_fp32_step_with_its_residuals_rounded(compressor, target, kernel):
    """residual_dtype bf16 is exactly the fp32 algorithm with the residuals rounded to
    bf16 between steps: results, M and kept residuals bitwise those of an fp32 reducer
    whose residuals are rounded before each step (2 ranks, chunks, the momentum's fused
    and torch passes). So the only error it adds is the rounding, at most 2^-8 of each
    residual entry (bf16 keeps 8 significant bits, round to nearest; an fp32 value in
    bf16's subnormal range is below 2^-126 and rounds within 2^-134: the max over
    (|rounded - r| - 2^-8 |r|) is then <= 2^-134), which error feedback drops."""
    ranks = run_ranks(_bf16_residual_rank, world_size=2, args=(compressor, target, kernel))
    for r in ranks:
        assert r["differ"] == [] and r["keys"] > 1, r
        assert r["worst"] <= 2.0 ** -134, r


def _fused_momentum_rank(dtype):
    """4 steps of target momentum through sign (2 dense warm-up steps, then momentum),
    counting the codec's momentum encodings; returns the calls, the chunks, M and the
    gradients after the last step."""
    import torch.distributed as tdist
    from ds_ext.comm.reducer import GradientReducer
    world = tdist.get_world_size()
    reducer = GradientReducer(_section(compressor="sign", target="momentum", warmup_steps=2, min_numel=1000,
                                       chunk_mb=0.125, pipeline_depth=2), node_of=[0] * world)
    reducer.beta1 = 0.9
    codec, calls = reducer.compressor.codec, []
    encode_momentum = codec.encode_momentum

    def counted(*a, **kw):
        calls.append(reducer.steps)
        return encode_momentum(*a, **kw)
    codec.encode_momentum = counted
    shapes = [(256, 300), (5000,), (300, 257)]
    for step in range(4):
        grads = [g.to(dtype) for g in _grads(tdist.get_rank(), shapes, seed=step)]
        reducer.begin_step()
        reducer.reduce(grads, group=tdist.group.WORLD, divide_by=world, key="dense")
        reducer.end_step()
    chunks = math.ceil(sum(math.prod(s) for s in shapes) / reducer.chunk_numel)
    m = reducer.momentum_tensor(("dense", "compressed"))
    return {"calls": calls, "chunks": chunks, "m_dtype": str(m.dtype), "grad_dtype": str(grads[0].dtype),
            "m": m.clone(), "grads": torch.cat([g.reshape(-1).float() for g in grads])}


@pytest.mark.multirank
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_target_momentum_is_formed_in_the_codecs_pass_and_kept_in_fp32(dtype):
    """With target momentum the two-phase compressor forms b1 M + (1 - b1) x g in its
    encoding pass (one encode_momentum a chunk on each momentum step, none in the dense
    warm-up), and M stays unrounded when the gradients are bf16 (kept as the codes, which
    decode to the fp32 mean): the gradients get the mean momentum rounded to their dtype,
    M does not (bf16's 8 bits of mantissa would otherwise be what the next step's momentum
    starts from)."""
    from ds_ext.comm.compressors import TwoPhase
    assert TwoPhase.fuses_momentum
    for r in run_ranks(_fused_momentum_rank, world_size=2, args=(dtype,)):
        assert r["calls"] == [2] * r["chunks"] + [3] * r["chunks"], r["calls"]
        assert r["m_dtype"] == "torch.float32" and r["grad_dtype"] == str(dtype)
        m, grads = torch.as_tensor(r["m"]), torch.as_tensor(r["grads"])
        torch.testing.assert_close(grads, m.to(dtype).float(), rtol=0, atol=0)
        if dtype == torch.bfloat16:
            assert (m != m.to(dtype).float()).float().mean() > 0.5     # M holds more than bf16 does

"""The MoE layer's two token dispatchers (recipes/layers/dispatch.py) on 4 gloo ranks,
one DeepSeekMoE layer per rank with the same weights, each rank its own tokens, the
same output gradient given to both dispatchers:

- top-2 (tiny-moe's routing) at expert parallelism 2 and 4, fp32, bf16 and the fp8
  payload, top-8 of 32 experts at expert parallelism 1, and top-2 with every token
  choosing the first rank's experts (the other ranks receive no rows): the dispatchers' outputs,
  input gradients and every parameter gradient are bitwise equal (with at most two
  copies per token, or one rank, a token's sum is the same floating-point operations in
  every association); at expert parallelism 4 also deduplicated with the group taken as
  2 nodes x 2 ranks, forwarding inside the node (both hops seen running);
- top-8 of 32 experts, 4 groups of which 2 chosen (V3's routing shape) at expert
  parallelism 4: the expert and router gradients are bitwise equal (each copy's
  gradient is the same product in both), the outputs differ only by the association of
  a token's sum of k weighted expert outputs: each association is within
  gamma(k - 1) sum_i |w_i y_i| of the exact sum (tests/numerics.py), so the two are
  within twice that (deduplicated and forwarded alike);
- what crosses to other ranks, counted by ``wire_bytes`` and checked against the
  routing: every-copy moves each away copy twice (dispatch and combine), deduplicated
  each (token, destination rank) row twice, the dispatched row with min(k, the rank's
  experts) routing slots of 6 bytes, forwarded each (token, destination node) row; fp8
  rows of 128 codes and a scale;
- FP8 rows against ds_ext/comm/fp8.py's derived error bound; node-limited routing's
  bound on the nodes a token reaches, and the layouts it refuses; bad settings refused.
Multi-rank; about 20 s on 2 cores.
"""

import pytest
import torch

from tests.distributed import run_ranks
from tests.numerics import BF16, gamma

TOKENS, HIDDEN, INTER = 24, 128, 32       # hidden a multiple of 128: the fp8 payload's tiles
TOP2 = dict(n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2)
TOP8 = dict(n_routed_experts=32, num_experts_per_tok=8, n_group=4, topk_group=2)


def _layer(routing, *, dispatcher, ep, ep_rank, group, dtype, payload=None):
    from recipes import deepseek_v3
    from recipes.layers.dispatch import Dispatch
    from recipes.layers.moe import DeepSeekMoE
    routing = dict(routing)
    favour = routing.pop("favour", None)
    config = deepseek_v3.make_config("tiny-moe", {"hidden_size": HIDDEN, "moe_intermediate_size": INTER, **routing})
    layer = DeepSeekMoE(config, ep_size=ep, ep_rank=ep_rank, dispatch=Dispatch(dispatcher, payload),
                        experts_impl="loop")
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if "deepspeed_moe" not in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    layer.init_experts(seed=3, std=0.2)
    if favour is not None:
        # a selection bias no score can beat: every token chooses among these experts
        layer.gate.e_score_correction_bias[favour] = 100.0
    layer.ep_group = group
    return layer.to(dtype).train()


def _run(layer, x, grad):
    x = x.clone().requires_grad_(True)
    out = layer(x)
    out.backward(grad)
    # as fp32 (exact for bf16 values): the results travel back as numpy arrays
    return out.detach().float(), x.grad.float(), {n: p.grad.float() for n, p in layer.named_parameters()}


class _Labels:
    """ds_ext.comm.alltoall's recorder: the labels of the exchanges issued, and the bytes
    a row of each takes on the wire."""

    def __init__(self):
        self.seen, self.row_bytes = set(), {}

    def record(self, name, kwargs, start, end):
        self.seen.add(kwargs["what"])
        if "row_bytes" in kwargs:
            self.row_bytes[kwargs["what"]] = kwargs["row_bytes"]


def _groups(ep):
    from deepspeed import comm as dist
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = None
    for first in range(0, world, ep):
        g = dist.new_group(list(range(first, first + ep)))
        if first <= rank < first + ep:
            mine = g
    return mine, rank % ep


def _compare(routing, ep, dtype, payload=None):
    """Both dispatchers' results on this rank: (output, input grad, param grads) each."""
    from deepspeed import comm as dist
    from ds_ext.comm import alltoall
    group, ep_rank = _groups(ep) if ep > 1 else (None, 0)
    g = torch.Generator().manual_seed(100 + dist.get_rank())
    x = torch.randn(2, TOKENS // 2, HIDDEN, generator=g).to(dtype)
    grad = torch.randn(2, TOKENS // 2, HIDDEN, generator=g).to(dtype)
    out = {}
    for name in ("every-copy", "deduplicated"):
        layer = _layer(routing, dispatcher=name, ep=ep, ep_rank=ep_rank, group=group, dtype=dtype, payload=payload)
        out[name] = _run(layer, x, grad)
    if ep == 4:
        # the group as 2 nodes x 2 ranks: deduplicated forwards inside the node
        from recipes.layers.dispatch import make_node_hops
        hops = make_node_hops([[0, 1, 2, 3]], [0, 0, 1, 1], new_group=dist.new_group)[(0, 1, 2, 3)]
        layer = _layer(routing, dispatcher="deduplicated", ep=ep, ep_rank=ep_rank, group=group, dtype=dtype,
                       payload=payload)
        layer.node_hops = hops[ep_rank]
        lanes = _Labels()
        with alltoall.recording(lanes):
            out["forwarded"] = _run(layer, x, grad)
        out["forwarded_exchanges"] = sorted(lanes.seen)
        out["forwarded_row_bytes"] = lanes.row_bytes
    # sum_i w_i |y_i| per token (the weights are positive): the every-copy layer with its
    # experts' outputs taken absolute
    layer = _layer(routing, dispatcher="every-copy", ep=ep, ep_rank=ep_rank, group=group, dtype=dtype)
    run = layer._run_experts
    layer._run_experts = lambda rows, counts: run(rows, counts).abs()
    layer.shared_mlp.forward = lambda h: torch.zeros_like(h)
    with torch.no_grad():
        out["abs_sum"] = layer(x).float()
    return out


def _rank(cases):
    return {key: _compare(*case) for key, case in cases.items()}


def _cases():
    return {"top2-ep2-fp32": (TOP2, 2, torch.float32), "top2-ep4-fp32": (TOP2, 4, torch.float32),
            "top2-ep4-bf16": (TOP2, 4, torch.bfloat16), "top2-ep4-fp8": (TOP2, 4, torch.bfloat16, "fp8"),
            "top8-ep1-fp32": (TOP8, 1, torch.float32),
            # every token to the first rank's experts: the others receive no rows (and node 1
            # forwards none)
            "top2-ep2-skewed": (dict(TOP2, favour=[0, 1, 2, 3]), 2, torch.float32),
            "top2-ep4-skewed": (dict(TOP2, favour=[0, 1]), 4, torch.float32),
            "top8-ep4-fp32": (TOP8, 4, torch.float32), "top8-ep4-bf16": (TOP8, 4, torch.bfloat16)}


@pytest.fixture(scope="module")
def results():
    return run_ranks(_rank, world_size=4, args=(_cases(),))


def _bitwise(a, b, what):
    import numpy as np
    assert np.array_equal(a[0], b[0]), f"{what}: outputs differ"
    assert np.array_equal(a[1], b[1]), f"{what}: input gradients differ"
    assert set(a[2]) == set(b[2])
    for name in a[2]:
        assert np.array_equal(a[2][name], b[2][name]), f"{what}: gradient of {name} differs"


@pytest.mark.multirank
@pytest.mark.parametrize("key", ["top2-ep2-fp32", "top2-ep4-fp32", "top2-ep4-bf16", "top2-ep4-fp8", "top8-ep1-fp32",
                                 "top2-ep2-skewed", "top2-ep4-skewed"])
def test_dispatchers_bitwise_equal_where_the_sums_associate_alike(results, key):
    for rank, res in enumerate(results):
        _bitwise(res[key]["every-copy"], res[key]["deduplicated"], f"{key} rank {rank}")
        if "forwarded" in res[key]:
            _bitwise(res[key]["every-copy"], res[key]["forwarded"], f"{key} forwarded, rank {rank}")
            # both hops ran, forward and backward
            assert {"F dispatch", "F dispatch in-node", "B combine in-node", "B combine"} <= \
                set(res[key]["forwarded_exchanges"]), res[key]["forwarded_exchanges"]
            # a row on each hop: its payload, 2 routing slots (top-2), inside the node also its
            # origin; FP8 rows go on inside the node as they crossed (not decoded)
            from ds_ext.comm import fp8
            from ds_ext.comm.alltoall import ORIGIN_BYTES, slot_bytes
            payload = fp8.row_bytes(HIDDEN) if key.endswith("fp8") else HIDDEN * (2 if "bf16" in key else 4)
            routing = 2 * slot_bytes(TOP2["n_routed_experts"])
            assert res[key]["forwarded_row_bytes"]["F dispatch"] == payload + routing
            assert res[key]["forwarded_row_bytes"]["F dispatch in-node"] == payload + routing + ORIGIN_BYTES


@pytest.mark.multirank
@pytest.mark.parametrize("key,unit", [("top8-ep4-fp32", "fp32"), ("top8-ep4-bf16", "bf16")])
def test_top8_across_ranks_differs_only_by_the_sums_association(results, key, unit):
    import numpy as np
    k = TOP8["num_experts_per_tok"]
    dtype = np.float32 if unit == "fp32" else BF16
    differed = 0
    for rank, res in enumerate(results):
        for other in ("deduplicated", "forwarded"):
            a, b = res[key]["every-copy"], res[key][other]
            for name in a[2]:
                if "deepspeed_moe" in name or name.startswith("gate."):
                    assert np.array_equal(a[2][name], b[2][name]), f"{key} {other} rank {rank}: gradient of {name} differs"
            # each association is within gamma(k - 1) S of the exact sum, S = sum_i |w_i y_i|
            # (in bf16 each weighted term is rounded to bf16 alike in both, then added in
            # bf16); S is computed in the case's dtype with k roundings, so S <= S_computed /
            # (1 - gamma(k)); the layer then adds the shared expert, one more rounding of
            # each side: |fl(a + s) - fl(b + s)| <= |a - b| + u (|out_a| + |out_b|)
            u = gamma(1, dtype)
            s = np.asarray(res[key]["abs_sum"], dtype=np.float64) / (1 - gamma(k, dtype))
            out_a, out_b = np.asarray(a[0], dtype=np.float64), np.asarray(b[0], dtype=np.float64)
            bound = 2 * gamma(k - 1, dtype) * s + u * (np.abs(out_a) + np.abs(out_b))
            err = np.abs(out_a - out_b)
            assert (err <= bound).all(), f"{key} {other} rank {rank}: worst {err.max():.3e} over its bound {bound.max():.3e}"
            differed += int((err > 0).sum())
    # the associations really differ somewhere (else the bitwise test above covers it)
    assert differed > 0


def test_wire_bytes_follow_the_routing():
    from recipes.layers.dispatch import Dispatch, wire_bytes
    idx = torch.tensor([[0, 1], [0, 2], [1, 3], [2, 3]])      # 4 experts on 2 ranks (0, 1 | 2, 3)
    kw = dict(hidden=4, element_size=2, num_experts=4, ep_size=2, counted=[False, True])
    every = wire_bytes(Dispatch("every-copy"), idx, **kw)
    dedup = wire_bytes(Dispatch("deduplicated"), idx, **kw)
    # away copies: 2 (token 1), 3 (token 2), 2 and 3 (token 3) -> 4 copies, 3 rows
    assert every == {"dispatch": 4 * 8, "combine": 4 * 8, "copies_out": 4, "rows_out": 4}
    # each deduplicated row carries min(k, 2 experts a rank) = 2 slots of fp32 weight + int16 expert
    assert dedup == {"dispatch": 3 * (8 + 2 * 6), "combine": 3 * 8, "copies_out": 4, "rows_out": 3}
    # 8 experts on 4 ranks of 2 nodes (ranks 0, 1 | 2, 3), counted from rank 0 to node 1:
    # forwarded, a token crosses once per node; an fp8 row at hidden 128 is 128 codes and
    # a 4-byte scale
    idx = torch.tensor([[4, 6], [4, 5], [0, 7], [1, 2]])
    kw = dict(hidden=128, element_size=2, num_experts=8, ep_size=4, counted=[False, False, True, True])
    direct = wire_bytes(Dispatch("deduplicated"), idx, **kw)
    forwarded = wire_bytes(Dispatch("deduplicated", "fp8"), idx, node_of=[0, 0, 1, 1], **kw)
    # copies to node 1: 4, 6 | 4, 5 | 7 -> 5; rows to ranks 2, 3: (2, 3) | 2 | 3 -> 4; to node 1: 3;
    # a row's slots: min(top-2, 2 experts a rank) = 2, to a node min(2, 4) = 2
    assert direct == {"dispatch": 4 * (256 + 2 * 6), "combine": 4 * 256, "copies_out": 5, "rows_out": 4}
    assert forwarded == {"dispatch": 3 * (132 + 2 * 6), "combine": 3 * 256, "copies_out": 5, "rows_out": 3}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fp8_rows_within_their_derived_bound(dtype):
    """decode(encode(x)) against x on rows with a wide dynamic range (tiles of 1e-6 to
    1e3, an all-zero tile, signed): inside ds_ext/comm/fp8.py's elementwise bound, and
    the bound is not loose by orders of magnitude (its worst ratio is used)."""
    import numpy as np
    from ds_ext.comm import fp8
    from tests.numerics import assert_within
    g = torch.Generator().manual_seed(0)
    x = torch.randn(16, 512, generator=g) * torch.logspace(-6, 3, 16).unsqueeze(1)
    x[3, 128:256] = 0.0
    x = x.to(dtype)
    raw = fp8.encode(x)
    assert raw.dtype == torch.uint8 and raw.shape == (16, fp8.row_bytes(512))
    back = fp8.decode(raw, dtype=dtype)
    assert back.dtype == dtype and torch.equal(back[3, 128:256], x[3, 128:256])
    used = assert_within(back.double().numpy(), x.double().numpy(), fp8.error_bound(x, dtype=dtype).numpy(),
                         what=f"fp8 round trip ({dtype})")
    assert used > 0.25, used          # the worst element uses a fair part of its bound
    assert np.isfinite(back.float().numpy()).all()


def test_bad_dispatch_settings_are_refused_in_one_line():
    from types import SimpleNamespace

    from ds_ext.errors import ConfigError
    from ds_ext.precision import check_dispatch_dtype
    from recipes.layers.dispatch import Dispatch
    with pytest.raises(ConfigError, match=r"seekspeed.moe.dispatcher 'all' is unknown: use one of"):
        Dispatch("all").check(hidden_size=128)
    with pytest.raises(ConfigError, match=r"hidden_size 96 is not a multiple of 128"):
        Dispatch(payload="fp8").check(hidden_size=96)
    bf16 = {"bf16": {"enabled": True}}
    with pytest.raises(ConfigError, match=r"seekspeed.moe.dispatch_dtype 'fp16': .* activation dtype \(bf16\) or fp8"):
        check_dispatch_dtype(bf16, SimpleNamespace(dispatch_dtype="fp16"))
    assert check_dispatch_dtype(bf16, SimpleNamespace(dispatch_dtype="bf16")) is None
    assert check_dispatch_dtype({}, SimpleNamespace(dispatch_dtype="fp8")) == "fp8"
    with pytest.raises(ConfigError, match=r"activation dtype \(fp32\)"):
        check_dispatch_dtype({}, SimpleNamespace(dispatch_dtype="bf16"))


def test_node_limited_routing_bounds_the_nodes_a_token_reaches():
    """V3's group-limited routing (4 groups of 8 of 32 experts, 2 groups per token) on
    expert-parallel groups laid out over nodes: where each group's experts lie on one
    node, no token reaches more than topk_group nodes (checked on a random router's
    choices for 512 tokens); a layout whose groups straddle nodes is refused in one line
    naming n_group and the fix."""
    from ds_ext.errors import ConfigError
    from recipes import deepseek_v3
    from recipes.layers.dispatch import check_node_limited
    from recipes.layers.moe import TopkRouter
    config = deepseek_v3.make_config("tiny-moe", {"hidden_size": HIDDEN, **TOP8})
    router = TopkRouter(config)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=g))
    _, indices = router(torch.randn(512, HIDDEN, generator=g))
    for ranks, nodes in ((4, [0, 1, 2, 3]), (8, [0, 0, 1, 1, 2, 2, 3, 3]), (8, [0, 0, 0, 0, 1, 1, 1, 1]),
                         (4, [0, 0, 1, 1])):
        bound = check_node_limited(router, group_nodes=nodes)
        assert bound == min(TOP8["topk_group"], len(set(nodes)))
        node = torch.tensor(nodes)[indices // (TOP8["n_routed_experts"] // ranks)]          # [T, k]
        reached = max(len(set(row.tolist())) for row in node)
        assert reached <= bound, (nodes, reached)
    with pytest.raises(ConfigError, match=r"^node-limited routing: n_group 4 makes groups of 8 experts, and group 0 "
                                          r"lies on nodes \[0, 1\] .* make n_group a multiple of 8"):
        check_node_limited(router, group_nodes=list(range(8)))

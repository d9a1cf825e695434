"""Token dispatchers of the MoE layer: how a micro-batch's routed copies reach the
ranks holding their experts, and how the experts' outputs come back.

A token routed to k experts is k copies (token, expert, weight). Both dispatchers run
the experts on the same rows in the same layout (grouped by source rank, then by local
expert, then by token), so the experts compute bitwise the same outputs; they differ in
what crosses the network:

- ``"every-copy"``: every copy travels, in the activation dtype, and every weighted
  expert output comes back; the source rank adds a token's k outputs in expert order.
- ``"deduplicated"``: a token travels once to each rank holding at least one of its
  experts (with, per copy, its weight and its row: 8 bytes), the receiving rank
  gathers one input row per copy, applies the weights, adds the outputs of the token's
  local experts (in expert order) and sends one row back, which the source adds in
  rank order. With top-k over E experts on P ranks a token crosses to at most
  min(k, P) ranks instead of k.

Sums. A token's output is the sum of its k weighted expert outputs. every-copy adds
them one at a time in expert order: ((0 + y1) + y2) + ... . deduplicated adds each
rank's share first and then the shares, in the same expert order: the same sum
associated by rank. With expert parallelism 1, or at most two copies per token
(top-2), or at most one copy per token on each rank, the two associations are the same
floating-point operations, and the dispatchers agree bitwise (forward and backward);
otherwise they differ by rounding, bounded by the usual |error| <= (k - 1) u sum |w_i y_i|
for each association (u the dtype's unit roundoff). The same holds for the input
gradient, a sum over the same copies. The expert-parallel-degree invariance of the
layer (test_expert_parallel.py) holds for deduplicated where the two associations agree.

Payload (``Dispatch.payload``): the activation dtype, or "fp8": the dispatched rows as
e4m3 with an fp32 scale per 128 channels (ds_ext/comm/fp8.py, its error bound there),
decoded on arrival; the routing, the combine and the backward stay in their own dtypes,
as DeepSeek-V3 does.

Both keep the asynchronous structure ds_ext.comm.alltoall gives: the counts exchange,
then the dispatch in flight while the shared expert computes (or, interleaved with
another micro-batch's half, ds_ext.pipe.overlap, behind that half), the combine after
the experts; the backward runs the reverse exchanges.
"""

from dataclasses import dataclass

import torch

from ds_ext.comm import alltoall, fp8
from ds_ext.errors import ConfigError
from ds_ext.pipe.overlap import interleaving

DISPATCHERS = ("deduplicated", "every-copy")
PAYLOADS = (None, "fp8")        # None: the activation dtype

# deduplicated's per-copy routing travels as fp32 (weight, row): a row index is exact in
# fp32 below 2**24
_MAX_ROWS = 2**24


@dataclass(frozen=True)
class Dispatch:
    """A MoE layer's dispatch: the dispatcher (``seekspeed.moe.dispatcher``) and the
    payload of the dispatched rows (``seekspeed.moe.dispatch_dtype``: None for the
    activation dtype, or "fp8")."""
    name: str = "deduplicated"
    payload: str | None = None

    def check(self, *, hidden_size, device="cpu"):
        if self.name not in DISPATCHERS:
            raise ConfigError(f"seekspeed.moe.dispatcher {self.name!r} is unknown: use one of {list(DISPATCHERS)}")
        if self.payload not in PAYLOADS:
            raise ConfigError(f"seekspeed.moe.dispatch_dtype {self.payload!r} is not one this layer sends: leave it "
                              f"unset (the activation dtype) or set \"fp8\"")
        if self.payload == "fp8":
            if hidden_size % fp8.BLOCK:
                raise ConfigError(f"seekspeed.moe.dispatch_dtype \"fp8\" scales every {fp8.BLOCK} channels and "
                                  f"hidden_size {hidden_size} is not a multiple of {fp8.BLOCK}: leave dispatch_dtype "
                                  f"unset or use a hidden size divisible by {fp8.BLOCK}")
            why = fp8.unsupported(device)
            if why:
                raise ConfigError(f"seekspeed.moe.dispatch_dtype \"fp8\" needs float8_e4m3fn here and {why}: leave "
                                  f"dispatch_dtype unset or use a torch build with float8 support")

    def codec(self, dtype):
        return fp8.Fp8Rows(dtype) if self.payload == "fp8" else None

    def row_bytes(self, hidden, element_size):
        return fp8.row_bytes(hidden) if self.payload == "fp8" else hidden * element_size


DEFAULT_DISPATCH = Dispatch()


def dispatch_and_combine(dispatch, flat, weights, indices, *, experts, shared, num_experts, ep_size, group):
    """The routed experts' weighted sum for each row of ``flat`` [T, H] (``weights``,
    ``indices`` [T, k] from the router), moved as ``dispatch`` (a Dispatch) says, plus
    ``shared()``, the shared expert's output, computed while the dispatch is in flight. ``experts(rows, counts)`` runs this rank's
    experts on rows grouped by source rank, then by local expert, ``counts[source][j]``
    rows each. Returns (routed [T, H], shared's output)."""
    run = _every_copy if dispatch.name == "every-copy" else _deduplicated
    return run(flat, weights, indices, experts=experts, shared=shared, num_local=num_experts // ep_size,
               ep_size=ep_size, group=group, codec=dispatch.codec(flat.dtype))


def _by_expert(indices):
    """The copies sorted by expert (stable, so by destination rank, then by expert, then
    by token): (order into the flattened [T * k] copies, each copy's token)."""
    k = indices.shape[1]
    order = torch.argsort(indices.reshape(-1), stable=True)
    return order, order // k


def _every_copy(flat, weights, indices, *, experts, shared, num_local, ep_size, group, codec):
    order, token_of = _by_expert(indices)
    per_expert = torch.bincount(indices.reshape(-1), minlength=num_local * ep_size)
    # Interleaved with another micro-batch's half (ds_ext/pipe/overlap.py), the counts
    # exchange (a few bytes, but queued behind whatever the link still carries) and the
    # dispatch each run behind that half, the shared expert before the counts are needed;
    # alone, the shared expert covers the dispatch. Autograd adds the input's gradients
    # in the same order either way.
    interleaved = interleaving()
    counts = alltoall.start(per_expert, out_splits=[num_local] * ep_size, in_splits=[num_local] * ep_size,
                            group=group, label="F counts")
    sent = flat[token_of]
    if interleaved:
        out_shared = shared()
    counts = counts.wait().view(ep_size, num_local)        # [source, local expert] counts
    send_splits = per_expert.view(ep_size, -1).sum(1).tolist()
    recv_splits = counts.sum(1).tolist()
    route = dict(out_splits=recv_splits, in_splits=send_splits, group=group, label="dispatch", codec=codec)
    slot = alltoall.Slot()
    received = alltoall.dispatch(sent, slot, **route)
    if not interleaved:
        out_shared = shared()
    received = alltoall.arrive(received, slot, **route)
    outputs = experts(received, counts.tolist())
    back = dict(out_splits=send_splits, in_splits=recv_splits, group=group, label="combine")
    slot = alltoall.Slot()
    outputs = alltoall.arrive(alltoall.dispatch(outputs, slot, **back), slot, **back)
    scale = weights.reshape(-1)[order].unsqueeze(-1)
    routed = torch.zeros_like(flat).index_add(0, token_of, (outputs * scale).to(flat.dtype))
    return routed, out_shared


def _rows(indices, order, token_of, *, num_local, ep_size):
    """deduplicated's send plan: one row per (destination rank, token) that has a copy
    there, destinations ascending and tokens ascending within each. Returns (each
    row's token, rows per destination [P], each copy's row within its destination's
    rows, in ``order``)."""
    tokens = indices.shape[0]
    dest = indices.reshape(-1)[order] // num_local
    keys, row_of_copy = torch.unique(dest * tokens + token_of, sorted=True, return_inverse=True)
    rows_to = torch.bincount(keys // tokens, minlength=ep_size)
    first_row = rows_to.cumsum(0) - rows_to
    return keys % tokens, rows_to, row_of_copy - first_row[dest]


def _deduplicated(flat, weights, indices, *, experts, shared, num_local, ep_size, group, codec):
    tokens = flat.shape[0]
    if tokens >= _MAX_ROWS:
        raise ValueError(f"the deduplicated dispatcher carries row indices as fp32, exact below {_MAX_ROWS} rows; "
                         f"this micro-batch has {tokens} tokens per rank: use a smaller micro-batch or "
                         f"seekspeed.moe.dispatcher \"every-copy\"")
    order, token_of = _by_expert(indices)
    per_expert = torch.bincount(indices.reshape(-1), minlength=num_local * ep_size).view(ep_size, num_local)
    row_token, rows_to, copy_row = _rows(indices, order, token_of, num_local=num_local, ep_size=ep_size)
    interleaved = interleaving()       # as in _every_copy
    header = torch.cat([per_expert, rows_to.unsqueeze(1)], dim=1)    # per destination: copies per expert, rows
    width = num_local + 1
    counts = alltoall.start(header.reshape(-1), out_splits=[width] * ep_size, in_splits=[width] * ep_size,
                            group=group, label="F counts")
    sent = flat[row_token]
    scale = weights.reshape(-1)[order]
    routing = torch.stack([scale, copy_row.to(scale.dtype)], dim=1)        # [copies, 2]: (weight, row)
    if interleaved:
        out_shared = shared()
    header = counts.wait().view(ep_size, width)
    counts, rows_in = header[:, :num_local], header[:, num_local]
    copies_in = counts.sum(1)
    rows = dict(out_splits=rows_in.tolist(), in_splits=rows_to.tolist(), group=group, label="dispatch", codec=codec)
    copies = dict(out_splits=copies_in.tolist(), in_splits=per_expert.sum(1).tolist(), group=group,
                  label="dispatch routing")
    row_slot, copy_slot = alltoall.Slot(), alltoall.Slot()
    received = alltoall.dispatch(sent, row_slot, **rows)
    routing = alltoall.dispatch(routing, copy_slot, **copies)
    if not interleaved:
        out_shared = shared()
    received = alltoall.arrive(received, row_slot, **rows)
    routing = alltoall.arrive(routing, copy_slot, **copies)
    # each copy's row among all received rows: its row within its source's rows plus the
    # rows of the sources before it
    first_row = rows_in.cumsum(0) - rows_in
    source = torch.repeat_interleave(torch.arange(ep_size, device=copies_in.device), copies_in)
    row = routing[:, 1].detach().long() + first_row[source]
    outputs = experts(received[row], counts.tolist())
    weighted = (outputs * routing[:, :1]).to(flat.dtype)
    partial = torch.zeros_like(received).index_add(0, row, weighted)
    back = dict(out_splits=rows_to.tolist(), in_splits=rows_in.tolist(), group=group, label="combine")
    slot = alltoall.Slot()
    partial = alltoall.arrive(alltoall.dispatch(partial, slot, **back), slot, **back)
    routed = torch.zeros_like(flat).index_add(0, row_token, partial)
    return routed, out_shared


def check_node_limited(router, *, group_nodes):
    """Group-limited routing (``n_group`` groups of consecutive experts, ``topk_group``
    of them chosen per token) bounds the nodes a token reaches to ``topk_group`` when
    each group's experts lie on one node. ``group_nodes``: the node of each rank of the
    expert-parallel group, in group order (rank j holds experts [j E/P, (j+1) E/P)).
    Returns the bound on nodes per token; a group that straddles nodes is refused."""
    experts, groups, ranks = router.num_experts, router.n_group, len(group_nodes)
    nodes = len(set(group_nodes))
    if groups <= 1 or nodes <= 1:
        return nodes
    local, per_group = experts // ranks, experts // groups
    for g in range(groups):
        spans = sorted({group_nodes[e // local] for e in range(g * per_group, (g + 1) * per_group)})
        if len(spans) > 1:
            raise ConfigError(f"node-limited routing: n_group {groups} makes groups of {per_group} experts, and "
                              f"group {g} lies on nodes {spans} of the {nodes} nodes this expert-parallel group of "
                              f"{ranks} ranks spans, so a token could reach more than topk_group {router.topk_group} "
                              f"nodes: make n_group a multiple of {nodes}, place the expert-parallel group on fewer "
                              f"nodes, or set n_group 1 (no node limit)")
    return min(router.topk_group, nodes)


def wire_bytes(dispatch, indices, *, hidden, element_size, num_experts, ep_size, counted):
    """What one rank sends to the ranks ``counted`` marks (a bool per rank of the
    expert-parallel group: e.g. those on other nodes) for one forward dispatch and its
    combine under ``dispatch`` (a Dispatch), counted from its routing ``indices`` [T, k]:
    {"dispatch": bytes, "combine": bytes, "copies_out": copies sent there, "rows_out":
    rows sent there}. The counts exchange (a few integers per rank) is left out."""
    dest = indices // (num_experts // ep_size)                               # [T, k]
    far = torch.as_tensor(counted, dtype=torch.bool)
    copies_out = int(far[dest].sum())
    row, back = dispatch.row_bytes(hidden, element_size), hidden * element_size
    if dispatch.name == "every-copy":
        return {"dispatch": copies_out * row, "combine": copies_out * back, "copies_out": copies_out,
                "rows_out": copies_out}
    hit = torch.zeros(indices.shape[0], ep_size, dtype=torch.bool)
    hit.scatter_(1, dest, True)
    rows_out = int((hit & far).sum())
    return {"dispatch": rows_out * row + copies_out * 8, "combine": rows_out * back, "copies_out": copies_out,
            "rows_out": rows_out}

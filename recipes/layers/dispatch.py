"""Token dispatchers of the MoE layer: how a micro-batch's routed copies reach the
ranks holding their experts, and how the experts' outputs come back.

A token routed to k experts is k copies (token, expert, weight). Both dispatchers run
the experts on the same rows in the same layout (grouped by source rank, then by local
expert, then by token), so the experts compute bitwise the same outputs; they differ in
what crosses the network:

- ``"every-copy"``: every copy travels, in the activation dtype, and every weighted
  expert output comes back; the source rank adds a token's k outputs in expert order.
- ``"deduplicated"``: a token travels once to each rank holding at least one of its
  experts, its routing in the same exchange (min(k, the rank's experts) slots of an fp32
  weight and an int16 expert index, as DeepEP sends top-k indices and weights beside the
  row), the receiving rank gathers one input row per copy, applies the weights, adds the outputs of the
  token's local experts (in expert order) and sends one row back, which the source adds
  in rank order. With top-k over E experts on P ranks a token crosses to at most
  min(k, P) ranks instead of k. Where the expert-parallel group spans nodes of several
  ranks each (``NodeHops``), a token crosses to each node once, to the rank with the
  sender's local index there, which forwards it inside the node to the ranks holding
  its experts and adds what they send back (in local-rank order) before one row returns
  across the nodes: DeepEP's scheme on torch.distributed collectives (NCCL on GPUs,
  gloo here).

Sums. A token's output is the sum of its k weighted expert outputs. every-copy adds
them one at a time in expert order: ((0 + y1) + y2) + ... . deduplicated adds each
rank's share first and then the shares (forwarded: the ranks' shares inside a node,
then the nodes'), in the same expert order: the same sum associated by rank (and
node). With expert parallelism 1, or at most two copies per token (top-2), or at most
one copy per token on each rank (and node), the associations are the same
floating-point operations, and the dispatchers agree bitwise (forward and backward);
otherwise they differ by rounding, each association within gamma(k - 1) sum |w_i y_i|
of the exact sum (tests/numerics.py). The same holds for the input
gradient, a sum over the same copies. The expert-parallel-degree invariance of the
layer (test_expert_parallel.py) holds for deduplicated where the two associations agree.

Payload (``Dispatch.payload``): the activation dtype, or "fp8": the dispatched rows as
e4m3 with an fp32 scale per 128 channels (ds_ext/comm/fp8.py, its error bound there),
decoded where the experts run (a forwarder sends the bytes on as they came); the routing, the combine and the backward stay in their own dtypes,
as DeepSeek-V3 does.

Both keep the asynchronous structure ds_ext.comm.alltoall gives, three exchanges a hop
forward and two backward: the counts exchange, then the dispatch in flight while the shared expert computes (or, interleaved with
another micro-batch's half, ds_ext.pipe.overlap, behind that half), the combine after
the experts; the backward runs the reverse exchanges.
"""

import functools
from dataclasses import dataclass

import torch

from ds_ext.comm import alltoall, fp8
from ds_ext.comm.alltoall import expert_id_dtype, slot_bytes
from ds_ext.errors import ConfigError
from ds_ext.pipe.overlap import interleaving
from ds_ext.sections import MOE_DISPATCHERS as DISPATCHERS
PAYLOADS = (None, "fp8")        # None: the activation dtype

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


def dispatch_and_combine(dispatch, flat, weights, indices, *, experts, shared, num_experts, ep_size, group,
                         hops=None):
    """The routed experts' weighted sum for each row of ``flat`` [T, H] (``weights``,
    ``indices`` [T, k] from the router), moved as ``dispatch`` (a Dispatch) says, plus
    ``shared()``, the shared expert's output, computed while the dispatch is in flight.
    ``experts(rows, counts)`` runs this rank's experts on rows grouped by source rank,
    then by local expert, ``counts[source][j]`` rows each. ``hops``: NodeHops when the
    group spans nodes of several ranks (the deduplicated dispatcher then forwards inside
    the node). Returns (routed [T, H], shared's output)."""
    kw = dict(experts=experts, shared=shared, num_local=num_experts // ep_size, ep_size=ep_size, group=group,
              codec=dispatch.codec(flat.dtype))
    if dispatch.name == "every-copy":
        return _every_copy(flat, weights, indices, **kw)
    return _deduplicated(flat, weights, indices, hops=hops, **kw)


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
    sent = flat.index_select(0, token_of)
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


def _deduplicated(flat, weights, indices, *, experts, shared, num_local, ep_size, group, codec, hops=None):
    """One hop to the ranks holding the experts, or with ``hops`` (NodeHops: the group
    spans nodes of several ranks) two: each token once to every node holding one of its
    experts (to the rank with the sender's local index there, over the rail group),
    forwarded inside the node to the ranks holding them. The FP8 payload is encoded
    once, at the source: a forwarder keeps the bytes it receives and sends them on as
    they came, and the rank running the experts decodes them (DeepEP's scheme), so the
    experts see the same values either way."""
    top_k, id_dtype = indices.shape[1], expert_id_dtype(num_local * ep_size)
    final = functools.partial(_at_experts, experts=experts, num_local=num_local, ep_size=ep_size)
    rank = indices // num_local
    if hops is None:
        return _send_once(flat, weights, indices, rank, members=ep_size, slots=min(top_k, num_local),
                          id_dtype=id_dtype, group=group, codec=codec, inner=final, label="dispatch", shared=shared)
    node = torch.tensor(hops.node_of, device=rank.device)[rank]
    if codec is not None:
        codec = fp8.Fp8Rows(flat.dtype, keep=True)
    forward = functools.partial(_forwarder, hops=hops, num_local=num_local, top_k=top_k, id_dtype=id_dtype,
                                final=final, codec=codec)
    return _send_once(flat, weights, indices, node, members=hops.nodes, slots=min(top_k, num_local * hops.per_node),
                      id_dtype=id_dtype, group=hops.rail, codec=codec, inner=forward, label="dispatch", shared=shared)


@dataclass(frozen=True)
class NodeHops:
    """How a layer's expert-parallel group sits on nodes, for forwarding: ``nodes`` nodes
    of ``per_node`` ranks each; ``rail``: this rank's group of the ranks with its local
    index on every node (member j on node j); ``node``: its node's ranks (member l the
    local index l); ``node_of`` / ``local_of``: each expert-parallel rank's node and
    local index; ``ep_rank_of[node][local]``: the inverse; ``me``: this rank's
    expert-parallel rank."""
    nodes: int
    per_node: int
    rail: object
    node: object
    node_of: tuple
    local_of: tuple
    ep_rank_of: tuple
    me: int


def make_node_hops(group_ranks, node_of, *, new_group):
    """NodeHops for every expert-parallel group in ``group_ranks`` (each a list of global
    ranks in expert-parallel order; every rank passes the same lists, in the same order,
    since ``new_group`` is collective), keyed by the group's tuple of ranks; a group
    inside one node, with one rank per node, or with unequal ranks per node has none
    (the single-hop dispatch serves it)."""
    hops = {}
    for ranks in group_ranks:
        nodes = sorted({node_of[r] for r in ranks})
        members = {n: [i for i, r in enumerate(ranks) if node_of[r] == n] for n in nodes}
        per_node = len(members[nodes[0]])
        if len(nodes) < 2 or per_node < 2 or any(len(m) != per_node for m in members.values()):
            continue
        ep_rank_of = tuple(tuple(members[n]) for n in nodes)
        node_idx = {i: j for j, n in enumerate(nodes) for i in members[n]}
        local_idx = {i: members[n].index(i) for n in nodes for i in members[n]}
        rails = [new_group([ranks[ep_rank_of[j][lo]] for j in range(len(nodes))]) for lo in range(per_node)]
        inside = [new_group([ranks[i] for i in ep_rank_of[j]]) for j in range(len(nodes))]
        hops[tuple(ranks)] = [NodeHops(nodes=len(nodes), per_node=per_node, rail=rails[local_idx[i]],
                                       node=inside[node_idx[i]], node_of=tuple(node_idx[k] for k in range(len(ranks))),
                                       local_of=tuple(local_idx[k] for k in range(len(ranks))), ep_rank_of=ep_rank_of,
                                       me=i)
                              for i in range(len(ranks))]
    return hops


def _send_once(x, weight, expert, member, *, members, slots, id_dtype, group, codec, inner, label, shared=None,
               origin=None, encoded=None):
    """One hop. Row n of ``x`` [N, H] has copies ``expert`` [N, s] (global indices; -1:
    none) with routing ``weight`` [N, s] (differentiable) going to group members
    ``member`` [N, s] (``members`` where there is no copy); it is sent once to each
    member its copies go to, in one exchange with its routing: ``slots`` (the most copies
    a row can have on one member) pairs of (weight, expert), an empty slot's expert -1,
    and with ``origin`` [N, 2] (int32, set by a forwarder) the row's origin. On the
    member, ``inner(rows, weights, experts, source, order)`` ([R, H]; [R, slots] twice;
    [R] twice: the origin that came with the rows, else the member each came from and
    its place in arrival order) returns one output row per received row, which comes
    back. ``encoded``: ``x``'s rows as ``codec`` encoded them at their source (a
    forwarder's), sent as they are. Returns (per row of ``x`` the sum of what came back
    for it, in member order; ``shared()``'s output, computed while the dispatch is in
    flight, or None)."""
    n, device = x.shape[0], x.device
    goes = torch.zeros(n, members + 1, dtype=torch.bool, device=device).scatter_(1, member, True)
    goes = goes[:, :members].t()                                         # [members, N]
    rows_to = goes.sum(1)
    interleaved = interleaving()       # as in _every_copy
    header = alltoall.start(rows_to, out_splits=[1] * members, in_splits=[1] * members, group=group,
                            label="F counts")
    # the rows sent, by member then row; each copy's sent row, and its slot there (the
    # copies of a row to one member take its slots in their order)
    row_src = goes.nonzero(as_tuple=True)[1]
    place = goes.reshape(-1).cumsum(0).view(members, n) - 1
    sent_row = place[member.clamp(max=members - 1), torch.arange(n, device=device).unsqueeze(1)]
    slot = (member.unsqueeze(2) == member.unsqueeze(1)).tril(-1).sum(2)
    if origin is not None:
        kept = expert >= 0
        sent_row, slot, weight, expert = sent_row[kept], slot[kept], weight[kept], expert[kept]
    sent = x.index_select(0, row_src)
    if encoded is not None:
        codec = fp8.Fp8Rows(x.dtype, raw=encoded.index_select(0, row_src))
    routing_weight = weight.new_zeros(len(row_src), slots).index_put((sent_row, slot), weight)
    routing_expert = torch.full((len(row_src), slots), -1, dtype=id_dtype, device=device)
    routing_expert[sent_row, slot] = expert.to(id_dtype)
    extra = (routing_weight, routing_expert) if origin is None else (routing_weight, routing_expert, origin[row_src])
    out_shared = shared() if shared is not None and interleaved else None
    rows_in = header.wait()
    route = dict(out_splits=rows_in.tolist(), in_splits=rows_to.tolist(), group=group, label=label, codec=codec)
    hop = alltoall.Slot()
    received = alltoall.dispatch(sent, hop, extra=extra, **route)
    if shared is not None and not interleaved:
        out_shared = shared()
    rows, weight, expert, *came = alltoall.arrive(received, hop, **route)
    if came:
        source, order = came[0].long().unbind(1)
    else:
        source = torch.repeat_interleave(torch.arange(members, device=device), rows_in)
        order = torch.arange(rows.shape[0], device=device)
    back = dict(out_splits=rows_to.tolist(), in_splits=rows_in.tolist(), group=group,
                label=label.replace("dispatch", "combine"))
    hop = alltoall.Slot()
    out = alltoall.arrive(alltoall.dispatch(inner(rows, weight, expert, source, order), hop, **back), hop, **back)
    return torch.zeros_like(x).index_add(0, row_src, out), out_shared


def _at_experts(rows, weight, expert, source, order, *, experts, num_local, ep_size):
    """The last hop's receiving side: the copies put in the layout the experts run on
    (by source rank, then local expert, then the row's place in the source's token
    order), the experts run, each copy's output weighted and the outputs of a row's
    copies added (in expert order): one row per received row."""
    # the copies, row by row (a row's in slot order), as indices into the flat [R * slots]
    copy = (expert >= 0).view(-1).nonzero().squeeze(1)
    row = copy // expert.shape[1]
    local = expert.view(-1).index_select(0, copy).long() % num_local
    # (source, local expert, order) is unique per copy; order < 2**31 (int32 on the wire)
    perm = torch.argsort((source[row] * num_local + local) * 2**31 + order[row])
    copy, row, local = copy[perm], row[perm], local[perm]
    counts = torch.bincount(source[row] * num_local + local, minlength=ep_size * num_local)
    outputs = experts(rows.index_select(0, row), counts.view(ep_size, num_local).tolist())
    weighted = (outputs * weight.view(-1).index_select(0, copy).unsqueeze(1)).to(rows.dtype)
    return torch.zeros_like(rows).index_add(0, row, weighted)


def _forwarder(rows, weight, expert, node_from, order, *, hops, num_local, top_k, id_dtype, final, codec):
    """A node's receiving rank for tokens from other nodes (the rank with the sender's
    local index): it sends each row once to every rank of the node holding one of its
    copies' experts, with the row's origin (the source rank, the row's place here: in
    the source's token order), and sums what comes back per row (in local-rank order).
    With a keeping ``codec`` (FP8) ``rows`` were never decoded here: the bytes the codec
    kept go on, and ``rows`` only carries their gradients."""
    expert = expert.long()
    local_of = torch.tensor(hops.local_of + (hops.per_node, ), device=rows.device)
    local = local_of[torch.where(expert >= 0, expert // num_local, len(hops.local_of))]
    mine = hops.local_of[hops.me]
    source = torch.tensor([hops.ep_rank_of[j][mine] for j in range(hops.nodes)], device=rows.device)[node_from]
    origin = torch.stack([source, order], dim=1).to(torch.int32)
    out, _ = _send_once(rows, weight, expert, local, members=hops.per_node, slots=min(top_k, num_local),
                        id_dtype=id_dtype, group=hops.node, codec=None, inner=final, label="dispatch in-node",
                        origin=origin, encoded=None if codec is None else codec.kept)
    return out


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


def wire_bytes(dispatch, indices, *, hidden, element_size, num_experts, ep_size, counted, node_of=None):
    """What one rank sends to the ranks ``counted`` marks (a bool per rank of the
    expert-parallel group: e.g. those on other nodes) for one forward dispatch and its
    combine under ``dispatch`` (a Dispatch), counted from its routing ``indices`` [T, k]:
    {"dispatch": bytes, "combine": bytes, "copies_out": copies sent there, "rows_out":
    rows sent there}. ``node_of`` (each rank's node): the deduplicated dispatch forwards
    inside nodes, so a token goes once to each node. The counts exchange (one integer per
    destination) is left out; a deduplicated row carries min(k, the destination's experts)
    routing slots (``slot_bytes`` each)."""
    dest = indices // (num_experts // ep_size)                               # [T, k]
    far = torch.as_tensor(counted, dtype=torch.bool)
    copies_out = int(far[dest].sum())
    row, back = dispatch.row_bytes(hidden, element_size), hidden * element_size
    if dispatch.name == "every-copy":
        return {"dispatch": copies_out * row, "combine": copies_out * back, "copies_out": copies_out,
                "rows_out": copies_out}
    units = torch.arange(ep_size) if node_of is None else torch.as_tensor(node_of)
    unit_far = torch.zeros(int(units.max()) + 1, dtype=torch.bool).index_fill_(0, units[far], True)
    hit = torch.zeros(indices.shape[0], len(unit_far), dtype=torch.bool)
    hit.scatter_(1, units[dest], True)
    rows_out = int((hit & unit_far).sum())
    slots = min(indices.shape[1], num_experts // len(unit_far))
    return {"dispatch": rows_out * (row + slots * slot_bytes(num_experts)), "combine": rows_out * back,
            "copies_out": copies_out, "rows_out": rows_out}

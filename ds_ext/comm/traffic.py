"""What the compressed gradient reduction costs, counted from the algorithms (ring
collectives, ranks numbered node by node), not measured: the bytes each node sends over
its inter-node links per optimizer step, by arrangement and compressor, and the state
the compression keeps per rank from one step to the next.

Collectives (``payload_bytes``'s second value), for a group of W ranks and a payload of
P bytes per rank:

- ``all_reduce`` (dense, bf16/fp16, PowerSGD's factors): a ring; each rank sends
  2 (W-1)/W x P, and so does each ring edge from one node to the next;
- ``all_gather`` (top-k's (value, index) pairs, int8's codes and scales): a ring; each
  rank and each node edge sends (W-1) x P: it grows with W;
- ``two_phase`` (sign, int4: 1-bit Adam's compressed all-reduce with error feedback on
  the worker and the server side): each chunk is cut into W segments; phase 1 an
  all-to-all (segment j to rank j, which averages the W it got, adds its server residual
  and compresses again), phase 2 a ring all-gather of the W recompressed segments. Each
  rank sends (W-1)/W x P per phase, 2 (W-1)/W x P in all, a dense ring all-reduce's of P
  bytes: it does not grow with W. Out of a node it is more when the group is flat: the
  all-to-all does not go round a ring, each of the node's m ranks sends its segments for
  the other nodes itself, m (N-1)/N x P, then the all-gather's (W-1)/W x P (over the
  node's m NICs, so the time per NIC is the ring's). P counts per phase: sign
  ceil(n/8) bytes, int4 ceil(n/2), each plus an fp32 scale per ``block_size`` entries
  (seekspeed.comm.block_size: int4 64, sign 256 unless set).

Arrangements, N nodes of m ranks of the group (W = N m):

- flat: one group over all W ranks, as above;
- hierarchical: dense inside the node, then each rail (one local rank per node) runs the
  collective over N ranks for its share of the chunks (round robin), then a broadcast
  inside the node; the node's m rails together carry 2 (N-1)/N x P (all_reduce,
  two_phase) or (N-1) x P (all_gather) for the whole gradient.

So all-gather compressors (top-k, int8) grow with the number of ranks they gather from:
flat with W, hierarchical only with N. PowerSGD (an all-reduce of its factors), sign and
int4 stay flat in N; flat, sign and int4 send about (m+1)/2 times their hierarchical bytes
out of a node (the all-to-all: 4.5-5 times with 8 ranks per node).

``target: "momentum"`` (Adam/AdamW: after ``warmup_steps`` dense steps the second moment
is frozen and each rank sends its compressed local momentum instead of the gradient)
sends the same bytes per step as ``"gradient"``; it keeps more (``state_bytes``). With
either target the first ``warmup_steps`` optimizer steps are dense (the ``fp32`` bytes);
over a long run the compressed figures after them are the ones that count.

``state_bytes``: per rank: a chunk-sized scratch region per chunk in flight (and the
compressor's pooled per-chunk scratch); the local momentum (target momentum: full size
on every rank, also under ZeRO 1, which partitions only the optimizer's own momentum);
the worker-side error-feedback residual (full size, fp32 or with sign and int4 bf16;
DGC's momentum correction keeps a u and a v; PowerSGD its e per matrix and its
warm-start Q); the server residual of the two-phase compressors (the 1/W segment a rank
averages).
Hierarchical over several nodes, the compressor's state lives on the local rank that
exchanges each chunk, about 1/m of it per rank; over one node it goes dense and keeps none.

``per_node_table`` (benchmarks/traffic_per_node.py prints it) gives the bytes per node per
step over a range of node counts.
"""

import math

CHUNK_NUMEL = int(16.0 * 2 ** 20 / 4)     # seekspeed.comm.chunk_mb's default, in fp32 entries
TWO_PHASE = ("sign", "int4")
# seekspeed.comm.residual_dtype: the bytes a two-phase residual entry is kept in
RESIDUAL_BYTES = {"fp32": 4, "bf16": 2}


def chunk_numel(chunk_mb):
    """Entries per chunk, as the reducer cuts them (``seekspeed.comm.chunk_mb``)."""
    return max(1, int(chunk_mb * 2 ** 20 / 4))


def default_block_size(compressor):
    """Entries per scale when seekspeed.comm.block_size is unset (config.CommSection)."""
    return 64 if compressor == "int4" else 256


def payload_bytes(compressor, *, numel, matrices=(), ratio=0.01, rank=4, block_size=None):
    """(bytes, collective) one rank contributes for a gradient of ``numel`` fp32
    entries; ``matrices``: (rows, cols) of the tensors PowerSGD compresses; ``block_size``:
    entries per scale (int8, int4, sign; None: the compressor's default)."""
    block_size = block_size or default_block_size(compressor)
    if compressor in ("none", "fp32"):
        return 4 * numel, "all_reduce"
    if compressor in ("bf16", "fp16"):
        return 2 * numel, "all_reduce"
    if compressor == "int8":
        return numel + 4 * math.ceil(numel / block_size), "all_gather"
    if compressor == "int4":
        return math.ceil(numel / 2) + 4 * math.ceil(numel / block_size), "two_phase"
    if compressor == "sign":
        return math.ceil(numel / 8) + 4 * math.ceil(numel / block_size), "two_phase"
    if compressor == "topk":
        return 8 * math.ceil(numel * ratio), "all_gather"
    if compressor == "powersgd":
        in_matrices = sum(r * c for r, c in matrices)
        factors = sum((r + c) * rank for r, c in matrices)
        return 4 * (factors + numel - in_matrices), "all_reduce"
    raise ValueError(f"unknown compressor {compressor!r}")


def inter_node_bytes(compressor, *, nodes, per_node, hierarchical, chunk=CHUNK_NUMEL, **payload):
    """Bytes one node sends to other nodes per step (after the dense warm-up), for a
    group of ``nodes`` x ``per_node`` ranks; ``chunk``: entries per chunk."""
    if nodes < 2:
        return 0.0
    peers = nodes if hierarchical else nodes * per_node
    size, kind = payload_bytes(compressor, **payload)
    if kind == "all_reduce" or (kind == "two_phase" and hierarchical):
        return 2 * (peers - 1) / peers * size
    if kind == "two_phase":        # the all-to-all from each of the node's ranks, then the ring all-gather
        return per_node * (nodes - 1) / nodes * size + (peers - 1) / peers * size
    return (peers - 1) * size


def state_bytes(compressor, *, numel, nodes, per_node, hierarchical, target="gradient", error_feedback=True,
                momentum=0.0, matrices=(), rank=4, chunk=CHUNK_NUMEL, depth=2, grad_bytes=4, residual_dtype="fp32"):
    """{part: bytes} the compressed reduction keeps on one rank from step to step (the
    busiest rank of the group), for a gradient of ``numel`` fp32 entries reduced over
    ``nodes`` x ``per_node`` ranks in chunks of ``chunk`` entries, ``depth`` of them in
    flight (``seekspeed.comm.pipeline_depth``); ``matrices``: PowerSGD's (rows, cols).
    Empty for ``none`` (DeepSpeed's own reduction). The reducer reads and writes the
    gradients DeepSpeed holds chunk by chunk, through a chunk-sized region per chunk in
    flight (counted here for every chunk: an upper bound, as a chunk inside one contiguous
    fp32 gradient is exchanged in the gradient's own memory; tensors under ``min_numel``
    go dense through a flat buffer of their own, not counted here). Target momentum: the local momentum M in fp32, what a dense step
    (the warm-up, a variance refresh) and a clipped momentum step hold; between them a
    momentum step through sign or int4 without the hierarchy keeps M as the all-gather
    delivered it (sign: 1/8 byte an entry and a scale a block), so the fp32 figure is the
    most it holds, not what it holds on every step. ``grad_bytes``: the gradients'
    element size; with target momentum and 16-bit gradients outside that fused path (the
    hierarchy, top-k, PowerSGD, int8) the mean momentum is also kept in an fp32 buffer
    of its own (the next M: the gradients hold it rounded). ``residual_dtype``: what sign's and int4's
    residuals are kept in (``seekspeed.comm.residual_dtype``, RESIDUAL_BYTES; the step works in fp32,
    and the momentum's fused pass reads the worker residual widened into a pooled chunk)."""
    if compressor == "none":
        return {}
    full, tail = divmod(numel, chunk)       # scratch is pooled by size: the last, shorter chunk has its own
    region = min(depth, full) * chunk + tail
    parts = {"chunk scratch": 4 * region}
    if target == "momentum":
        parts["local momentum"] = 4 * numel
        if grad_bytes != 4 and not (compressor in TWO_PHASE and not hierarchical):
            parts["next momentum"] = 4 * numel
    if hierarchical and nodes == 1:          # one node: the reducer goes dense
        return parts
    share, group = 1.0, nodes * per_node
    if hierarchical and per_node > 1:         # this rank exchanges every per_node-th chunk
        chunks = math.ceil(numel / chunk)
        share = min(numel, math.ceil(chunks / per_node) * chunk) / numel if numel else 0.0
        group = nodes
    owned = share * numel
    if compressor in TWO_PHASE:
        # per chunk in flight: its encoded input (the next worker residual) and the
        # segment's sum (the next server residual) and tail, from a pool
        widened = target == "momentum" and RESIDUAL_BYTES[residual_dtype] != 4
        parts["chunk scratch"] += 4 * region * (1 + 2 / group + widened)
    if compressor in ("int8", "int4", "sign") and error_feedback:
        kept = RESIDUAL_BYTES[residual_dtype] if compressor in TWO_PHASE else 4
        parts["residual"] = kept * owned
        if compressor in TWO_PHASE:
            parts["server residual"] = kept * math.ceil(owned / group)
    elif compressor == "topk":
        # each accumulator kept, and formed anew per chunk in flight in pooled scratch (the
        # old one given back when the step commits); the magnitudes selected from, one
        # chunk at a time, pooled by size (torch path: the fused CPU kernel takes none)
        accumulators = (["DGC momentum u"] if momentum > 0 else []) + (
            ["DGC accumulator v" if momentum > 0 else "residual"] if error_feedback else [])
        for name in accumulators:
            parts[name] = 4 * owned
        if accumulators:
            parts["chunk scratch"] += 4 * region * len(accumulators) + 4 * (min(full, 1) * chunk + tail)
    elif compressor == "powersgd":
        parts["PowerSGD Q"] = 4 * share * sum(c * rank for _, c in matrices)
        if error_feedback:
            parts["residual"] = 4 * share * sum(r * c for r, c in matrices)
    return parts


def per_node_table(*, numel, matrices=(), nodes=(2, 4, 8, 16, 32, 64, 128), per_node=8, block_size=None, ratio=0.01,
                   rank=4, chunk=CHUNK_NUMEL, methods=None):
    """[{method, compressor, hierarchical, collective, bytes: {nodes: bytes per node per
    step}}] for a gradient of ``numel`` entries reduced over ``nodes`` x ``per_node``
    ranks; ``methods``: (label, compressor, hierarchical) rows, default every compressor
    flat and hierarchical."""
    if methods is None:
        names = (("dense fp32", "fp32"), ("bf16", "bf16"), ("int8", "int8"), ("int4", "int4"), ("sign", "sign"),
                 (f"topk {ratio:.0%}", "topk"), (f"powersgd r{rank}", "powersgd"))
        methods = [(f"{label}{' hier.' if hier else ''}", name, hier) for label, name in names for hier in (False, True)]
    rows = []
    for label, name, hier in methods:
        kind = payload_bytes(name, numel=numel, matrices=matrices, ratio=ratio, rank=rank, block_size=block_size)[1]
        rows.append({"method": label, "compressor": name, "hierarchical": hier, "collective": kind, "bytes": {
            n: inter_node_bytes(name, nodes=n, per_node=per_node, hierarchical=hier, chunk=chunk, numel=numel,
                                matrices=matrices, ratio=ratio, rank=rank, block_size=block_size) for n in nodes}})
    return rows

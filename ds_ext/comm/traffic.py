"""Bytes each node sends over its inter-node link per optimizer step, by arrangement
and compressor, counted from the algorithms (ring collectives, ranks numbered node by
node): how each choice scales with the number of nodes.

- flat: one ring over all W = nodes x per_node ranks; a node's ring edge to the next
  node carries what one rank sends, 2 (W-1)/W x S for an all-reduce of S bytes and
  (W-1) x P for an all-gather of P bytes per rank (top-k, int8 payloads);
- hierarchical: dense inside the node, then each rail (one rank per node) exchanges
  its share of the chunks over ``nodes`` ranks; the node's per_node rails together
  carry 2 (N-1)/N x S (all-reduce) or (N-1) x P (all-gather) for the whole gradient.

So all-gather-based compressors (top-k, int8) grow with the number of ranks they
gather from: flat with W, hierarchical only with N. PowerSGD all-reduces its factors
and stays flat in N.
"""

import math


def payload_bytes(compressor, *, numel, matrices=(), ratio=0.01, rank=4, block_size=256):
    """(bytes, collective) one rank contributes for a gradient of ``numel`` fp32
    entries; ``matrices``: (rows, cols) of the tensors PowerSGD compresses."""
    if compressor in ("none", "fp32"):
        return 4 * numel, "all_reduce"
    if compressor in ("bf16", "fp16"):
        return 2 * numel, "all_reduce"
    if compressor == "int8":
        return numel + 4 * math.ceil(numel / block_size), "all_gather"
    if compressor == "topk":
        return 8 * math.ceil(numel * ratio), "all_gather"
    if compressor == "powersgd":
        in_matrices = sum(r * c for r, c in matrices)
        factors = sum((r + c) * rank for r, c in matrices)
        return 4 * (factors + numel - in_matrices), "all_reduce"
    raise ValueError(f"unknown compressor {compressor!r}")


def inter_node_bytes(compressor, *, nodes, per_node, hierarchical, **payload):
    """Bytes one node sends to other nodes per step."""
    size, kind = payload_bytes(compressor, **payload)
    if nodes < 2:
        return 0.0
    peers = nodes if hierarchical else nodes * per_node
    if kind == "all_reduce":
        return 2 * (peers - 1) / peers * size
    return (peers - 1) * size

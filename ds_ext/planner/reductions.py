"""What crosses the links each step: the data-parallel gradient reduction per stage
(dense, and with the configured compressor, with the state the compressor keeps), the
pipeline's point-to-point chain, the expert all-to-all; the reduction the step waits
for (after the drain, or overlapped per chunk) and the optimizer step."""

from dataclasses import dataclass

from .hardware import GB


@dataclass(kw_only=True)
class GroupTraffic:
    group: str                 # "data-parallel", "pipeline", "expert all-to-all"
    members: int
    intra_bytes: float         # per step, summed over the group's links inside nodes
    inter_bytes: float
    intra_bytes_compressed: float
    inter_bytes_compressed: float
    seconds: float             # what the step waits for, dense
    seconds_compressed: float


def _per_node(members):
    counts = {}
    for x in members:
        counts[x] = counts.get(x, 0) + 1
    return counts


def _payload(comm):
    """(payload(numel, ranks), the tensors it compresses) of seekspeed.comm's compressor
    for one group's (rows, cols) ``matrices``."""
    from ds_ext.comm.traffic import payload_bytes

    def of(matrices):
        big = [x for x in matrices if x[0] * x[1] >= comm.min_numel]

        def one(numel, members):
            return payload_bytes(comm.compressor, numel=numel, ratio=comm.ratio, rank=comm.rank,
                                 block_size=comm.resolved_block_size, matrices=big)
        return one, big
    return of


def _comm_state(comm, numel, members, *, hierarchical, matrices, grad_bytes):
    """What the compressed reduction of one group keeps between steps (ds_ext.comm.traffic.state_bytes)."""
    from ds_ext.comm.traffic import chunk_numel, state_bytes
    per_node = _per_node(members)
    return state_bytes(comm.compressor, numel=numel, nodes=len(per_node), per_node=max(per_node.values()),
                       hierarchical=hierarchical, target=comm.target, error_feedback=comm.error_feedback,
                       momentum=comm.momentum, matrices=_payload(comm)(matrices)[1], rank=comm.rank,
                       chunk=chunk_numel(comm.chunk_mb), depth=comm.pipeline_depth, grad_bytes=grad_bytes,
                       residual_dtype=comm.residual_dtype)


def sketch_bytes(comm, matrices):
    """The bytes of target momentum's sketch all-reduce for one group's (rows, cols)
    ``matrices``: the clip norm's count sketch (clip_norm "sketch"), 4 x
    clip_sketch_buckets, and under var_rescale "tensor" min(numel, var_rescale_buckets)
    fp32 entries per tensor more; 0 without the sketch (the planner prices it whenever it
    is configured, also without gradient clipping)."""
    if comm.target != "momentum" or comm.clip_norm != "sketch":
        return 0
    extra = sum(min(r * c, comm.var_rescale_buckets) for r, c in matrices) if comm.var_rescale == "tensor" else 0
    return 4 * (comm.clip_sketch_buckets + extra)


def stage_reductions(m, hw, stages, stage_matrices, placement):
    """Per pipeline rank its gradient reduction (dp_group's figures): dense over the
    data-parallel group, routed experts over their expert-data-parallel group (always
    flat: install.py reduces them with hierarchical=False); dense and with the
    configured compressor. Sets each StageMemory's comm state from the same groups."""
    comm, dp, ep = m.section.comm, m.layout.data_parallel, m.ep
    payload = _payload(comm)
    reductions = []
    for rank, st in enumerate(stages):
        groups = [(st.params - st.expert_params, [placement.node(rank, d) for d in range(dp)], comm.hierarchical,
                   stage_matrices[rank][False])]
        if st.expert_params:
            groups.append((st.expert_params, [placement.node(rank, d) for d in range(0, dp, ep)], False,
                           stage_matrices[rank][True]))
        g, kept_state = None, {}
        for numel, members, hier, matrices in groups:
            one = dp_group(numel=numel, grad_bytes=m.precision.reduce, members=members, hw=hw,
                           compressor=comm.compressor, hierarchical=hier, payload=payload(matrices)[0],
                           sketch_bytes=sketch_bytes(comm, matrices))
            g = one if g is None else {k: g[k] + one[k] for k in g}
            for name, b in _comm_state(comm, numel, members, hierarchical=hier, matrices=matrices,
                                         grad_bytes=m.precision.reduce).items():
                kept_state[name] = kept_state.get(name, 0.0) + b
        reductions.append(g)
        st.comm_state_parts, st.comm_state = kept_state, float(sum(kept_state.values()))
    return reductions


def pipeline_traffic(m, costed, *, seconds):
    """The pipeline group's bytes per step on each link class (``seconds``: what the
    point-to-point transfers add to the simulated step)."""
    lay, placement = m.layout, costed.placement
    pp = lay.pipe_stages
    chain = 2 * lay.grad_accum * costed.p2p_bytes * (pp - 1) * m.sched.link_passes
    crossing = sum(placement.node(st, 0) != placement.node(st + 1, 0) for st in range(pp - 1)) / max(pp - 1, 1)
    return GroupTraffic(group="pipeline", members=pp, intra_bytes=chain * (1 - crossing),
                        inter_bytes=chain * crossing, intra_bytes_compressed=chain * (1 - crossing),
                        inter_bytes_compressed=chain * crossing, seconds=seconds, seconds_compressed=seconds)


def a2a_traffic(m, costed, *, bounds, charged):
    """The expert all-to-all group's bytes per step: every MoE layer the busiest rank
    holds, forward + backward (+ recompute), every micro-batch; ``charged``: the
    seconds the step waits for."""
    lay, ep, a2a = m.layout, m.ep, costed.a2a
    pp = lay.pipe_stages
    chunks = [m.rows[bounds[c]:bounds[c + 1]] for c in range(m.parts)]
    passes = lay.grad_accum * (2 + m.recompute_passes)
    per_rank = max(sum(1 for c in m.sched.rank_chunks(rank=r, stages=pp) for row in chunks[c] if m.is_moe(row))
                   for r in range(pp)) * passes * a2a.layer_bytes
    cross = a2a.cost.inter_bytes / (a2a.cost.inter_bytes + a2a.cost.intra_bytes)
    return GroupTraffic(group="expert all-to-all", members=ep, intra_bytes=per_rank * ep * (1 - cross),
                        inter_bytes=per_rank * ep * cross, intra_bytes_compressed=per_rank * ep * (1 - cross),
                        inter_bytes_compressed=per_rank * ep * cross, seconds=charged, seconds_compressed=charged)


def exposed_reduction(m, stages, reductions, *, bounds, sim, key):
    """(the reduction the step waits for, the reduction's own time): after the drain,
    or with seekspeed.overlap_grad_reduce each chunk's from its last backward and W on
    (timeline.overlapped_reduction_ends; only what is left after the pipeline counts)."""
    from .timeline import overlapped_reduction_ends
    pp = m.layout.pipe_stages
    total = max(g[key] for g in reductions)
    for st, g in zip(stages, reductions):
        st.reduce_seconds = g[key]
    if not (bool(getattr(m.section, "overlap_grad_reduce", False)) and pp > 1):
        return total, total
    chunks = [m.rows[bounds[c]:bounds[c + 1]] for c in range(m.parts)]
    ends = overlapped_reduction_ends(sim.timeline, schedule=m.section.schedule, stages=pp, reductions=[
        {c: g[key] * sum(r["params"] for r in chunks[c]) / max(st.params, 1)
         for c in m.sched.rank_chunks(rank=rank, stages=pp)}
        for rank, (g, st) in enumerate(zip(reductions, stages))])
    return max(0.0, max(ends) - sim.makespan), total


def exact_norm_seconds(m, hw, st):
    """``seekspeed.grad_norm: "exact"`` on the rank ``st``: its memory-bound passes
    (ds_ext/grad_norm.py BYTES_PER_ELEMENT) over its share of the gradients: ZeRO's
    partition, or under DeepSpeed's BF16 optimizer the same share of the whole gradients
    (routed experts: of their expert-data-parallel group)."""
    if m.section.grad_norm != "exact":
        return 0.0
    from ds_ext.grad_norm import BYTES_PER_ELEMENT
    dp = max(m.layout.data_parallel, 1)
    elements = (st.params - st.expert_params) / dp + st.expert_params / max(dp // m.ep, 1)
    return elements * BYTES_PER_ELEMENT / (hw.hbm_gbps * GB)


def optimizer_seconds(m, hw, stages, placement):
    """The optimizer step (memory bound, on the rank with the most parameters); under
    ZeRO 1 each rank steps its shard, then the updated weights are all-gathered over the
    data-parallel group (routed experts over theirs), on the same links."""
    dp, ep, p = m.layout.data_parallel, m.ep, m.precision
    biggest = max(stages, key=lambda st: st.params)
    seconds = 2 * (biggest.optimizer + biggest.weights + biggest.gradients / max(dp, 1)) / (hw.hbm_gbps * GB)
    seconds += max(exact_norm_seconds(m, hw, st) + st.muon_seconds for st in stages)
    if not (p.zero_stage >= 1 and dp > 1):
        return seconds
    from .collectives import all_gather

    def gather(numel, members):
        counts = {x: members.count(x) for x in members}
        if numel == 0 or len(members) < 2:
            return 0.0
        return all_gather(numel * p.weight, nodes=len(counts), per_node=max(counts.values()),
                          fabric=hw.fabric()).seconds
    return seconds + max(gather(st.params - st.expert_params, [placement.node(rank, d) for d in range(dp)])
                         + gather(st.expert_params, [placement.node(rank, d) for d in range(0, dp, ep)])
                         for rank, st in enumerate(stages))


def dp_group(*, numel, grad_bytes, members, hw, compressor, hierarchical, payload, sketch_bytes=0):
    """Bytes on intra/inter-node links and seconds of one data-parallel group's
    gradient reduction, as NCCL runs the collectives (ds_ext/planner/collectives.py: ring
    or tree over the node's rails and NVLink, the faster for the size; the other
    stages' groups on the node share its NICs). Dense: an all-reduce. A compressor's
    payload (ds_ext/comm/traffic.py) by its collective: all-reduce; all-gather of every
    rank's payload; two-phase (sign, int4): an all-to-all of the payload, then an
    all-gather of the 1/n segments. Hierarchical: an all-reduce inside each node, then
    the payload across the nodes on each of the node's m rails (1/m of it each).
    ``members``: each member's node; ``payload(numel, ranks)``: the compressor's
    (bytes, collective) over ``ranks``; ``sketch_bytes``: a flat all-reduce of that many
    bytes over the group ahead of the compressed exchange (the clip norm's sketch)."""
    from . import collectives as cc
    n = len(members)
    per_node = {}
    for m in members:
        per_node[m] = per_node.get(m, 0) + 1
    nodes, m = len(per_node), max(per_node.values())
    size = numel * grad_bytes
    out = {"intra_bytes": 0.0, "inter_bytes": 0.0, "intra_bytes_compressed": 0.0, "inter_bytes_compressed": 0.0,
           "seconds": 0.0, "seconds_compressed": 0.0}
    if n < 2:
        return out
    fabric = hw.fabric()
    group = {"nodes": nodes, "per_node": m, "fabric": fabric}
    dense = cc.all_reduce(size, **group)
    out.update(intra_bytes=dense.intra_bytes, inter_bytes=dense.inter_bytes, seconds=dense.seconds)
    if payload is None or compressor == "none":
        out.update(intra_bytes_compressed=dense.intra_bytes, inter_bytes_compressed=dense.inter_bytes,
                   seconds_compressed=dense.seconds)
        return out

    def collectives(p_bytes, kind, ranks, **where):
        if kind == "two_phase":
            return [cc.all_to_all(p_bytes, **where), cc.all_gather(p_bytes, **where)]
        if kind == "all_gather":
            return [cc.all_gather(ranks * p_bytes, **where)]
        return [cc.all_reduce(p_bytes, **where)]
    if not hierarchical or nodes == 1:
        steps = [(1, c) for c in collectives(*payload(numel, n), n, **group)]
    else:
        p_bytes, kind = payload(numel, nodes)
        rails = collectives(p_bytes / m, kind, nodes, nodes=nodes, per_node=1, fabric=fabric)
        steps = [(nodes, cc.all_reduce(size, nodes=1, per_node=m, fabric=fabric))] + [(m, c) for c in rails]
    if sketch_bytes:
        steps.append((1, cc.all_reduce(sketch_bytes, **group)))
    out["intra_bytes_compressed"] = sum(k * c.intra_bytes for k, c in steps)
    out["inter_bytes_compressed"] = sum(k * c.inter_bytes for k, c in steps)
    out["seconds_compressed"] = sum(c.seconds for _, c in steps)
    return out

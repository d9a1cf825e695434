"""Which DeepSpeed axis gets the fast links.

DeepSpeed numbers ranks over its pipe x data grid with one axis varying fastest:
``pipe-data`` (DeepSpeed's default, data fastest) puts the members of each
data-parallel group (and expert-parallel group) on consecutive ranks, hence on one
node when they fit; ``data-pipe`` (pipe fastest) puts the stages of each replica on
consecutive ranks instead. The launcher fills nodes with consecutive ranks, so the
order decides whose traffic crosses the slow inter-node links.

The cost model counts each group's bytes per optimizer step on every link it uses,
and how much of that time the step waits for:
- data parallel: a ring all-reduce of the stage's gradients (2 (n-1)/n x the
  gradient bytes over each ring edge) at the end of the step, all of it waited for;
- expert parallel: the routed tokens' all-to-all (dispatch and combine, forward and
  backward) inside the layers, all of it waited for;
- pipeline: each micro-batch's activations forward and gradients backward between
  neighbouring stages. These overlap with the other micro-batches' compute, so the
  step waits only for one micro-batch's transfers per boundary (pipeline fill and
  drain) plus, where a link is slower than the compute it feeds, the difference for
  every micro-batch.
The prediction is the busiest node's waiting time; the smaller one wins.
"""

from dataclasses import dataclass, field

PLACEMENTS = ("pipe-data", "data-pipe")


@dataclass(kw_only=True)
class StepTraffic:
    """Bytes one rank moves per optimizer step, by kind."""
    gradient_bytes: float          # one data-parallel replica's gradient of one stage
    activation_bytes: float        # one micro-batch's activation between two stages
    micro_batches: int
    expert_bytes: float = 0.0      # one rank's routed-token payload per step (one direction, one pass)
    compute_seconds: float = 0.0   # one stage's forward + backward of one micro-batch


@dataclass(kw_only=True)
class Prediction:
    placement: str
    seconds: float
    bytes_by_class: dict = field(default_factory=dict)   # {"intra": bytes, "inter": bytes}

    def describe(self):
        mb = {k: v / 1e6 for k, v in self.bytes_by_class.items()}
        return (f"{self.placement}: {mb.get('intra', 0):,.1f} MB intra-node, {mb.get('inter', 0):,.1f} MB inter-node "
                f"per step; predicted wait for transfers {self.seconds * 1e3:.1f} ms on the busiest node")


def rank_of(placement, *, stage, data, pp, dp):
    if placement == "pipe-data":
        return stage * dp + data
    if placement == "data-pipe":
        return data * pp + stage
    raise ValueError(f"unknown placement {placement!r}; choose one of {list(PLACEMENTS)}")


def flows(placement, *, pp, dp, ep, traffic, kinds=("data", "pipe", "expert")):
    """(rank_a, rank_b, bytes) for every link the step uses (both directions summed)."""
    out = []
    for stage in range(pp if "data" in kinds else 0):   # data parallel ring per stage
        ring = [rank_of(placement, stage=stage, data=d, pp=pp, dp=dp) for d in range(dp)]
        if dp > 1:
            per_edge = 2 * (dp - 1) / dp * traffic.gradient_bytes
            out += [(ring[i], ring[(i + 1) % dp], per_edge) for i in range(dp)]
    for data in range(dp if "pipe" in kinds else 0):   # pipeline neighbours per replica
        for stage in range(pp - 1):
            a = rank_of(placement, stage=stage, data=data, pp=pp, dp=dp)
            b = rank_of(placement, stage=stage + 1, data=data, pp=pp, dp=dp)
            out.append((a, b, 2 * traffic.micro_batches * traffic.activation_bytes))
    if "expert" in kinds and ep > 1 and traffic.expert_bytes:   # expert all-to-all inside each group of ep consecutive replicas
        for stage in range(pp):
            for first in range(0, dp, ep):
                members = [rank_of(placement, stage=stage, data=d, pp=pp, dp=dp) for d in range(first, first + ep)]
                per_pair = 4 * traffic.expert_bytes / ep   # dispatch + combine, forward + backward
                out += [(a, b, per_pair) for i, a in enumerate(members) for b in members[i + 1:]]
    return out


def predict(placement, *, pp, dp, ep=1, traffic, ranks_per_node=None, node_of=None, intra_gbps, inter_gbps):
    """Predicted waiting for transfers per step for ``placement`` (see the module
    docstring); nodes are ``ranks_per_node`` consecutive ranks, or ``node_of``."""
    node = list(node_of) if node_of is not None else [r // ranks_per_node for r in range(pp * dp)]
    nodes = max(node) + 1
    speed = {True: intra_gbps * 1e9, False: inter_gbps * 1e9}     # key: same node?
    totals = {"intra": 0.0, "inter": 0.0}
    blocking = [0.0] * nodes        # data- and expert-parallel seconds each node's link is busy
    for a, b, nbytes in flows(placement, pp=pp, dp=dp, ep=ep, traffic=traffic, kinds=("data", "expert")):
        same = node[a] == node[b]
        totals["intra" if same else "inter"] += nbytes
        for k in {node[a], node[b]}:
            blocking[k] += nbytes / 2 / speed[same]
    pipeline = [0.0] * nodes
    per_mb = [0.0] * nodes          # pipeline bytes one micro-batch puts on each node's link
    for a, b, nbytes in flows(placement, pp=pp, dp=dp, ep=ep, traffic=traffic, kinds=("pipe",)):
        same = node[a] == node[b]
        totals["intra" if same else "inter"] += nbytes
        one = nbytes / traffic.micro_batches
        for k in {node[a], node[b]}:
            pipeline[k] += one / speed[same] / 2           # fill and drain: one micro-batch per boundary
            if not same:
                per_mb[k] += one / 2 / speed[same]
    seconds = max(blocking[k] + pipeline[k]
                  + traffic.micro_batches * max(0.0, per_mb[k] - traffic.compute_seconds) for k in range(nodes))
    return Prediction(placement=placement, seconds=seconds, bytes_by_class=totals)


def choose(*, pp, dp, ep=1, moe=False, traffic, ranks_per_node=None, node_of=None, intra_gbps, inter_gbps):
    """The placement with the least predicted communication time, and every
    candidate's prediction. Models with MoE layers keep DeepSpeed's order: its
    expert and expert-data-parallel groups assume each stage's ranks are consecutive."""
    candidates = ["pipe-data"] if moe or ep > 1 else list(PLACEMENTS)
    predictions = [predict(p, pp=pp, dp=dp, ep=ep, traffic=traffic, ranks_per_node=ranks_per_node, node_of=node_of,
                           intra_gbps=intra_gbps, inter_gbps=inter_gbps) for p in candidates]
    return min(predictions, key=lambda p: (p.seconds, PLACEMENTS.index(p.placement))), predictions


def deepspeed_topology(placement, *, pp, dp):
    """The DeepSpeed ProcessTopology that numbers ranks as ``placement`` says."""
    from deepspeed.runtime.pipe.topology import ProcessTopology
    if placement == "pipe-data":
        return ProcessTopology(axes=["pipe", "data"], dims=[pp, dp])
    if placement == "data-pipe":
        return ProcessTopology(axes=["data", "pipe"], dims=[dp, pp])
    raise ValueError(f"unknown placement {placement!r}; choose one of {list(PLACEMENTS)}")

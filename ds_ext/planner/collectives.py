"""A cost model of NCCL's collectives on rail-optimised nodes, for the planner.

A node holds ``gpus_per_node`` GPUs joined by NVLink (NVSwitch: every GPU reaches
every other at its own NVLink rate) and ``nics_per_node`` NICs, one rail each (NIC i
of every node on one switch). A group of ranks spans ``nodes`` nodes with
``per_node`` members on each; ``groups_per_node`` such groups use a node's NICs at
the same time (default ``gpus_per_node / per_node``: every GPU of the node is in a
group like this one, as when every pipeline stage reduces its gradients at once), so
one group gets ``nics_per_node / groups_per_node`` NICs' worth of bandwidth out of
(and into) each node. Every link runs at its line rate times an efficiency: NICs at
``nic_efficiency`` (NVIDIA expects 46-48 GB/s of a 400 Gb/s NDR NIC through NCCL,
nccl-tests issue 290), NVLink at ``nvlink_efficiency`` for rings and trees (NCCL's
own topology figure, 20.6 of a link's 25 GB/s on Hopper) and at
``nvlink_a2a_efficiency`` for all-to-all, whose fan-out to every peer runs below
a ring's streaming (calibrated on DeepEP's intranode EP8 dispatch, checked on the
rest of its table in tests/test_collectives.py).

Time = max(bytes over the busiest NIC share, bytes over the busiest NVLink) /
bandwidth + an alpha term per algorithm step: the links of one collective run
together, pipelined in chunks, so the slower of the two sets the pace.

- Ring (all-reduce, reduce-scatter, all-gather): NCCL builds one ring channel (or
  more) per rail; each ring runs through the ``per_node`` GPUs of a node over NVLink
  and leaves it through one NIC, and the rings start at different GPUs, so a node's
  NICs carry the collective together. All-reduce: each rank sends 2 (n-1)/n x S,
  each node 2 (n-1)/n x S through its NIC share, each GPU (m-1)/m of its bytes over
  NVLink; latency 2 x (hops inside nodes x ``nvlink_latency_us`` + hops between
  nodes x ``nic_latency_us``) (a chunk goes round the ring twice).
- Tree (all-reduce, across nodes): NCCL's double binary tree over the nodes, a chain
  over each node's GPUs. Each node sends 2 (N-1)/N x S through its NICs (S on two
  nodes, where the tree beats the ring's 2 (n-1)/n x S), each GPU of the chain
  2 (m-1)/m x S over NVLink (up the chain reducing, down it broadcasting); latency
  2 x (log2 N x ``nic_latency_us`` + (m-1) x ``nvlink_latency_us``).
  ``algorithm="auto"`` takes the faster of the two for the size, as NCCL's tuner
  does from its own estimates (it picks tree for small messages and, where the
  NVLink chain keeps up, on two nodes).
- All-to-all: each rank sends S/n to every rank. Direct (NCCL's send/recv): each
  node sends m (n-m)/n x S out, each GPU (m-1)/n x S over NVLink. With
  ``forwarding`` (DeepEP's internode kernels): data for another node goes once over
  the rail to the GPU of the same local index there, which forwards it over NVLink
  to the GPUs that want it; the same NIC bytes for a plain all-to-all, fewer for
  MoE dispatch, where a token bound for several GPUs of one node crosses the network
  once (``moe_dispatch``). Latency: one hop.

Bus bandwidth is nccl-tests': algbw x 2 (n-1)/n for all-reduce, x (n-1)/n for
reduce-scatter, all-gather and all-to-all.

Left out: NVLink SHARP and IB SHARP (NCCL's NVLS, NVLSTree and CollNet algorithms,
which reduce inside the switches: on H100/H800 nodes NCCL may pick NVLS or NVLSTree,
which this model's ring and tree underestimate where NVLink is the bottleneck, as
on H800); the protocol choice (LL, LL128, Simple: one latency per hop, bandwidth at
Simple's); channel counts and SM limits; PXN (routing a send through another GPU's
NIC) and NIC sharing between GPUs other than the even split above; congestion,
adaptive routing and the fat tree's oversubscription (a non-blocking fabric is
assumed); uneven groups (the busiest node sets the pace: ``per_node`` is the most
members any node holds).
"""

import math
from dataclasses import dataclass

from ds_ext.errors import ConfigError

GB = 1e9


@dataclass(frozen=True, kw_only=True)
class Fabric:
    """Links of one kind of node (line rates, GB/s one way, and achieved fractions)."""
    gpus_per_node: int
    nics_per_node: int
    nic_gbps: float                    # one NIC, one way
    nvlink_gbps: float                 # one GPU's NVLink, one way
    nic_efficiency: float = 1.0
    nvlink_efficiency: float = 1.0
    nvlink_a2a_efficiency: float = 1.0
    nic_latency_us: float = 0.0        # per algorithm step between nodes
    nvlink_latency_us: float = 0.0     # per algorithm step inside a node

    def __post_init__(self):
        for name in ("gpus_per_node", "nics_per_node"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} is {getattr(self, name)}: a node needs at least 1")
        for name in ("nic_gbps", "nvlink_gbps"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name} is {getattr(self, name)}: give the link's GB/s, above 0")
        for name in ("nic_efficiency", "nvlink_efficiency", "nvlink_a2a_efficiency"):
            if not 0 < getattr(self, name) <= 1:
                raise ConfigError(f"{name} is {getattr(self, name)}: an achieved fraction of the line rate, in (0, 1]")
        for name in ("nic_latency_us", "nvlink_latency_us"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} is {getattr(self, name)}: a latency cannot be negative")

    @property
    def nic(self):
        """Achieved bytes/s of one NIC, one way."""
        return self.nic_gbps * GB * self.nic_efficiency

    def nvlink(self, a2a=False):
        """Achieved bytes/s of one GPU's NVLink, one way (rings and trees, or all-to-all)."""
        return self.nvlink_gbps * GB * (self.nvlink_a2a_efficiency if a2a else self.nvlink_efficiency)


@dataclass(frozen=True, kw_only=True)
class Cost:
    collective: str
    algorithm: str           # "ring", "tree", "direct", "forwarded", "none" (one rank)
    seconds: float
    algbw: float             # bytes/s: size / seconds
    busbw: float             # bytes/s, nccl-tests' definition for the collective
    intra_bytes: float       # summed over the group's NVLink sends
    inter_bytes: float       # summed over the group's NIC sends
    bottleneck: str          # "nic", "nvlink" or "latency"


def _layout(nodes, per_node, fabric, groups_per_node):
    if nodes < 1 or per_node < 1:
        raise ValueError(f"a group needs nodes >= 1 and per_node >= 1, got {nodes} x {per_node}")
    if per_node > fabric.gpus_per_node:
        raise ConfigError(f"a group has {per_node} ranks on one node but a node has {fabric.gpus_per_node} GPUs: "
                          f"raise --gpus-per-node to the ranks per node")
    share = fabric.gpus_per_node / per_node if groups_per_node is None else groups_per_node
    if share < 1 or share * per_node > fabric.gpus_per_node + 1e-9:
        raise ValueError(f"groups_per_node {share} of {per_node} ranks do not fit a node of {fabric.gpus_per_node} "
                         f"GPUs")
    return nodes * per_node, fabric.nics_per_node * fabric.nic / share


def _finish(collective, algorithm, *, size, n, factor, t_nic, t_nvl, t_lat, intra, inter):
    seconds = max(t_nic, t_nvl) + t_lat
    if seconds == 0:
        return Cost(collective=collective, algorithm=algorithm, seconds=0.0, algbw=math.inf, busbw=math.inf,
                    intra_bytes=intra, inter_bytes=inter, bottleneck="latency")
    bottleneck = "latency" if t_lat > max(t_nic, t_nvl) else ("nic" if t_nic >= t_nvl else "nvlink")
    algbw = size / seconds
    return Cost(collective=collective, algorithm=algorithm, seconds=seconds, algbw=algbw, busbw=algbw * factor,
                intra_bytes=intra, inter_bytes=inter, bottleneck=bottleneck)


def _nothing(collective):
    return Cost(collective=collective, algorithm="none", seconds=0.0, algbw=math.inf, busbw=math.inf,
                intra_bytes=0.0, inter_bytes=0.0, bottleneck="latency")


def _ring(collective, size, *, nodes, per_node, fabric, groups_per_node, passes):
    """``passes`` 2: all-reduce (reduce-scatter + all-gather), 1: either alone."""
    n, node_bw = _layout(nodes, per_node, fabric, groups_per_node)
    sent = passes * (n - 1) / n * size                       # per rank
    inter_hops = nodes if nodes > 1 else 0
    t_nic = sent / node_bw if nodes > 1 else 0.0
    t_nvl = (per_node - 1) / per_node * sent / fabric.nvlink() if nodes > 1 else sent / fabric.nvlink()
    t_lat = passes * ((n - inter_hops) * fabric.nvlink_latency_us + inter_hops * fabric.nic_latency_us) * 1e-6
    return _finish(collective, "ring", size=size, n=n, factor=passes * (n - 1) / n, t_nic=t_nic, t_nvl=t_nvl,
                   t_lat=t_lat, intra=sent * (n - inter_hops), inter=sent * inter_hops)


def _tree(size, *, nodes, per_node, fabric, groups_per_node):
    n, node_bw = _layout(nodes, per_node, fabric, groups_per_node)
    node_out = 2 * (nodes - 1) / nodes * size
    chain = 2 * (per_node - 1) / per_node * size              # per GPU, averaged over the chain
    t_lat = 2 * (math.ceil(math.log2(nodes)) * fabric.nic_latency_us
                 + (per_node - 1) * fabric.nvlink_latency_us) * 1e-6
    return _finish("all_reduce", "tree", size=size, n=n, factor=2 * (n - 1) / n, t_nic=node_out / node_bw,
                   t_nvl=chain / fabric.nvlink(), t_lat=t_lat, intra=chain * n, inter=node_out * nodes)


def all_reduce(size, *, nodes, per_node, fabric, groups_per_node=None, algorithm="auto"):
    """``size`` bytes on every rank, summed on every rank: ring, tree (more than one
    node) or ``"auto"``, the faster of the two."""
    if nodes * per_node < 2:
        return _nothing("all_reduce")
    kw = {"nodes": nodes, "per_node": per_node, "fabric": fabric, "groups_per_node": groups_per_node}
    ring = _ring("all_reduce", size, passes=2, **kw)
    if algorithm == "ring" or nodes == 1:
        return ring
    tree = _tree(size, **kw)
    if algorithm == "tree":
        return tree
    if algorithm != "auto":
        raise ValueError(f"all-reduce algorithm {algorithm!r}: choose 'ring', 'tree' or 'auto'")
    return min(ring, tree, key=lambda c: c.seconds)


def reduce_scatter(size, *, nodes, per_node, fabric, groups_per_node=None):
    """``size`` bytes in on every rank, 1/n of their sum out (ring)."""
    if nodes * per_node < 2:
        return _nothing("reduce_scatter")
    return _ring("reduce_scatter", size, nodes=nodes, per_node=per_node, fabric=fabric,
                 groups_per_node=groups_per_node, passes=1)


def all_gather(size, *, nodes, per_node, fabric, groups_per_node=None):
    """``size`` bytes out on every rank, 1/n of them from each (ring)."""
    if nodes * per_node < 2:
        return _nothing("all_gather")
    return _ring("all_gather", size, nodes=nodes, per_node=per_node, fabric=fabric,
                 groups_per_node=groups_per_node, passes=1)


def _exchange(collective, *, size, n, nodes, per_node, fabric, node_bw, nic_per_gpu, nvl_per_gpu, forwarding):
    """An all-to-all-like exchange: ``nic_per_gpu`` / ``nvl_per_gpu`` bytes each GPU sends."""
    t_nic = per_node * nic_per_gpu / node_bw if nodes > 1 else 0.0
    t_lat = (fabric.nic_latency_us if nodes > 1 else 0.0) + fabric.nvlink_latency_us * (per_node > 1 or forwarding)
    return _finish(collective, "forwarded" if forwarding else "direct", size=size, n=n, factor=(n - 1) / n,
                   t_nic=t_nic, t_nvl=nvl_per_gpu / fabric.nvlink(a2a=True), t_lat=t_lat * 1e-6,
                   intra=nvl_per_gpu * n, inter=nic_per_gpu * n)


def all_to_all(size, *, nodes, per_node, fabric, groups_per_node=None, forwarding=False):
    """Every rank sends ``size`` bytes, ``size / n`` to each rank (itself included)."""
    n, node_bw = _layout(nodes, per_node, fabric, groups_per_node)
    if n < 2:
        return _nothing("all_to_all")
    remote = (n - per_node) / n * size
    local = (per_node - 1) / n * size
    forwarded = remote * (per_node - 1) / per_node if forwarding else 0.0
    return _exchange("all_to_all", size=size, n=n, nodes=nodes, per_node=per_node, fabric=fabric, node_bw=node_bw,
                     nic_per_gpu=remote, nvl_per_gpu=local + forwarded, forwarding=forwarding and nodes > 1)


@dataclass(frozen=True, kw_only=True)
class Routing:
    """Expected fan-out of one token under uniform routing: ``top_k`` distinct experts of
    ``num_experts`` (spread evenly over the ranks), limited to ``top_groups`` nodes
    (DeepSeek-V3's node-limited routing; the node set uniform)."""
    nodes_per_token: float       # distinct nodes a token goes to
    local_node: float            # of them, the sender's own node (expected count)
    ranks_per_token: float       # distinct ranks
    local_ranks: float           # of them, on the sender's own node
    self_rank: float             # of them, the sender itself


def routing(*, nodes, per_node, num_experts, top_k, top_groups=None):
    n = nodes * per_node
    if num_experts % n:
        raise ValueError(f"{num_experts} experts do not split evenly over {n} ranks")
    groups = nodes if top_groups is None else min(top_groups, nodes)
    pool = groups * num_experts // nodes                         # experts a token may choose from
    if top_k > pool:
        raise ValueError(f"top_k {top_k} exceeds the {pool} experts of {groups} node(s)")

    def hit(held):                                              # P(a set of `held` experts gets >= 1 of k)
        return 1 - math.comb(pool - held, top_k) / math.comb(pool, top_k)
    node_hit, rank_hit = hit(num_experts // nodes), hit(num_experts // n)
    return Routing(nodes_per_token=groups * node_hit, local_node=groups / nodes * node_hit,
                   ranks_per_token=groups * per_node * rank_hit, local_ranks=groups / nodes * per_node * rank_hit,
                   self_rank=groups / nodes * rank_hit)


def moe_dispatch(*, tokens, token_bytes, nodes, per_node, fabric, num_experts, top_k, top_groups=None,
                 forwarding=True, groups_per_node=None, forward_bytes=None):
    """One MoE dispatch (the combine is its mirror: the same bytes back) of ``tokens``
    tokens per rank, ``token_bytes`` each, each sent once to every rank holding one of
    its experts. With ``forwarding`` a token crosses to another node once (to the GPU
    of its local index there) and is copied on over NVLink (DeepEP's normal kernels);
    without, it is sent to each rank directly. Returns the Cost and DeepEP's logical
    RDMA bytes per rank (a token counted once per node it goes to, the sender's own
    included: its test_internode.py's ``num_rdma_token_sent``; divide by seconds for
    the bandwidth its README tables quote). ``forward_bytes``: a token's bytes on the
    copy inside the node when they differ from the ones across (seekspeed's forwarder
    adds the row's origin)."""
    n, node_bw = _layout(nodes, per_node, fabric, groups_per_node)
    r = routing(nodes=nodes, per_node=per_node, num_experts=num_experts, top_k=top_k, top_groups=top_groups)
    if forwarding and nodes > 1:
        nic = tokens * token_bytes * (r.nodes_per_token - r.local_node)
        nvl = tokens * (forward_bytes or token_bytes) * r.ranks_per_token * (per_node - 1) / per_node
    else:
        nic = tokens * token_bytes * (r.ranks_per_token - r.local_ranks)
        nvl = tokens * token_bytes * (r.local_ranks - r.self_rank)
    size = tokens * token_bytes * r.ranks_per_token
    cost = _exchange("moe_dispatch", size=size, n=n, nodes=nodes, per_node=per_node, fabric=fabric, node_bw=node_bw,
                     nic_per_gpu=nic, nvl_per_gpu=nvl, forwarding=forwarding and nodes > 1)
    return cost, tokens * token_bytes * r.nodes_per_token

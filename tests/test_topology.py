"""Topology: bandwidth matrices from the hostfile, recorded `nvidia-smi topo -m`
outputs and a measured probe; deterministic affinity partitions (DGX 8-GPU islands,
16-node layouts, irregular matrices); the placement cost model on cases with a known
answer; intra-node/rail groups and the hierarchical all-reduce equal to a flat one.
Single process plus 4-rank cases; about 20 s."""

import numpy as np
import pytest
import torch

from ds_ext.topology.bandwidth import (BandwidthMatrix, from_hostfile, from_nodes, from_nvidia_smi,
                                       parse_nvidia_smi_topo)
from ds_ext.topology.placement import StepTraffic, choose, flows, predict
from tests.distributed import run_ranks
from tests.numerics import sum_error_bound

# Recorded layouts (the format `nvidia-smi topo -m` prints; values of DGX-class machines).
DGX_A100 = """\
\tGPU0\tGPU1\tGPU2\tGPU3\tGPU4\tGPU5\tGPU6\tGPU7\tmlx5_0\tmlx5_1\tCPU Affinity\tNUMA Affinity
GPU0\t X \tNV12\tNV12\tNV12\tNV12\tNV12\tNV12\tNV12\tPXB\tSYS\t48-63,176-191\t3
GPU1\tNV12\t X \tNV12\tNV12\tNV12\tNV12\tNV12\tNV12\tPXB\tSYS\t48-63,176-191\t3
GPU2\tNV12\tNV12\t X \tNV12\tNV12\tNV12\tNV12\tNV12\tSYS\tPXB\t16-31,144-159\t1
GPU3\tNV12\tNV12\tNV12\t X \tNV12\tNV12\tNV12\tNV12\tSYS\tPXB\t16-31,144-159\t1
GPU4\tNV12\tNV12\tNV12\tNV12\t X \tNV12\tNV12\tNV12\tSYS\tSYS\t112-127,240-255\t7
GPU5\tNV12\tNV12\tNV12\tNV12\tNV12\t X \tNV12\tNV12\tSYS\tSYS\t112-127,240-255\t7
GPU6\tNV12\tNV12\tNV12\tNV12\tNV12\tNV12\t X \tNV12\tSYS\tSYS\t80-95,208-223\t5
GPU7\tNV12\tNV12\tNV12\tNV12\tNV12\tNV12\tNV12\t X \tSYS\tSYS\t80-95,208-223\t5

Legend:

  X    = Self
  SYS  = Connection traversing PCIe as well as the SMP interconnect between NUMA nodes (e.g., QPI/UPI)
  NODE = Connection traversing PCIe as well as the interconnect between PCIe Host Bridges within a NUMA node
  PHB  = Connection traversing PCIe as well as a PCIe Host Bridge (typically the CPU)
  PXB  = Connection traversing multiple PCIe bridges (without traversing the PCIe Host Bridge)
  PIX  = Connection traversing at most a single PCIe bridge
  NV#  = Connection traversing a bonded set of # NVLinks
"""

# Two 4-GPU NVLink islands joined only through the CPU (a PCIe server with NVLink bridges).
TWO_ISLANDS = """\
        GPU0    GPU1    GPU2    GPU3    GPU4    GPU5    GPU6    GPU7    CPU Affinity
GPU0     X      NV4     NV4     NV4     SYS     SYS     SYS     SYS     0-31
GPU1    NV4      X      NV4     NV4     SYS     SYS     SYS     SYS     0-31
GPU2    NV4     NV4      X      NV4     SYS     SYS     SYS     SYS     0-31
GPU3    NV4     NV4     NV4      X      SYS     SYS     SYS     SYS     0-31
GPU4    SYS     SYS     SYS     SYS      X      NV4     NV4     NV4     32-63
GPU5    SYS     SYS     SYS     SYS     NV4      X      NV4     NV4     32-63
GPU6    SYS     SYS     SYS     SYS     NV4     NV4      X      NV4     32-63
GPU7    SYS     SYS     SYS     SYS     NV4     NV4     NV4      X      32-63
"""


def test_dgx_a100_is_one_island_and_nodes_split_by_the_network():
    rows = parse_nvidia_smi_topo(DGX_A100)
    assert len(rows) == 8 and rows[0][1] == "NV12" and rows[3][3] == "X"
    m = from_nvidia_smi(DGX_A100, nodes=2, inter_gbps=25.0)
    assert m.gbps[0, 1] == 12 * 25.0 and m.gbps[0, 8] == 25.0
    assert m.affinity_groups() == [list(range(8)), list(range(8, 16))]
    assert m.link_classes(m.affinity_groups()) == (300.0, 25.0)


def test_two_nvlink_islands_in_one_server():
    m = from_nvidia_smi(TWO_ISLANDS)
    assert m.affinity_groups() == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_sixteen_node_hostfile_layout():
    text = "".join(f"node-{k:03d} slots=8\n" for k in range(16))
    m = from_hostfile(text, intra_gbps=150.0, inter_gbps=25.0)
    groups = m.affinity_groups()
    assert len(groups) == 16 and all(g == list(range(8 * k, 8 * k + 8)) for k, g in enumerate(groups))


def test_irregular_matrix_is_a_partition():
    """A fast chain 0-1-2 (0 and 2 slow to each other), a fast pair 3-4, a loner 5:
    every rank in exactly one group, whatever order links are seen in."""
    g = np.full((6, 6), 1.0)
    for a, b in [(0, 1), (1, 2), (3, 4)]:
        g[a, b] = g[b, a] = 100.0
    m = BandwidthMatrix(g, source="test")
    groups = m.affinity_groups(threshold_gbps=50.0)
    assert groups == [[0, 1, 2], [3, 4], [5]]
    flat = sorted(r for grp in groups for r in grp)
    assert flat == list(range(6))
    permuted = BandwidthMatrix(g[::-1, ::-1], source="test").affinity_groups(threshold_gbps=50.0)
    assert sorted(map(len, permuted)) == [1, 2, 3]


def test_uneven_nodes_and_bad_hostfile():
    m = from_nodes([3, 5], intra_gbps=100.0, inter_gbps=10.0)
    assert m.affinity_groups() == [[0, 1, 2], [3, 4, 5, 6, 7]]
    from ds_ext.errors import ConfigError
    with pytest.raises(ConfigError, match="hostfile:2: 'b 8': expected 'host slots=N'"):
        from_hostfile("a slots=8\nb 8\n", intra_gbps=1.0, inter_gbps=1.0)


def test_placement_puts_gradients_on_fast_links_when_they_dominate():
    """A large model, few micro-batches: the data-parallel all-reduce dominates, so
    its groups stay inside nodes (DeepSpeed's order)."""
    traffic = StepTraffic(gradient_bytes=8e9, activation_bytes=2e6, micro_batches=8)
    best, preds = choose(pp=4, dp=8, traffic=traffic, ranks_per_node=8, intra_gbps=150, inter_gbps=25)
    assert best.placement == "pipe-data"
    assert {p.placement for p in preds} == {"pipe-data", "data-pipe"}
    assert best.bytes_by_class["inter"] < max(p.bytes_by_class["inter"] for p in preds)


def test_placement_puts_the_pipeline_on_fast_links_when_activations_dominate():
    """A small model, long sequences, many micro-batches, fast compute: the slow link
    cannot keep up with the pipeline, so the stages of a replica belong on one node."""
    traffic = StepTraffic(gradient_bytes=1e7, activation_bytes=5e8, micro_batches=64, compute_seconds=0.001)
    best, _ = choose(pp=4, dp=4, traffic=traffic, ranks_per_node=4, intra_gbps=150, inter_gbps=25)
    assert best.placement == "data-pipe"
    # with MoE layers DeepSpeed's expert groups need its own order
    moe, preds = choose(pp=4, dp=4, moe=True, traffic=traffic, ranks_per_node=4, intra_gbps=150, inter_gbps=25)
    assert moe.placement == "pipe-data" and len(preds) == 1


def test_overlapped_pipeline_traffic_weighs_less_than_a_blocking_all_reduce():
    """Fewer bytes across nodes is not always faster: pipeline transfers hide behind
    compute, the gradient all-reduce does not (the case benchmarks/topology_cluster.py
    measures: 2 x 2 ranks, tiny recipe, 512-token sequences, 25 MB/s links)."""
    traffic = StepTraffic(gradient_bytes=1.9e6, activation_bytes=5.2e5, micro_batches=4, compute_seconds=0.1)
    kw = dict(pp=2, dp=2, traffic=traffic, ranks_per_node=2, intra_gbps=50.0, inter_gbps=0.025)
    pipe_data, data_pipe = predict("pipe-data", **kw), predict("data-pipe", **kw)
    assert pipe_data.bytes_by_class["inter"] > data_pipe.bytes_by_class["inter"]
    assert choose(**kw)[0].placement == "pipe-data"


def test_flows_count_every_group():
    traffic = StepTraffic(gradient_bytes=100.0, activation_bytes=1.0, micro_batches=3, expert_bytes=10.0)
    f = flows("pipe-data", pp=2, dp=4, ep=2, traffic=traffic)
    dp_edges = [x for x in f if x[2] == 2 * 3 / 4 * 100.0]
    pp_edges = [x for x in f if x[2] == 6.0]
    ep_edges = [x for x in f if x[2] == 20.0]
    assert len(dp_edges) == 8 and len(pp_edges) == 4 and len(ep_edges) == 4
    p = predict("pipe-data", pp=2, dp=4, traffic=traffic, ranks_per_node=4, intra_gbps=1.0, inter_gbps=1.0)
    assert p.bytes_by_class["inter"] == 4 * 6.0    # only the pipeline crosses nodes


def _hierarchical(sizes, segments):
    import torch.distributed as tdist
    from ds_ext.topology.groups import NodeGroups, hierarchical_all_reduce
    rank = tdist.get_rank()
    groups = NodeGroups.contiguous(tdist.get_world_size(), 2)
    out = []
    for size in sizes:
        g = torch.Generator().manual_seed(1000 * rank + size)
        ints = torch.randint(-1000, 1000, (size,), generator=g).float()   # sums are exact in fp32
        floats = torch.randn(size, generator=g)
        expected_ints, expected_floats, abs_sum = ints.clone(), floats.clone(), floats.abs().double()
        tdist.all_reduce(expected_ints)
        tdist.all_reduce(expected_floats)
        tdist.all_reduce(abs_sum)
        hierarchical_all_reduce(ints, groups, segments=segments)
        hierarchical_all_reduce(floats, groups, segments=segments)
        # the same 4 terms added in two orders: each sum is within gamma_3 * sum|x| of the
        # exact one (tests/numerics.py), so the two are within twice that of each other
        bound = 2 * sum_error_bound(abs_sum.numpy(), tdist.get_world_size())
        within = bool((np.abs(floats.double().numpy() - expected_floats.double().numpy()) <= bound).all())
        out.append((torch.equal(ints, expected_ints), within))
    return groups.rails, groups.node_ranks, out


@pytest.mark.multirank
def test_hierarchical_all_reduce_equals_flat():
    results = run_ranks(_hierarchical, world_size=4, args=([1, 7, 1000, 4099], 4), timeout=120)
    for rails, _node_ranks, checks in results:
        assert rails == [[0, 2], [1, 3]]
        for exact, within in checks:
            assert exact and within


def _probe():
    from ds_ext.topology.bandwidth import probe
    m = probe(nbytes=2**20, rounds=1, log=lambda *_: None)
    return m.gbps


@pytest.mark.multirank
def test_probe_measures_every_pair():
    results = run_ranks(_probe, world_size=3, timeout=120)
    g = results[0]
    assert all((r == g).all() for r in results)           # every rank gets the same matrix
    off = g[~np.eye(3, dtype=bool)]
    assert (off > 0).all() and np.isinf(np.diag(g)).all()


def test_placement_traffic_counts_the_expert_bytes_the_dispatcher_sends():
    """The placement model's expert all-to-all is the configured dispatcher's: every-copy
    k rows a token, deduplicated one row to each rank holding its experts (the expected
    count under free routing: P ranks x P(a rank's E/P experts get one of k), for top-8 of
    32 over 4 ranks 4 x (1 - C(24, 8) / C(32, 8))) with min(k, E/P) routing slots of 6
    bytes, FP8 on the forward dispatch only."""
    import math
    from types import SimpleNamespace

    from ds_ext.sections import MoeSection
    from ds_ext.topology.setup import estimate_traffic
    from recipes import deepseek_v3
    mc = deepseek_v3.make_config("tiny-moe", {"hidden_size": 128, "n_routed_experts": 32, "num_experts_per_tok": 8})
    layout = SimpleNamespace(micro_batch=2, seq_len=64, grad_accum=4, pipe_stages=1)
    kw = dict(model_config=mc, layout=layout, ds={}, stage_params=1e6, compute_tflops=1.0)
    tokens = 2 * 64 * 4 * mc.num_moe_layers()
    every = estimate_traffic(moe=MoeSection(expert_parallel_size=4, dispatcher="every-copy"), **kw).expert_bytes
    assert every == tokens * 8 * 128 * 4
    dedup = estimate_traffic(moe=MoeSection(expert_parallel_size=4), **kw).expert_bytes
    rows = 4 * (1 - math.comb(24, 8) / math.comb(32, 8))
    assert math.isclose(dedup, tokens * rows * (128 * 4 + 8 * 6 / 4), rel_tol=1e-12)
    assert dedup < 0.5 * every
    fp8 = estimate_traffic(moe=MoeSection(expert_parallel_size=4, dispatch_dtype="fp8"), **kw).expert_bytes
    assert math.isclose(fp8, tokens * rows * ((132 + 8 * 6) + 3 * 128 * 4) / 4, rel_tol=1e-12)
    assert estimate_traffic(moe=SimpleNamespace(expert_parallel_size=1), **kw).expert_bytes == 0.0

"""The collective model (ds_ext/planner/collectives.py): ring and tree all-reduce and
the all-to-all by hand; the node's NICs shared by the groups on it; NCCL-style algorithm
choice; the planner's gradient reduction is the model's all-reduce; bad hardware
figures refused with the flag to fix; published figures (nccl-tests all-reduce bus
bandwidths, DeepEP's dispatch/combine on H800, benchmarks/collective_model.py) within
15 %; and gloo on a simulated 2 x 2 cluster (launch/simcluster.py): its all-reduce within
15 % of the model given the link's measured rate, its all-to-all no faster than the
model's wire time allows. About 10-30 s (the simulated cluster 6-23 s on this loaded
2-core machine; needs root, skipped without namespaces)."""

import os
import subprocess

import pytest

from benchmarks import collective_model as bench
from ds_ext.errors import ConfigError
from ds_ext.planner import collectives as cc
from ds_ext.planner import Hardware, make_plan

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GB = 1e9


def _fabric(**changes):
    kw = {"gpus_per_node": 8, "nics_per_node": 8, "nic_gbps": 50.0, "nvlink_gbps": 450.0}
    return cc.Fabric(**(kw | changes))


def test_ring_all_reduce_by_hand():
    """Ring over 4 nodes x 8: each node sends 2 (n-1)/n x S through its 8 NICs, each GPU
    7/8 of its 2 (n-1)/n x S over NVLink; a chunk goes round twice, 28 NVLink hops and 4
    NIC hops a time."""
    f = _fabric(nic_efficiency=0.9, nic_latency_us=5.0, nvlink_latency_us=1.0)
    size, n = 1e9, 32
    ring = cc.all_reduce(size, nodes=4, per_node=8, fabric=f, algorithm="ring")
    sent = 2 * (n - 1) / n * size
    assert ring.seconds == pytest.approx(sent / (8 * 45 * GB) + 2 * (28 * 1 + 4 * 5) * 1e-6)
    assert ring.bottleneck == "nic" and ring.busbw == pytest.approx(size / ring.seconds * sent / size)
    assert ring.inter_bytes == pytest.approx(4 * sent) and ring.intra_bytes == pytest.approx(28 * sent)
    single = cc.all_reduce(size, nodes=1, per_node=8, fabric=f)       # NVLink only, no NIC
    assert single.algorithm == "ring" and single.inter_bytes == 0
    assert single.busbw == pytest.approx(450 * GB, rel=0.01)        # 14 us of latency on 3.9 ms
    assert cc.all_reduce(size, nodes=1, per_node=1, fabric=f).seconds == 0


def test_reduce_scatter_and_all_gather_are_half_the_ring():
    f = _fabric()
    ar = cc.all_reduce(1e9, nodes=4, per_node=8, fabric=f, algorithm="ring")
    for one in (cc.reduce_scatter(1e9, nodes=4, per_node=8, fabric=f), cc.all_gather(1e9, nodes=4, per_node=8, fabric=f)):
        assert one.inter_bytes == pytest.approx(ar.inter_bytes / 2) and one.busbw == pytest.approx(ar.busbw)


def test_tree_where_nccl_takes_it():
    """Two nodes: the tree sends S per node, not 2 (n-1)/n x S, so it wins where the
    NVLink chain (2 (m-1)/m x S per GPU) keeps up (H100: 360 GB/s), not on H800
    (160 GB/s); small messages across many nodes: log2 N hops beat the ring's."""
    h100 = Hardware(intra_gbps=450.0).fabric()
    h800 = Hardware().fabric()
    assert cc.all_reduce(8e9, nodes=2, per_node=8, fabric=h100).algorithm == "tree"
    assert cc.all_reduce(8e9, nodes=2, per_node=8, fabric=h800).algorithm == "ring"
    assert cc.all_reduce(8e9, nodes=2, per_node=8, fabric=h800, algorithm="tree").bottleneck == "nvlink"
    small = cc.all_reduce(1e6, nodes=128, per_node=8, fabric=h800)
    assert small.algorithm == "tree" and small.bottleneck == "latency"
    tree = cc.all_reduce(8e9, nodes=2, per_node=8, fabric=_fabric(nvlink_gbps=1e6), algorithm="tree")
    assert tree.inter_bytes == pytest.approx(2 * 8e9)           # S out of each of the 2 nodes


def test_groups_share_the_nodes_nics():
    """A group of 2 ranks per node shares the node's 8 NICs with the 3 groups beside it
    (the other pipeline stages' data-parallel groups): 2 NICs' worth, unless told it is
    alone on the node."""
    f = _fabric(nvlink_gbps=1e6)
    full = cc.all_reduce(1e9, nodes=16, per_node=8, fabric=f, algorithm="ring")
    shared = cc.all_reduce(1e9, nodes=16, per_node=2, fabric=f, algorithm="ring")
    alone = cc.all_reduce(1e9, nodes=16, per_node=2, fabric=f, algorithm="ring", groups_per_node=1)
    assert shared.busbw == pytest.approx(full.busbw / 4, rel=0.01) and alone.busbw == pytest.approx(full.busbw, rel=0.01)
    with pytest.raises(ValueError, match="do not fit a node"):
        cc.all_reduce(1e9, nodes=2, per_node=4, fabric=f, groups_per_node=3)
    with pytest.raises(ConfigError, match="--gpus-per-node"):
        cc.all_reduce(1e9, nodes=2, per_node=16, fabric=f)


def test_all_to_all_by_hand_and_forwarding():
    """Direct: each node sends m (n-m)/n x S out, each GPU (m-1)/n x S over NVLink.
    Forwarding moves no fewer NIC bytes for a plain all-to-all, but sends a MoE token
    bound for several GPUs of a node across once (DeepEP)."""
    f = _fabric(nvlink_a2a_efficiency=0.5)
    a2a = cc.all_to_all(1e9, nodes=4, per_node=8, fabric=f)
    assert a2a.seconds == pytest.approx(max(8 * 24 / 32 * 1e9 / (8 * 50 * GB), 7 / 32 * 1e9 / (225 * GB)))
    fwd = cc.all_to_all(1e9, nodes=4, per_node=8, fabric=f, forwarding=True)
    assert fwd.inter_bytes == pytest.approx(a2a.inter_bytes) and fwd.intra_bytes > a2a.intra_bytes
    kw = {"tokens": 4096, "token_bytes": 7168, "nodes": 4, "per_node": 8, "fabric": f, "num_experts": 256, "top_k": 8}
    direct, _ = cc.moe_dispatch(forwarding=False, **kw)
    forwarded, logical = cc.moe_dispatch(forwarding=True, **kw)
    r = cc.routing(nodes=4, per_node=8, num_experts=256, top_k=8)
    assert forwarded.inter_bytes == pytest.approx(32 * 4096 * 7168 * (r.nodes_per_token - r.local_node))
    assert forwarded.inter_bytes < 0.5 * direct.inter_bytes and logical == pytest.approx(4096 * 7168 * r.nodes_per_token)
    assert r.ranks_per_token == pytest.approx(32 * (1 - (248 * 247 * 246 * 245 * 244 * 243 * 242 * 241)
                                                    / (256 * 255 * 254 * 253 * 252 * 251 * 250 * 249)))


@pytest.mark.parametrize("row", bench.PUBLISHED_ALLREDUCE, ids=lambda r: r["setup"])
def test_published_all_reduce_bus_bandwidth(row):
    """Within 15 % of the published nccl-tests figure (the middle of a quoted range)."""
    got = bench.predict_allreduce(row).busbw / GB
    assert abs(got / row["figure"] - 1) < 0.15, (got, row["figure"], row["source"])


@pytest.mark.parametrize("phase", ["dispatch", "combine"])
@pytest.mark.parametrize("row", bench.PUBLISHED_DEEPEP, ids=lambda r: f"EP{r['ep']}")
def test_deepep_bandwidths(row, phase):
    """Within 15 % of DeepEP's H800 table; EP8's dispatch is where Hardware's
    nvlink_a2a_efficiency comes from, so it holds to 1 %."""
    got, _ = bench.predict_deepep(row["ep"], phase)
    tolerance = 0.01 if row.get("calibration") and phase == "dispatch" else 0.15
    assert abs(got / row[phase] - 1) < tolerance, (got, row[phase])


def test_planner_reduction_is_the_models_all_reduce():
    """128 nodes, pipe-data: each stage's 256 replicas on 32 whole nodes, fp32 gradients;
    the planner's dense reduction is the model's all-reduce of the slowest stage's
    gradients, the routed experts' after the rest (the trainer reduces them apart), and
    5-10x below a ring through one 25 GB/s NIC: the model's rings run over all 8 of a node's
    NICs (one per rail)."""
    plan = make_plan(os.path.join(ROOT, "ds_configs", "128node.json"), nodes=128, ranks_per_node=8)
    fabric = Hardware().fabric()
    want = max(sum(cc.all_reduce(4 * numel, nodes=32, per_node=8, fabric=fabric).seconds
                   for numel in (st.params - st.expert_params, st.expert_params)) for st in plan.stages)
    assert plan.dp_total_seconds == pytest.approx(want)         # the reduction's own time (the config overlaps it)
    one_nic_ring = 2 * 255 / 256 * 4 * max(st.params for st in plan.stages) / (25 * GB)
    assert 5 < one_nic_ring / plan.dp_total_seconds < 10


def test_bad_hardware_names_the_flag(capsys):
    from launch.plan import main, parse_args
    cfg = os.path.join(ROOT, "ds_configs", "tiny_cpu.json")
    for flag, value in (("--nics-per-node", "0"), ("--nic-gbps", "0"), ("--intra-gbps", "-1")):
        assert main(["--deepspeed", cfg, "--nodes", "1", "--gpus-per-node", "2", flag, value]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and flag in err and err.count("\n") == 1, err
    assert parse_args(["--deepspeed", cfg, "--inter-gbps", "25"]).inter_gbps == 25.0      # --nic-gbps's alias
    with pytest.raises(ConfigError, match="nic_efficiency"):
        Hardware(nic_efficiency=1.5)


def _netns_allowed():
    if os.geteuid() != 0:
        return "not root"
    name = f"sscoll{os.getpid()}"
    if subprocess.run(["ip", "netns", "add", name], capture_output=True, check=False).returncode != 0:
        return "ip netns add failed"
    subprocess.run(["ip", "netns", "del", name], capture_output=True, check=False)
    return None


@pytest.mark.e2e
@pytest.mark.skipif(_netns_allowed() is not None, reason="network namespaces unavailable")
def test_gloo_on_a_simulated_cluster_within_15_percent():
    """2 nodes x 2 ranks at 1 Gbit/s, 16 MiB per rank, against the model given the link's
    rate and latency measured by point-to-point transfers in the same run: gloo's ring
    all-reduce within 15 % (median of 5 runs). The all-to-all only as a bound, the model
    no more than 15 % above the best run: its eight flows each way into one shaped queue
    take 1.09-1.37x the model's time (medians, benchmarks/collective_model.py), unevenly from run
    to run (congestion, which the model leaves out), so 15 % both ways is not robust on
    this machine and stays a benchmark row."""
    measured = bench.run_simcluster("1gbit", sizes=[16], repeats=5, port=29681, timeout=240)
    rows = {r["collective"]: r for r in bench.simcluster_rows(measured, "1gbit")}
    assert abs(rows["all_reduce"]["ratio"] - 1) < 0.15, rows["all_reduce"]
    assert rows["all_to_all"]["ratio_best"] < 1.15, rows["all_to_all"]

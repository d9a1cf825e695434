"""The collective model (ds_ext/planner/collectives.py) against what was measured:

1. published nccl-tests all-reduce bus bandwidths (multi-node, 8 GPUs and 8 NICs per
   node, and single-node NVLink) and DeepEP's dispatch/combine bandwidths on H800
   (intranode EP8 over NVLink, internode EP16/32/64 over 400 Gb/s CX7 RDMA): the
   model's figure for each published setup, and the ratio;
2. gloo on a simulated cluster (launch/simcluster.py: 2 nodes x 2 ranks, one tc-shaped
   link per node, loopback inside a node) at two link speeds: all-reduce (gloo's ring
   over all ranks) and all-to-all of a few sizes, timed, against the model given the
   link's payload rate and latency measured in the same namespaces (a point-to-point
   transfer and a ping-pong), the one NIC per node and loopback as the "NVLink".

    python benchmarks/collective_model.py --json benchmarks/results/collective_model.json
    python benchmarks/collective_model.py --published-only

Rows: {source, collective, setup, bytes, measured_or_published_gbps (or seconds),
predicted, ratio = predicted / measured}. Needs root for the simulated cluster.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from ds_ext.planner import collectives as cc

GIB = 2**30


def _fabric(*, nic_gbps, nvlink_gbps, nics=8):
    """An 8-GPU node with the Hardware defaults' efficiencies and latencies."""
    from ds_ext.planner import Hardware
    hw = Hardware(gpus_per_node=8, nics_per_node=nics, inter_gbps=nic_gbps, intra_gbps=nvlink_gbps)
    return hw.fabric()


H100 = {"nic_gbps": 50.0, "nvlink_gbps": 450.0}          # NDR 400 Gb/s; NVLink 4, 18 links x 25 GB/s one way
H800 = {"nic_gbps": 50.0, "nvlink_gbps": 200.0}          # CX7 400 Gb/s; NVLink 4, 8 links x 25 GB/s one way
A100 = {"nic_gbps": 25.0, "nvlink_gbps": 300.0}          # HDR 200 Gb/s; NVLink 3, 12 links x 25 GB/s one way

# Published nccl-tests all_reduce_perf bus bandwidths at large sizes (GB/s). ``figure``
# is the middle of a quoted range; the model runs NCCL's choice (ring or tree).
PUBLISHED_ALLREDUCE = [
    {"source": "https://saturncloud.io/blog/crusoe-nccl-cluster-validation",
     "quote": "H100 SXM, NVLink + IB NDR: 400-450 GB/s expected bus bandwidth (8 GB+; node count not stated)",
     "setup": "H100 multi-node (2 nodes assumed), 8 x 400 Gb/s IB", "hw": H100, "nodes": 2, "figure": 425.0},
    {"source": "https://github.com/NVIDIA/nccl-tests/issues/290",
     "quote": "NVIDIA (AddyLaddy): for NDR @ 400Gbps you should see 46-48GB/s per NIC (2 nodes, NCCL_ALGO=RING)",
     "setup": "H100 2 nodes, ring, 8 x 400 Gb/s IB", "hw": H100, "nodes": 2, "figure": 8 * 47.0, "algorithm": "ring"},
    {"source": "https://github.com/NVIDIA/nccl-tests/issues/283",
     "quote": "248 servers x 8 H200, 8 HCAs each, default NCCL_ALGO, 512 MB: bus bandwidth typically around 350 "
              "(NIC speed not stated: 400 Gb/s assumed)",
     "setup": "H200 248 nodes, 8 NICs (400 Gb/s assumed), 512 MB", "hw": H100, "nodes": 248, "figure": 350.0,
     "bytes": 512 * 2**20},
    {"source": "https://github.com/NVIDIA/nccl-tests/issues/153",
     "quote": "two H800 servers, 8 H800 and 8 x 100 Gbps CX-6 each: busbw as high as 161 (nccl-tests' GB/s; the "
              "issue writes Gbps), NCCL having chosen NVLS",
     "setup": "H800 2 nodes, 8 x 100 Gb/s", "hw": {"nic_gbps": 12.5, "nvlink_gbps": 200.0}, "nodes": 2,
     "figure": 161.0},
    {"source": "https://docs.alayanew.com/en/docs/tech-blog/2026-05-06-nccl-tests",
     "quote": "8 x A100 SXM4 NVLink (single node): busbw 230-250 GB/s at large sizes",
     "setup": "A100 1 node, NVLink 3", "hw": A100, "nodes": 1, "figure": 240.0},
]

# DeepEP V1 normal kernels on H800 (~160 GB/s NVLink), one CX7 400 Gb/s NIC per GPU;
# 4096 tokens per rank, hidden 7168, 256 experts, top-8 of min(nodes, 4) nodes, FP8
# dispatch (1 byte + a 4-byte scale per 128), BF16 combine. "Bottleneck bandwidth":
# NVLink receive bytes / time intranode, logical RDMA bytes / time internode (its
# test_internode.py: a token counted once per node it goes to, its own node included).
DEEPEP = "https://github.com/deepseek-ai/DeepEP/blob/main/docs/legacy.md#performance"
PUBLISHED_DEEPEP = [
    {"ep": 8, "dispatch": 153.0, "combine": 158.0, "calibration": True},
    {"ep": 16, "dispatch": 43.0, "combine": 43.0},
    {"ep": 32, "dispatch": 58.0, "combine": 57.0},
    {"ep": 64, "dispatch": 51.0, "combine": 50.0},
]


def predict_allreduce(row):
    fabric = _fabric(**row["hw"])
    cost = cc.all_reduce(row.get("bytes", 8 * GIB), nodes=row["nodes"], per_node=8, fabric=fabric,
                         algorithm=row.get("algorithm", "auto"))
    return cost


def predict_deepep(ep, phase):
    """DeepEP's quoted bandwidth (GB/s) the model gives for EP ``ep``, ``phase``
    "dispatch" (FP8) or "combine" (BF16: the dispatch's bytes back)."""
    nodes = ep // 8
    token_bytes = 7168 * (1 + 4 / 128) if phase == "dispatch" else 7168 * 2
    cost, logical = cc.moe_dispatch(tokens=4096, token_bytes=token_bytes, nodes=nodes, per_node=8,
                                    fabric=_fabric(**H800), num_experts=256, top_k=8, top_groups=min(nodes, 4),
                                    forwarding=True)
    return (cost.algbw if nodes == 1 else logical / cost.seconds) / 1e9, cost


def published_rows():
    rows = []
    for r in PUBLISHED_ALLREDUCE:
        cost = predict_allreduce(r)
        rows.append({"source": r["source"], "collective": "all_reduce", "setup": r["setup"],
                     "bytes": r.get("bytes", 8 * GIB), "measured_or_published_gbps": r["figure"],
                     "predicted": cost.busbw / 1e9, "ratio": cost.busbw / 1e9 / r["figure"],
                     "note": f"{cost.algorithm}, {cost.bottleneck}-bound; {r['quote']}"})
    for r in PUBLISHED_DEEPEP:
        for phase in ("dispatch", "combine"):
            got, cost = predict_deepep(r["ep"], phase)
            rows.append({"source": DEEPEP, "collective": f"moe_{phase}",
                         "setup": f"H800 EP{r['ep']} ({'NVLink' if r['ep'] == 8 else 'RDMA'})",
                         "bytes": cost.algbw * cost.seconds, "measured_or_published_gbps": r[phase],
                         "predicted": got, "ratio": got / r[phase],
                         "note": f"{cost.bottleneck}-bound" + ("; calibrates nvlink_a2a_efficiency"
                                                               if r.get("calibration") and phase == "dispatch" else "")})
    return rows


# ---- gloo on the simulated cluster ----------------------------------------------------

def _worker(args):
    """One rank: measure the links, then time the collectives; rank 0 writes JSON."""
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://{args.master}:{args.port}", rank=args.rank,
                            world_size=args.world)
    rank, world, per_node = dist.get_rank(), dist.get_world_size(), args.per_node

    def rate(peer, nbytes):
        from benchmarks import oneway_bytes_per_s
        return oneway_bytes_per_s(dist, peer, nbytes)

    def latency(peer, rounds=20):
        """Half a 4-byte round trip between rank 0 and ``peer`` (median)."""
        buf, times = torch.zeros(1), []
        for _ in range(rounds):
            dist.barrier()
            t0 = time.perf_counter()
            if rank == 0:
                dist.send(buf, peer)
                dist.recv(buf, peer)
            elif rank == peer:
                dist.recv(buf, 0)
                dist.send(buf, 0)
            times.append((time.perf_counter() - t0) / 2)
        out = torch.tensor([statistics.median(times)], dtype=torch.float64)
        dist.broadcast(out, 0)
        return float(out)

    def timed(fn):
        times = []
        for _ in range(args.repeats):
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            dist.barrier()
            times.append(time.perf_counter() - t0)
        return statistics.median(times), times

    result = {"world": world, "per_node": per_node,
              "link_bps": rate(per_node, args.probe_mb * 2**20), "loop_bps": rate(1, 4 * args.probe_mb * 2**20),
              "link_latency_s": latency(per_node), "loop_latency_s": latency(1), "rows": []}
    for mb in args.sizes:
        x = torch.ones(int(mb * 2**20) // 4)
        out = torch.empty_like(x)
        for name, fn in (("all_reduce", lambda: dist.all_reduce(x)),          # noqa: B023
                         ("all_to_all", lambda: dist.all_to_all_single(out, x))):  # noqa: B023
            median, runs = timed(fn)
            result["rows"].append({"collective": name, "bytes": x.numel() * 4, "seconds": median, "runs": runs})
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    dist.destroy_process_group()


def run_simcluster(rate, *, sizes, repeats=3, probe_mb=16, nodes=2, per_node=2, port=29671, timeout=600):
    """Run the worker on every rank of a fresh simulated cluster at ``rate``; the
    measurements (rank 0's JSON)."""
    sys.path.insert(0, os.path.join(ROOT, "launch"))
    from simcluster import SimCluster
    with tempfile.TemporaryDirectory(prefix="seekspeed-collectives-") as tmp, SimCluster(nodes, rate=rate) as cluster:
        out = os.path.join(tmp, "measured.json")
        env = dict(os.environ, GLOO_SOCKET_IFNAME="eth0", PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
        procs = []
        for rank in range(nodes * per_node):
            cmd = ["ip", "netns", "exec", cluster.node_ns(rank // per_node), sys.executable, os.path.abspath(__file__),
                   "--worker", "--rank", str(rank), "--world", str(nodes * per_node), "--per-node", str(per_node),
                   "--master", cluster.address(0), "--port", str(port), "--out", out, "--repeats", str(repeats),
                   "--probe-mb", str(probe_mb), "--sizes", *map(str, sizes)]
            procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                          text=True))
        deadline = time.monotonic() + timeout
        logs = []
        for p in procs:
            try:
                logs.append(p.communicate(timeout=max(1, deadline - time.monotonic()))[0])
            except subprocess.TimeoutExpired:
                for q in procs:
                    q.kill()
                raise RuntimeError(f"simcluster collectives at {rate} timed out after {timeout}s") from None
        if any(p.returncode for p in procs):
            raise RuntimeError(f"a rank failed at {rate}:\n" + "\n".join(log[-2000:] for log in logs))
        with open(out) as f:
            return json.load(f)


def gloo_fabric(measured):
    """The simulated node: ``per_node`` ranks on loopback, one shaped link, at the
    measured payload rates and latencies (efficiencies 1: the rates are what got through)."""
    return cc.Fabric(gpus_per_node=measured["per_node"], nics_per_node=1, nic_gbps=measured["link_bps"] / 1e9,
                     nvlink_gbps=measured["loop_bps"] / 1e9, nic_latency_us=measured["link_latency_s"] * 1e6,
                     nvlink_latency_us=measured["loop_latency_s"] * 1e6)


def predict_gloo(measured, collective, nbytes):
    """Seconds the model gives for gloo's ``collective`` of ``nbytes`` per rank."""
    where = {"nodes": measured["world"] // measured["per_node"], "per_node": measured["per_node"],
             "fabric": gloo_fabric(measured)}
    if collective == "all_reduce":
        return cc.all_reduce(nbytes, algorithm="ring", **where).seconds         # gloo: a ring over all ranks
    return cc.all_to_all(nbytes, **where).seconds


def simcluster_rows(measured, rate):
    rows = []
    for r in measured["rows"]:
        predicted = predict_gloo(measured, r["collective"], r["bytes"])
        rows.append({"source": f"gloo, launch/simcluster.py 2 x 2 at {rate}", "collective": r["collective"],
                     "setup": f"2 nodes x 2 ranks, link {measured['link_bps'] * 8 / 1e9:.3f} Gbit/s payload, "
                              f"loopback {measured['loop_bps'] / 1e9:.2f} GB/s",
                     "bytes": r["bytes"], "measured_or_published_seconds": r["seconds"], "predicted": predicted,
                     "ratio": predicted / r["seconds"], "best_seconds": min(r["runs"]),
                     "ratio_best": predicted / min(r["runs"]), "runs": r["runs"]})
    return rows


def _table(rows):
    """Published rows in GB/s; measured rows in seconds, the median and the best run."""
    if "best_seconds" in rows[0]:
        lines = [(f"{'collective':<11} {'MiB':>5} {'median s':>9} {'best s':>8} {'model s':>8} {'model/median':>12} "
                  f"{'model/best':>10}")]
        lines += [f"{r['collective']:<11} {r['bytes'] / 2**20:5.0f} {r['measured_or_published_seconds']:9.3f} "
                  f"{r['best_seconds']:8.3f} {r['predicted']:8.3f} {r['ratio']:12.2f} {r['ratio_best']:10.2f}"
                  for r in rows]
        return "\n".join(lines)
    lines = [f"{'collective':<13} {'setup':<48} {'published':>9} {'model':>7} {'ratio':>6}"]
    lines += [f"{r['collective']:<13} {r['setup'][:48]:<48} {r['measured_or_published_gbps']:9.1f} "
              f"{r['predicted']:7.1f} {r['ratio']:6.2f}" for r in rows]
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rates", nargs="+", default=["1gbit", "300mbit"])
    p.add_argument("--sizes", type=float, nargs="+", default=[4, 16, 64], help="MiB per rank")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--probe-mb", type=int, default=16)
    p.add_argument("--published-only", action="store_true")
    p.add_argument("--json")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    for name in ("--rank", "--world", "--per-node", "--port"):
        p.add_argument(name, type=int, help=argparse.SUPPRESS)
    p.add_argument("--master", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return _worker(args)
    rows = published_rows()
    print("published figures (GB/s; nccl-tests busbw for all-reduce, DeepEP's bottleneck bandwidth):")
    print(_table(rows))
    measured = {}
    if not args.published_only:
        if os.geteuid() != 0:
            sys.exit("the simulated cluster needs root (ip netns, tc); run with --published-only")
        for k, rate in enumerate(args.rates):
            print(f"\ngloo on 2 x 2 simulated nodes at {rate} ...", file=sys.stderr, flush=True)
            measured[rate] = run_simcluster(rate, sizes=args.sizes, repeats=args.repeats, probe_mb=args.probe_mb,
                                            port=29671 + k)
            sim = simcluster_rows(measured[rate], rate)
            m = measured[rate]
            print(f"\ngloo, 2 x 2 simulated nodes at {rate}: link {m['link_bps'] * 8 / 1e9:.3f} Gbit/s payload, "
                  f"{m['link_latency_s'] * 1e6:.0f} us; loopback {m['loop_bps'] / 1e9:.2f} GB/s, "
                  f"{m['loop_latency_s'] * 1e6:.0f} us ({args.repeats} runs each)")
            print(_table(sim))
            rows += sim
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "simcluster": measured}, f, indent=2)


if __name__ == "__main__":
    main()

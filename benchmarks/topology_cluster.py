"""On a simulated cluster of 2 nodes x 2 ranks (launch/simcluster.py), in one run:

1. flat vs hierarchical all-reduce of 16, 64 and 256 MiB over 1 Gbit/s links, next to
   the bound (benchmarks/hierarchical_allreduce.py);
2. the tiny recipe's training step (2 stages x 2 replicas, 512-token sequences) over
   200 Mbit/s links with each placement forced (pipe-data, DeepSpeed's: each
   replica's stages on different nodes; data-pipe: each data-parallel group across
   nodes) and with the topology-aware choice (auto; compute_tflops set to what this
   CPU sustains), interleaved.

    python benchmarks/topology_cluster.py --json bench_out/topology.json
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _simcluster(rate, command, *, log_dir=None):
    cmd = [sys.executable, os.path.join(ROOT, "launch", "simcluster.py"), "--nodes", "2", "--ranks-per-node", "2",
           "--rate", rate, "--tail", "0"] + (["--log-dir", log_dir] if log_dir else []) + ["--"] + command
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"simcluster failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc.stdout


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", type=int, nargs="+", default=[16, 64, 256])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--train-steps", type=int, default=12)
    p.add_argument("--train-repeats", type=int, default=2)
    p.add_argument("--train-rate", default="200mbit")
    p.add_argument("--json")
    args = p.parse_args()
    out = {}
    with tempfile.TemporaryDirectory(prefix="seekspeed-topo-") as tmp:
        ar_json = os.path.join(tmp, "allreduce.json")
        print("all-reduce on 2 x 2 ranks, 1gbit ...", file=sys.stderr, flush=True)
        _simcluster("1gbit", ["benchmarks/hierarchical_allreduce.py", "--sizes", *map(str, args.sizes), "--repeats",
                              str(args.repeats), "--json", ar_json])
        with open(ar_json) as f:
            out["allreduce"] = json.load(f)

        with open(os.path.join(ROOT, "ds_configs", "tiny_cpu.json")) as f:
            base = json.load(f)
        base["train_micro_batch_size_per_gpu"], base["gradient_accumulation_steps"] = 2, 4
        base["seekspeed"]["data"]["seq_len"] = 512
        base["seekspeed"]["train"]["log_interval"] = 1000
        runs = {"pipe-data": [], "data-pipe": [], "auto": []}
        for rep in range(args.train_repeats):
            for placement in runs:
                cfg = json.loads(json.dumps(base))
                cfg["seekspeed"]["topology"] = {"placement": placement, "intra_node_gbps": 50.0,
                                                "inter_node_gbps": 0.025, "compute_tflops": 0.02}
                path = os.path.join(tmp, f"{placement}.json")
                with open(path, "w") as f:
                    json.dump(cfg, f)
                summary = os.path.join(tmp, f"summary-{placement}-{rep}.json")
                logs = os.path.join(tmp, f"logs-{placement}-{rep}")
                print(f"[{rep + 1}/{args.train_repeats}] training, placement {placement}, {args.train_rate} ...",
                      file=sys.stderr, flush=True)
                _simcluster(args.train_rate, ["launch/train.py", "--deepspeed", path, "--steps", str(args.train_steps),
                                              "--checkpoint-dir", os.path.join(tmp, f"ck-{placement}-{rep}"),
                                              "--summary-json", summary], log_dir=logs)
                with open(summary) as f:
                    s = json.load(f)
                with open(os.path.join(logs, "node0.log")) as f:
                    chosen = next((line.split("placement ")[1].split()[0] for line in f if line.startswith("topology:")),
                                  placement)
                tokens = s["layout"]["tokens_per_step"]
                runs[placement].append({"step_s": tokens / s["steady_tokens_per_s"], "chosen": chosen})
        out["training"] = {k: {"step_s": statistics.median(r["step_s"] for r in v), "chosen": v[0]["chosen"],
                               "runs_s": [r["step_s"] for r in v]} for k, v in runs.items()}
        out["training_rate"] = args.train_rate

    ar = out["allreduce"]
    print(f"\nall-reduce, 2 nodes x 2 ranks, inter-node payload {ar['link_bps'] * 8 / 1e9:.2f} Gbit/s, float32, "
          f"median of {args.repeats}")
    print(f"{'MiB':>5} {'flat s':>8} {'hier. s':>8} {'speedup':>8} {'bound s':>8} {'hier/bound':>10}")
    for r in ar["rows"]:
        print(f"{r['mib']:>5} {r['flat_s']:8.3f} {r['hierarchical_s']:8.3f} {r['speedup']:7.2f}x {r['bound_s']:8.3f} "
              f"{r['over_bound']:9.2f}x")
    t = out["training"]
    print(f"\ntiny recipe, 2 stages x 2 replicas, 512-token sequences, {args.train_rate} between nodes, "
          f"median of {args.train_repeats}")
    for k, v in t.items():
        print(f"  placement {k:<9} (runs as {v['chosen']}): {v['step_s'] * 1e3:7.1f} ms per step")
    faster = min(("pipe-data", "data-pipe"), key=lambda k: t[k]["step_s"])
    print(f"  measured faster: {faster}; auto chose {t['auto']['chosen']}")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()

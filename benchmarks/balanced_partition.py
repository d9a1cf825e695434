"""``pipeline.partition: "balanced"`` against the recipe's default cut, on CPU ranks.

The tiny recipe with a 16,384-word vocabulary and 8 decoder layers: the default
``type:DecoderLayerPipe`` gives every stage (1f1b) or chunk (dualpipev) the same number
of decoder layers, so the stage with the head (about 10 decoder layers of FLOPs, 5-6
measured here) is the bottleneck, and under dualpipev rank 0 holds both the embedding
and the head. Two ranks by default: each has a core of its own on a 2-core machine;
with more ranks than cores the ranks' compute shares the cores, and the step measures
the total work rather than the busiest rank.
"balanced" cuts from the planner's per-layer costs (ds_ext/planner/), given
this machine's figures as seekspeed.topology.compute_tflops and memory_gbps: one
rank's matmul throughput on the recipe's shapes and its elementwise bandwidth,
measured first on one thread (the ranks run one thread each). Each
run trains through launch/train.py under torchrun for --steps steps; the last step's
pipeline trace gives each rank's busy time (its forward, backward and W instructions),
the summary the steady step time. The planner's own busy figures for both cuts are
printed beside them.

    python benchmarks/balanced_partition.py --json benchmarks/results/balanced_partition.json
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

COMPUTE = ("F", "B", "Bi", "W", "FB")


def calibrate(tokens=512, hidden=128, inter=384):
    """(TFLOP/s, GB/s) of one thread: a matmul of the recipe's MLP shape, an
    elementwise pass over a tensor larger than the caches."""
    import time
    import torch
    torch.set_num_threads(1)

    def best(fn, repeats=30):
        fn()
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return min(times)
    a, b = torch.randn(tokens, hidden), torch.randn(hidden, inter)
    x = torch.randn(8_000_000)
    y = torch.empty_like(x)
    flops = 2 * tokens * hidden * inter / best(lambda: a @ b)
    gbps = 2 * 4 * x.numel() / best(lambda: torch.mul(x, 2.0, out=y), repeats=10)
    return flops / 1e12, gbps / 1e9


def make_config(directory, *, partition, schedule, stages, figures):
    with open(os.path.join(ROOT, "ds_configs", "tiny_cpu.json")) as f:
        cfg = json.load(f)
    cfg["pipeline"].update(stages=stages, partition=partition)
    cfg["gradient_accumulation_steps"] = 8
    cfg["seekspeed"]["schedule"] = schedule
    cfg["seekspeed"]["recipe"]["overrides"] = {"vocab_size": 16384, "num_hidden_layers": 8,
                                               "first_k_dense_replace": 8}
    cfg["seekspeed"]["checkpoint"] = {"save_final": False}
    cfg["seekspeed"]["topology"] = {"compute_tflops": figures[0], "memory_gbps": figures[1]}
    path = os.path.join(directory, f"{schedule}_{partition.replace(':', '_')}.json")
    with open(path, "w") as f:
        json.dump(cfg, f)
    return path


def planned(path, ranks):
    from ds_ext.planner import cut_hardware, make_plan
    from ds_ext.config import load_config
    cfg = load_config(path, world_size=ranks)
    plan = make_plan(cfg, nodes=1, ranks_per_node=ranks, hardware=cut_hardware(cfg.section.topology, ranks))
    return plan.bounds, [st.busy for st in plan.stages]


def run(path, *, ranks, steps, directory):
    from ds_ext.distributed import free_port
    tag = os.path.splitext(os.path.basename(path))[0]
    summary, trace = os.path.join(directory, f"{tag}.summary.json"), os.path.join(directory, f"{tag}.trace")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks), "--master_port",
           str(free_port()), os.path.join(ROOT, "launch", "train.py"), "--deepspeed", path, "--steps", str(steps),
           "--summary-json", summary, "--pipe-trace", trace]
    env = dict(os.environ, PYTHONPATH=ROOT, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, cwd=directory, env=env, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"{tag} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    s = json.load(open(summary))
    events = json.load(open(os.path.join(trace, "pipeline_trace.json")))["traceEvents"]
    busy = [0.0] * ranks
    for e in events:
        if e.get("ph") == "X" and e["cat"] in COMPUTE and e["tid"] < ranks:
            busy[e["tid"]] += e["dur"] / 1e6
    step = s["layout"]["tokens_per_step"] / s["steady_tokens_per_s"]
    return {"step_seconds": step, "busy": busy, "loss_last": s["loss_last"]}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--schedules", nargs="+", default=["1f1b", "dualpipev"])
    p.add_argument("--ranks", type=int, default=2, help="pipeline ranks")
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args()
    figures = calibrate()
    print(f"this machine, one thread: {figures[0] * 1e3:.1f} GFLOP/s (matmul), {figures[1]:.1f} GB/s (elementwise)",
          flush=True)
    rows = []
    with tempfile.TemporaryDirectory() as directory:
        for schedule in args.schedules:
            ranks = args.ranks
            for partition in ("type:DecoderLayerPipe", "balanced"):
                path = make_config(directory, partition=partition, schedule=schedule, stages=ranks, figures=figures)
                bounds, plan_busy = planned(path, ranks)
                print(f"{schedule} {partition}: cut {bounds}, training {args.steps} steps on {ranks} ranks ...",
                      flush=True)
                got = run(path, ranks=ranks, steps=args.steps, directory=directory)
                rows.append({"schedule": schedule, "partition": partition, "ranks": ranks, "bounds": bounds,
                             "planned_busy": plan_busy, "measured_busy": got["busy"],
                             "measured_spread": max(got["busy"]) / min(got["busy"]) - 1,
                             "planned_spread": max(plan_busy) / min(plan_busy) - 1,
                             "step_seconds": got["step_seconds"], "loss_last": got["loss_last"]})
    print(f"\n{'schedule':<10} {'partition':<22} {'cut':<28} {'busy per rank (ms, last step)':<32} "
          f"{'spread':>7} {'planned':>8} {'step s':>8}")
    for r in rows:
        busy = "/".join(f"{b * 1e3:.0f}" for b in r["measured_busy"])
        print(f"{r['schedule']:<10} {r['partition']:<22} {str(r['bounds']):<28} {busy:<32} "
              f"{r['measured_spread']:>6.0%} {r['planned_spread']:>7.0%} {r['step_seconds']:>8.3f}")
    for schedule in args.schedules:
        before, after = [r for r in rows if r["schedule"] == schedule]
        print(f"{schedule}: balanced step {after['step_seconds']:.3f} s vs {before['step_seconds']:.3f} s = "
              f"{before['step_seconds'] / after['step_seconds']:.2f}x")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"steps": args.steps, "compute_tflops": figures[0], "memory_gbps": figures[1], "rows": rows},
                      f, indent=2)


if __name__ == "__main__":
    main()

"""The planner's predicted step time against measured tiny runs on CPU.

For each schedule, one 2-rank run (2 pipeline stages, gloo, 1 thread per rank: the
2-core machine's layout) of launch/train.py under the real deepspeed launcher; its
steady-state step time (median after the first step) is compared with
launch/plan.py's prediction for the same config. The planner's inputs are
calibrated here, not guessed: the achieved FLOP/s from a single-process forward +
backward of the whole model at one thread (the planner's own FLOP count divided by
the measured time), and the time of one activation transfer between two gloo
processes. So the error measures what the planner adds on top: the pipeline
schedule (simulator), the transfers and the per-step overheads it leaves out.

    python benchmarks/plan_accuracy.py --steps 12 --json bench_out/plan_accuracy.json
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks import launch, write_figures
from ds_ext.distributed import free_port

RUNS = {"1f1b": "tiny_cpu.json", "dualpipev": "tiny_dualpipev_cpu.json", "dualpipev-zb": "tiny_dualpipev_cpu.json"}


def _config(schedule, workdir):
    with open(os.path.join(ROOT, "ds_configs", RUNS[schedule])) as f:
        cfg = json.load(f)
    cfg["seekspeed"]["schedule"] = schedule
    path = os.path.join(workdir, f"{schedule}.json")
    with open(path, "w") as f:
        json.dump(cfg, f)
    return path


def calibrate_flops(config_path, *, repeats=5):
    """Achieved FLOP/s of a one-thread forward + backward of the whole model, counted
    with the planner's FLOP model."""
    import torch
    from ds_ext.config import load_config
    from recipes.layers.costs import full_attention_flops
    from recipes import get_recipe
    from recipes.layers.pipe import CausalLMLoss
    from recipes.layers.reference import SequentialReference
    from recipes.layers.counts import activated_parameters
    torch.set_num_threads(1)
    cfg = load_config(config_path, world_size=2)
    s, lay = cfg.section, cfg.layout
    recipe = get_recipe(s.recipe.name)
    mc = recipe.make_config(s.recipe.preset, s.recipe.overrides)
    specs = recipe.layer_specs(mc, seed=0)
    model = SequentialReference(specs, loss_fn=CausalLMLoss())
    tokens = lay.micro_batch * lay.seq_len
    layers = mc.num_hidden_layers + mc.num_mtp_layers
    flops = 3 * tokens * (2 * activated_parameters(specs) + layers * full_attention_flops(mc, seq_len=lay.seq_len))
    x = torch.randint(0, mc.vocab_size, (lay.micro_batch, lay.seq_len))
    times = []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        model.loss_fn(model(x), x).backward()
        times.append(time.perf_counter() - t0)
    return flops / statistics.median(times[1:])


def _p2p_worker(rank, port, nbytes, rounds, out):
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    t = torch.zeros(nbytes // 4)
    for i in range(rounds + 2):
        if i == 2:
            dist.barrier()
            t0 = time.perf_counter()
        if rank == 0:
            dist.send(t, 1)
            dist.recv(t, 1)
        else:
            dist.recv(t, 0)
            dist.send(t, 0)
    if rank == 0:
        out.put((time.perf_counter() - t0) / (2 * rounds))
    dist.destroy_process_group()


def measure_transfer(nbytes, rounds=50):
    """Seconds for one gloo send of ``nbytes`` between two local processes."""
    import torch.multiprocessing as mp
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_p2p_worker, args=(r, port, nbytes, rounds, out)) for r in range(2)]
    for p in procs:
        p.start()
    seconds = out.get(timeout=120)
    for p in procs:
        p.join()
    return seconds


def run_training(config_path, *, steps, workdir):
    name = os.path.basename(config_path)
    return launch(["launch/train.py", "--deepspeed", config_path, "--steps", str(steps), "--checkpoint-dir",
                   os.path.join(workdir, "ckpt-" + name)], world=2, summary_json=os.path.join(workdir, name + ".summary.json"),
                  what=name)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--schedules", nargs="+", default=list(RUNS), choices=list(RUNS))
    p.add_argument("--json")
    args = p.parse_args(argv)
    from ds_ext.planner import Hardware, make_plan
    rows = []
    with tempfile.TemporaryDirectory() as workdir:
        first = _config(args.schedules[0], workdir)
        flops = calibrate_flops(first)
        from ds_ext.config import load_config
        from recipes import get_recipe
        cfg = load_config(first, world_size=2)
        mc = get_recipe(cfg.section.recipe.name).make_config(cfg.section.recipe.preset, cfg.section.recipe.overrides)
        act = cfg.layout.micro_batch * cfg.layout.seq_len * mc.hidden_size * 4
        transfer = measure_transfer(act)
        print(f"calibration: {flops / 1e9:.2f} GFLOP/s achieved (1 thread, fwd+bwd of the whole model); one "
              f"activation transfer ({act / 1e3:.0f} kB) {transfer * 1e3:.3f} ms", flush=True)
        hw = Hardware(name="cpu", peak_tflops=flops / 1e12, efficiency=1.0, intra_gbps=1e6, inter_gbps=1e6,
                      latency_us=transfer * 1e6, hbm_gbps=5.0, memory_gb=24.0, reserve_gb=0.0)
        for schedule in args.schedules:
            path = _config(schedule, workdir)
            plan = make_plan(path, nodes=1, ranks_per_node=2, hardware=hw)
            summary = run_training(path, steps=args.steps, workdir=workdir)
            measured = plan.tokens_per_step / summary["steady_tokens_per_s"]
            rows.append({"schedule": schedule, "predicted_s": plan.step_seconds, "measured_s": measured,
                         "error": plan.step_seconds / measured - 1, "predicted_bubble_s": plan.bubble,
                         "pipeline_s": plan.makespan, "micro_batches": plan.layout["grad_accum"]})
    print(f"{'schedule':<14} {'predicted':>10} {'measured':>10} {'error':>8} {'bubble (pred.)':>15}")
    for r in rows:
        print(f"{r['schedule']:<14} {r['predicted_s'] * 1e3:8.1f}ms {r['measured_s'] * 1e3:8.1f}ms {r['error']:+8.1%} "
              f"{r['predicted_bubble_s'] * 1e3:13.1f}ms")
    write_figures(args.json, {"calibrated_gflops": flops / 1e9, "transfer_ms": transfer * 1e3, "steps": args.steps,
                              "runs": rows})


if __name__ == "__main__":
    main()

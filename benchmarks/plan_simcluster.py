"""The planner's predicted step (ds_ext/planner/) against measured runs on a
simulated cluster: 2 nodes x 2 ranks (launch/simcluster.py), pipeline 2 stages x
data-parallel 2, ranks laid out as benchmarks/grad_overlap.py lays them (ProcessTopology
axes data, pipe: each node one whole pipeline, every data-parallel group across the
shaped link; the planner's placement "data-pipe"), the tiny recipe widened (hidden 256,
4 layers), fp32, ZeRO 1, per schedule with ``seekspeed.overlap_grad_reduce`` off and on.

The measured side is grad_overlap.py's: its engine builder, both engines (overlap off
and on) in one launch stepping in turns, step time from a barrier to a barrier (median,
slowest rank), and per rank the parts of the step from the engine's instruction
timeline: the exposed reduction (ReduceGrads), the optimizer step (OptimizerStep: Adam,
and under ZeRO 1 the all-gather of the updated partitions over the data-parallel
group), the pipeline (the rest of the instruction stream) and what train_batch does
outside it (the loss aggregation).

The predicted side: make_plan on a config with the same numbers, its inputs calibrated
on this machine: compute at the achieved FLOP/s of a one-thread forward + backward of
the model (plan_accuracy.calibrate_flops: the planner's FLOP count / measured time,
efficiency 1, so memory-bound terms are taken as inside it: hbm large; "shared": the
same measured in 4 processes at once, as the 4 ranks share this machine's cores, a
second plan), the links at
the payload rates and latencies measured in the same namespaces (collective_model.py's
probes: one NIC per node at the link's rate, loopback as the intra-node link,
efficiencies 1). The planner's optimizer step is memory-bound (0 here) plus ZeRO 1's
all-gather of the updated weights over the data-parallel groups ("ag": that part); the
measured OptimizerStep (Adam on a shared CPU as well) is also given as a stated figure:
"w/ opt." puts it in place of the planner's.

    python benchmarks/plan_simcluster.py --json benchmarks/results/plan_simcluster.json   # root (namespaces)
    flock /tmp/seekspeed-bench.lock python benchmarks/plan_simcluster.py --rate 300mbit --steps 8

Every launch runs in fresh processes.
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

from benchmarks import grad_overlap, machine_line, run_for_rows, simcluster_cmd, write_figures

SCHEDULES = ("1f1b", "dualpipev-zb")
SETTINGS = ("steps", "warmup", "layers", "hidden", "seq", "micro_batch", "gas", "zero")


def write_config(path, *, schedule, overlap, args):
    """The JSON config make_plan reads: grad_overlap._engine's numbers."""
    cfg = {"train_micro_batch_size_per_gpu": args.micro_batch, "gradient_accumulation_steps": args.gas,
           "steps_per_print": 10 ** 9, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
           "zero_optimization": {"stage": args.zero}, "bf16": {"enabled": False},
           "pipeline": {"stages": 2, "activation_checkpoint_interval": 0},
           "seekspeed": {"recipe": {"name": "deepseek_v3", "preset": "tiny",
                                    "overrides": {"num_hidden_layers": args.layers, "hidden_size": args.hidden,
                                                  "intermediate_size": 3 * args.hidden}},
                         "schedule": schedule, "overlap_grad_reduce": overlap,
                         "data": {"source": "stdlib", "tokenizer": "byte", "seq_len": args.seq},
                         "train": {"steps": 10, "seed": 3, "log_interval": 10},
                         "checkpoint": {"dir": os.path.join(os.path.dirname(path), "ckpt"), "interval_steps": 100},
                         "topology": {"placement": "data-pipe"}}}
    with open(path, "w") as f:
        json.dump(cfg, f)
    return path


# ---- measured: one launch per schedule, on the simulated cluster -----------------------

def _parts(engine):
    """(exposed reduction, optimizer step, instruction stream span) of the step just run."""
    events = engine.timeline.events
    exposed = sum(e - s for n, _, s, e in events if n == "ReduceGrads")
    opt = sum(e - s for n, _, s, e in events if n == "OptimizerStep")
    span = max(e for *_, e in events) - min(s for _, _, s, _ in events)
    return exposed, opt, span


def _ranks(args):
    import warnings
    warnings.filterwarnings("ignore")
    import torch
    import torch.distributed as tdist

    from ds_ext.distributed import init_distributed
    from ds_ext.pipe.engine import InstructionTimeline
    init_distributed("gloo")
    torch.set_num_threads(1)
    schedule = args.schedules[0]
    engines = {overlap: grad_overlap._engine(schedule, overlap, args) for overlap in (False, True)}
    keys = ("step", "exposed", "optimizer", "pipeline", "outside")
    figures = {overlap: {k: [] for k in keys} for overlap in engines}
    for i in range(args.warmup + args.steps):
        for overlap in ((False, True) if i % 2 == 0 else (True, False)):
            engine, it, _ = engines[overlap]
            engine.timeline = InstructionTimeline()
            tdist.barrier()
            t0 = time.perf_counter()
            engine.train_batch(it)
            tdist.barrier()
            step = time.perf_counter() - t0
            if i >= args.warmup:
                exposed, opt, span = _parts(engine)
                f = figures[overlap]
                for k, v in zip(keys, (step, exposed, opt, span - exposed - opt, step - span)):
                    f[k].append(v)
    rows = []
    for overlap in (False, True):
        f = figures[overlap]
        mine = torch.tensor([statistics.median(f[k]) for k in keys])
        everyone = [torch.zeros_like(mine) for _ in range(tdist.get_world_size())]
        tdist.all_gather(everyone, mine)
        stack = torch.stack(everyone)
        rows.append({"schedule": schedule, "overlap": overlap,
                     **{f"{k}_s": float(stack[:, j].max()) for j, k in enumerate(keys)},
                     "per_rank": {f"{k}_s": stack[:, j].tolist() for j, k in enumerate(keys)},
                     "steps_s": f["step"]})
    if tdist.get_rank() == 0:
        with open(args.rows_json, "w") as out:
            json.dump(rows, out)
    tdist.barrier()
    tdist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)     # as grad_overlap.py: gloo's threads sometimes abort the teardown


def _launch(schedule, args, rows_json):
    script = [os.path.abspath(__file__), "--schedules", schedule, "--rows-json", rows_json,
              *[f"--{k.replace('_', '-')}={getattr(args, k)}" for k in SETTINGS]]
    return run_for_rows(simcluster_cmd(script, nodes=2, ranks_per_node=2, rate=args.rate), rows_json, name=schedule)


# ---- predicted ------------------------------------------------------------------------

def _calibrate_one(path, start, out):
    import torch  # noqa: F401  (imported before the others start timing)

    from benchmarks.plan_accuracy import calibrate_flops
    calibrate_flops(path, repeats=1)
    start.wait()
    out.put(calibrate_flops(path, repeats=10))


def calibrate_shared(path, *, processes):
    """calibrate_flops in ``processes`` processes at once (one thread each), as the
    simulated cluster's ranks share this machine's cores: the median FLOP/s."""
    import multiprocessing as mp
    ctx = mp.get_context("spawn")
    start, out = ctx.Barrier(processes), ctx.Queue()
    procs = [ctx.Process(target=_calibrate_one, args=(path, start, out)) for _ in range(processes)]
    for p in procs:
        p.start()
    got = [out.get(timeout=300) for _ in procs]
    for p in procs:
        p.join()
    return statistics.median(got)


def measure_links(rate):
    """collective_model.py's probes in a fresh 2 x 2 simulated cluster at ``rate``."""
    from benchmarks.collective_model import run_simcluster
    m = run_simcluster(rate, sizes=[1], repeats=1, probe_mb=16, port=29691)
    return {k: m[k] for k in ("link_bps", "loop_bps", "link_latency_s", "loop_latency_s")}


def hardware(flops, links):
    from ds_ext.planner import Hardware
    return Hardware(name="simcluster", peak_tflops=flops / 1e12, efficiency=1.0, hbm_gbps=1e6, memory_gb=24.0,
                    reserve_gb=0.0, gpus_per_node=2, nics_per_node=1, inter_gbps=links["link_bps"] / 1e9,
                    nic_efficiency=1.0, intra_gbps=links["loop_bps"] / 1e9, nvlink_efficiency=1.0,
                    nvlink_a2a_efficiency=1.0, nic_latency_us=links["link_latency_s"] * 1e6,
                    nvlink_latency_us=links["loop_latency_s"] * 1e6, latency_us=links["link_latency_s"] * 1e6)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    grad_overlap.add_run_args(p, schedules=list(SCHEDULES), rate="300mbit", steps=8, gas=4)
    args = p.parse_args()
    if args.rows_json:
        return _ranks(args)
    if os.geteuid() != 0:
        sys.exit("the simulated cluster needs root (ip netns, tc)")
    from benchmarks.plan_accuracy import calibrate_flops
    from ds_ext.planner import make_plan
    rows = []
    with tempfile.TemporaryDirectory(prefix="seekspeed-plansim-") as tmp:
        base = write_config(os.path.join(tmp, "base.json"), schedule="1f1b", overlap=False, args=args)
        flops = calibrate_flops(base)
        shared = calibrate_shared(base, processes=4)
        print(f"calibrating the link at {args.rate} ...", file=sys.stderr, flush=True)
        links = measure_links(args.rate)
        hw, hw_shared = hardware(flops, links), hardware(shared, links)
        print(f"calibration: {flops / 1e9:.2f} GFLOP/s (1 thread, fwd+bwd; alone), {shared / 1e9:.2f} GFLOP/s "
              f"(4 such processes at once on the {os.cpu_count()} cores); link {links['link_bps'] / 1e6:.1f} MB/s "
              f"payload, {links['link_latency_s'] * 1e6:.0f} us; loopback {links['loop_bps'] / 1e9:.2f} GB/s, "
              f"{links['loop_latency_s'] * 1e6:.0f} us", flush=True)
        for i, schedule in enumerate(args.schedules):
            print(f"[{i + 1}/{len(args.schedules)}] {schedule}: 2 nodes x 2 ranks, {args.rate} ...", file=sys.stderr,
                  flush=True)
            measured = _launch(schedule, args, os.path.join(tmp, f"{i}.json"))
            for m in measured:
                path = write_config(os.path.join(tmp, f"{schedule}-{m['overlap']}.json"), schedule=schedule,
                                    overlap=m["overlap"], args=args)
                plan = make_plan(path, nodes=2, ranks_per_node=2, hardware=hw)
                shared_plan = make_plan(path, nodes=2, ranks_per_node=2, hardware=hw_shared)
                assert plan.placement == "data-pipe", plan.placement
                with_opt = plan.step_seconds - plan.optimizer_seconds + m["optimizer_s"]
                # the planner's ZeRO 1 all-gather of the updated fp32 weights (its optimizer step less the
                # memory-bound part, which is 0 at this hbm)
                gather = plan.optimizer_seconds
                rows.append({"schedule": schedule, "overlap": m["overlap"], "measured_step_s": m["step_s"],
                             "predicted_step_s": plan.step_seconds, "ratio": plan.step_seconds / m["step_s"],
                             "measured_exposed_s": m["exposed_s"], "predicted_exposed_s": plan.dp_seconds,
                             "predicted_step_with_optimizer_s": with_opt, "ratio_with_optimizer": with_opt / m["step_s"],
                             "measured_pipeline_s": m["pipeline_s"], "predicted_pipeline_s": plan.makespan,
                             "measured_optimizer_s": m["optimizer_s"], "predicted_optimizer_s": plan.optimizer_seconds,
                             "measured_outside_s": m["outside_s"], "predicted_reduce_total_s": plan.dp_total_seconds,
                             "predicted_zero1_allgather_s": gather,
                             "predicted_step_shared_s": shared_plan.step_seconds,
                             "predicted_pipeline_shared_s": shared_plan.makespan,
                             "placement": plan.placement, "chunk_costs": plan.chunk_costs,
                             "per_rank": m["per_rank"], "steps_s": m["steps_s"]})
    print(machine_line())
    print(f"\ntiny recipe, hidden {args.hidden}, {args.layers} layers, fp32, ZeRO {args.zero}, micro-batch "
          f"{args.micro_batch} x {args.seq} tokens, {args.gas} micro-batches; 2 stages x 2 data-parallel "
          f"(placement data-pipe), 2 simulated nodes at {args.rate}; measured: median of {args.steps} steps, slowest "
          f"rank (each part its own slowest rank)")
    print(f"{'schedule':<13} {'overlap':>7} {'meas. s':>7} {'pred. s':>7} {'ratio':>6} {'w/ opt.':>7} {'ratio':>6} "
          f"{'shared':>6} | {'pipe m/p/shared':>17} {'exposed m/p':>11} {'opt. m/p':>11} {'ag':>5} {'outside m':>9}")
    for r in rows:
        print(f"{r['schedule']:<13} {'on' if r['overlap'] else 'off':>7} {r['measured_step_s']:7.3f} "
              f"{r['predicted_step_s']:7.3f} {r['ratio']:6.2f} {r['predicted_step_with_optimizer_s']:7.3f} "
              f"{r['ratio_with_optimizer']:6.2f} {r['predicted_step_shared_s']:6.3f} | "
              f"{r['measured_pipeline_s']:5.3f}/{r['predicted_pipeline_s']:.3f}/{r['predicted_pipeline_shared_s']:.3f} "
              f"{r['measured_exposed_s']:5.3f}/{r['predicted_exposed_s']:.3f} "
              f"{r['measured_optimizer_s']:5.3f}/{r['predicted_optimizer_s']:.3f} {r['predicted_zero1_allgather_s']:5.3f} "
              f"{r['measured_outside_s']:9.3f}")
    write_figures(args.json, {"where": f"simulated cluster, 2 nodes x 2 ranks, {args.rate} between nodes",
                              "settings": {k: getattr(args, k) for k in SETTINGS}, "calibrated_gflops": flops / 1e9,
                              "calibrated_gflops_shared": shared / 1e9,
                              "links": links, "rows": rows})


if __name__ == "__main__":
    main()

"""The data-parallel gradient reduction overlapped with the pipeline drain
(``seekspeed.overlap_grad_reduce``) against DeepSpeed's reduction at ReduceGrads, on a
simulated cluster: 2 nodes x 2 ranks, pipeline 2 stages x data-parallel 2, ranks laid
out data-major (ProcessTopology axes data, pipe) so each node holds one whole pipeline
and every data-parallel group crosses the shaped inter-node link; the tiny recipe
widened (--hidden, --layers) so the reduction is a good part of the step.

Both engines (overlap off and on) are built in the same launch and step in turns (the
order alternating step by step), so they share the machine's noise. Per schedule and
mode: step time (median over --steps, from a barrier to a barrier), the reduction left
exposed (the ReduceGrads instruction: DeepSpeed's whole reduction without overlap,
the wait for what is still in flight with it; slowest rank), the reduction's span
(without overlap the same; with it from the first chunk issued to the last one done),
and the engine's per-instruction overhead on this machine (median gap between one
instruction's end and the next one's start in the engine's timeline).

    python benchmarks/grad_overlap.py --json benchmarks/results/grad_overlap.json     # root (namespaces)
    python benchmarks/grad_overlap.py --rate 100mbit --schedules 1f1b dualpipev-zb dualpipe

Every launch runs in fresh processes (launch/simcluster.py).
"""

import argparse
import itertools
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks import add_output_args, machine_line, run_for_rows, simcluster_cmd, write_figures

SCHEDULES = ("1f1b", "dualpipev-zb", "dualpipe", "dualpipev")


def _engine(schedule, overlap, args):
    import torch
    from deepspeed.runtime.pipe.topology import ProcessTopology

    from ds_ext.pipe.engine import InstructionTimeline, initialize
    from recipes import deepseek_v3
    config = deepseek_v3.make_config("tiny", {"num_hidden_layers": args.layers, "hidden_size": args.hidden,
                                              "intermediate_size": 3 * args.hidden})
    topology = ProcessTopology(axes=["data", "pipe"], dims=[2, 2])
    model = deepseek_v3.build_pipeline(config, topology=topology, schedule=schedule, seed=3)
    ds = {"train_micro_batch_size_per_gpu": args.micro_batch, "gradient_accumulation_steps": args.gas,
          "steps_per_print": 10 ** 9, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
          "zero_optimization": {"stage": args.zero}}
    engine = initialize(model=model, config=ds, model_parameters=list(model.parameters()), schedule=schedule,
                        overlap_grad_reduce=overlap, log=lambda _: None)
    engine.timeline = InstructionTimeline()
    g = torch.Generator().manual_seed(model._grid.get_data_parallel_id())
    data = torch.randint(0, config.vocab_size, (16, args.micro_batch, args.seq + 1), generator=g)
    state = {"i": 0}

    def next_batch():
        rows = data[state["i"] % len(data)]
        state["i"] += 1
        return rows[:, :-1], rows[:, 1:]
    params = sum(p.numel() for p in model.parameters())
    return engine, iter(next_batch, None), params


def _step_figures(engine, overlap):
    """(exposed, total) reduction seconds and the instruction gaps of the step just run."""
    events = engine.timeline.events
    exposed = sum(e - s for n, _, s, e in events if n == "ReduceGrads")
    total = engine.grad_overlap.last_total_s if overlap else exposed
    lead = engine.grad_overlap.last_lead_s if overlap else 0.0
    timed = sorted((s, e) for n, _, s, e in events if n not in ("GradReduce", "WaitGradReduce", "WaitRecv",
                                                               "AllToAll", "WaitAllToAll"))
    gaps = [b[0] - a[1] for a, b in itertools.pairwise(timed) if b[0] >= a[1]]
    return exposed, total, lead, gaps


def _ranks(args):
    import warnings
    warnings.filterwarnings("ignore")
    import torch
    import torch.distributed as tdist

    from ds_ext.distributed import init_distributed
    from ds_ext.pipe.engine import InstructionTimeline
    init_distributed("gloo")
    torch.set_num_threads(1)
    rank = tdist.get_rank()
    schedule = args.schedules[0]
    engines = {overlap: _engine(schedule, overlap, args) for overlap in (False, True)}
    figures = {overlap: {"step": [], "exposed": [], "total": [], "lead": [], "gaps": []} for overlap in engines}
    for i in range(args.warmup + args.steps):
        order = (False, True) if i % 2 == 0 else (True, False)
        for overlap in order:
            engine, it, _ = engines[overlap]
            engine.timeline = InstructionTimeline()
            tdist.barrier()
            t0 = time.perf_counter()
            engine.train_batch(it)
            tdist.barrier()
            if i >= args.warmup:
                exposed, total, lead, gaps = _step_figures(engine, overlap)
                f = figures[overlap]
                f["step"].append(time.perf_counter() - t0)
                f["exposed"].append(exposed)
                f["total"].append(total)
                f["lead"].append(lead)
                f["gaps"] += gaps
    rows = []
    for overlap in (False, True):
        f = figures[overlap]
        mine = torch.tensor([statistics.median(f["step"]), statistics.median(f["exposed"]),
                             statistics.median(f["total"]), statistics.median(f["gaps"]) if f["gaps"] else 0.0,
                             statistics.median(f["lead"])])
        everyone = [torch.zeros_like(mine) for _ in range(tdist.get_world_size())]
        tdist.all_gather(everyone, mine)
        stack = torch.stack(everyone)
        rows.append({"schedule": schedule, "overlap": overlap, "step_seconds": float(stack[:, 0].max()),
                     "reduce_seconds_exposed": float(stack[:, 1].max()),
                     "reduce_seconds_total": float(stack[:, 2].max()),
                     "instruction_gap_us": float(stack[:, 3].median()) * 1e6,
                     # per rank (global rank order): exposed, span, and how early the first chunk went out
                     "per_rank": {"reduce_seconds_exposed": stack[:, 1].tolist(),
                                  "reduce_seconds_total": stack[:, 2].tolist(), "lead_seconds": stack[:, 4].tolist()},
                     "steps_s": f["step"], "params_per_rank": engines[overlap][2]})
    if rank == 0:
        with open(args.rows_json, "w") as out:
            json.dump(rows, out)
    tdist.barrier()
    tdist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)     # gloo's threads sometimes abort the interpreter's teardown after the work is written


def _launch(schedule, args, rows_json):
    script = [os.path.abspath(__file__), "--schedules", schedule, "--rows-json", rows_json,
              *[f"--{k.replace('_', '-')}={getattr(args, k)}" for k in
                ("steps", "warmup", "layers", "hidden", "seq", "micro_batch", "gas", "zero")]]
    return run_for_rows(simcluster_cmd(script, nodes=2, ranks_per_node=2, rate=args.rate), rows_json, name=schedule)


def add_run_args(p, *, schedules, rate, steps, gas):
    """The run's flags (also benchmarks/plan_simcluster.py's, which runs these ranks)."""
    p.add_argument("--schedules", nargs="+", default=schedules, choices=SCHEDULES)
    p.add_argument("--rate", default=rate, help="inter-node link of the simulated cluster")
    p.add_argument("--steps", type=int, default=steps)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--gas", type=int, default=gas)
    p.add_argument("--zero", type=int, default=1, choices=(0, 1))
    add_output_args(p)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_args(p, schedules=["1f1b", "dualpipev-zb", "dualpipe"], rate="200mbit", steps=6, gas=8)
    args = p.parse_args()
    if args.rows_json:
        return _ranks(args)
    import tempfile
    rows = []
    with tempfile.TemporaryDirectory(prefix="seekspeed-overlap-") as tmp:
        for i, schedule in enumerate(args.schedules):
            print(f"[{i + 1}/{len(args.schedules)}] {schedule}: 2 nodes x 2 ranks, {args.rate} between nodes ...",
                  file=sys.stderr, flush=True)
            rows += _launch(schedule, args, os.path.join(tmp, f"{i}.json"))
    for r in rows:
        r["link"] = args.rate
    print(machine_line())
    params = max(r["params_per_rank"] for r in rows)
    print(f"\ntiny recipe, hidden {args.hidden}, {args.layers} layers (up to {params / 1e6:.2f}M parameters per rank), "
          f"fp32, ZeRO {args.zero}, micro-batch {args.micro_batch} x {args.seq} tokens, {args.gas} micro-batches; "
          f"2 stages x 2 data-parallel, data-parallel groups across 2 simulated nodes, {args.rate}; median of "
          f"{args.steps} steps (slowest rank)")
    print(f"{'schedule':<14} {'overlap':>7} {'step s':>7} {'exposed s':>9} {'reduce s':>8} {'exposed/step':>12} "
          f"{'speed-up':>8} {'instr gap us':>12}")
    for r in rows:
        base = next(b for b in rows if b["schedule"] == r["schedule"] and not b["overlap"])
        r["speedup"] = base["step_seconds"] / r["step_seconds"]
        print(f"{r['schedule']:<14} {'on' if r['overlap'] else 'off':>7} {r['step_seconds']:7.3f} "
              f"{r['reduce_seconds_exposed']:9.3f} {r['reduce_seconds_total']:8.3f} "
              f"{r['reduce_seconds_exposed'] / r['step_seconds']:11.0%} {r['speedup']:7.2f}x "
              f"{r['instruction_gap_us']:12.0f}")
        if r["overlap"]:
            pr = r["per_rank"]
            print(f"{'':<14} per rank: exposed {' '.join(f'{v:.3f}' for v in pr['reduce_seconds_exposed'])}; "
                  f"first chunk out {' '.join(f'{v:.3f}' for v in pr['lead_seconds'])} s before ReduceGrads")
    write_figures(args.json, {"where": f"simulated cluster, 2 nodes x 2 ranks, {args.rate} between nodes",
                              "settings": {k: getattr(args, k) for k in ("layers", "hidden", "seq", "micro_batch",
                                                                           "gas", "zero", "steps", "warmup")},
                              "rows": rows})


if __name__ == "__main__":
    main()

"""Step time of every pipeline schedule on 4 pipeline ranks, side by side, with a
layer of controlled cost (benchmarks/costed_layers.py: sleeps, so the 2 cores do not
distort it) and with the real tiny recipe; torch.distributed.pipelining's
ScheduleDualPipeV and ScheduleZBVZeroBubble run the same costed stages as peers.

Per configuration: the median step time (barrier to barrier, warm-up steps skipped),
the formula's ideal (uniform costs), the simulator's prediction for the costed
layers' real per-stage costs, and the same prediction with the fixed cost this
machine added to each kind of instruction in a recorded step (its duration beyond its
layers' sleeps and its waits for a peer). Runs during which
other processes used more than --busy-cores cores are repeated (up to --retries).

    python benchmarks/pipeline_schedules.py --micro-batches 8 16 --json bench_out/pipeline.json
"""

import argparse
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

DS_SCHEDULES = ["1f1b", "dualpipev", "dualpipev-zb", "dualpipe"]
TORCH_SCHEDULES = ["torch-dualpipev", "torch-zbv"]
COMPUTE = {"ForwardPass", "BackwardPass", "WeightPass", "ForwardBackwardPass"}


def _timed_steps(run_step, steps, warmup):
    from deepspeed import comm as dist
    times = []
    for i in range(warmup + steps):
        dist.barrier()
        t0 = time.perf_counter()
        run_step()
        dist.barrier()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return times


def _latency_rank(rounds):
    """Median one-way latency (ms) of a small gloo send between neighbouring ranks."""
    import torch
    from deepspeed import comm as dist
    rank = dist.get_rank()
    x = torch.zeros(16)
    times = []
    for _ in range(rounds):
        dist.barrier()
        t0 = time.perf_counter()
        if rank % 2 == 0:
            dist.send(x, rank + 1)
            dist.recv(x, rank + 1)
        else:
            dist.recv(x, rank - 1)
            dist.send(x, rank - 1)
        times.append((time.perf_counter() - t0) / 2 * 1e3)
    return statistics.median(times)


def _ds_rank(schedule, m, costs, steps, warmup, layers, hidden):
    import torch
    from deepspeed import comm as dist
    from deepspeed.pipe import LayerSpec
    from benchmarks.costed_layers import CostedLayer, mean_loss
    from ds_ext.pipe import pipeline_module_class
    from ds_ext.pipe.engine import InstructionTimeline, initialize
    F, B, W = costs
    ranks = dist.get_world_size()
    model = pipeline_module_class(schedule)(layers=[LayerSpec(CostedLayer, F, B, W) for _ in range(layers)],
                                            num_stages=ranks, loss_fn=mean_loss, partition_method="uniform")
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": m, "steps_per_print": 10**9,
              "optimizer": {"type": "SGD", "params": {"lr": 0.0}}}
    engine = initialize(model=model, config=config, model_parameters=list(model.parameters()), schedule=schedule)
    x = torch.zeros(1, hidden)
    batches = iter(lambda: (x, x), None)
    times = _timed_steps(lambda: engine.train_batch(batches), steps, warmup)
    engine.timeline = InstructionTimeline()
    dist.barrier()
    origin = time.perf_counter()
    engine.train_batch(batches)
    events = [(n, k, s - origin, e - origin) for n, k, s, e in engine.timeline.events]
    return {"times": times, "events": events, "stage": engine.stage_id}


def _torch_rank(kind, m, costs, steps, warmup, layers, hidden):
    import torch
    from deepspeed import comm as dist
    from torch.distributed.pipelining import PipelineStage, ScheduleDualPipeV, ScheduleZBVZeroBubble
    from benchmarks.costed_layers import CostedLayer
    F, B, W = costs
    ranks, rank = dist.get_world_size(), dist.get_rank()
    per_stage = layers // (2 * ranks)
    stages = [PipelineStage(torch.nn.Sequential(*[CostedLayer(F, B, W) for _ in range(per_stage)]), index, 2 * ranks,
                            torch.device("cpu")) for index in (rank, 2 * ranks - 1 - rank)]
    cls = ScheduleDualPipeV if kind == "torch-dualpipev" else ScheduleZBVZeroBubble
    schedule = cls(stages, n_microbatches=m, loss_fn=lambda out, target: out.float().mean())
    x = torch.zeros(m, hidden)

    def step():
        if rank == 0:
            schedule.step(x, target=x)
        else:
            schedule.step()
    return {"times": _timed_steps(step, steps, warmup), "events": [], "stage": rank}


def _recipe_rank(schedule, m, steps, warmup, layers):
    import torch
    from deepspeed import comm as dist
    from ds_ext.pipe.engine import initialize
    from recipes import deepseek_v3
    torch.set_num_threads(1)
    ranks = dist.get_world_size()
    config = deepseek_v3.make_config("tiny", {"num_hidden_layers": layers})
    model = deepseek_v3.build_pipeline(config, num_stages=ranks, schedule=schedule, seed=1)
    ds = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": m, "steps_per_print": 10**9,
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}}
    engine = initialize(model=model, config=ds, model_parameters=list(model.parameters()), schedule=schedule)
    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, config.vocab_size, (64, 2, 65), generator=g)
    state = {"i": 0}

    def next_batch():
        rows = data[state["i"] % 64]
        state["i"] += 1
        return rows[:, :-1], rows[:, 1:]
    batches = iter(next_batch, None)
    return {"times": _timed_steps(lambda: engine.train_batch(batches), steps, warmup), "events": [],
            "stage": engine.stage_id}


def _other_cpu():
    """(busy CPU seconds of the whole machine, of this benchmark's process tree)."""
    import psutil
    with open("/proc/stat") as f:
        fields = [int(v) for v in f.readline().split()[1:]]
    busy = (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")
    me = psutil.Process()
    mine = 0.0
    for p in [me] + me.children(recursive=True):
        try:
            t = p.cpu_times()
            mine += t.user + t.system + getattr(t, "children_user", 0) + getattr(t, "children_system", 0)
        except psutil.Error:
            pass
    return busy, mine


def _run(fn, args, *, retries, busy_cores):
    from tests.distributed import run_ranks
    for attempt in range(retries + 1):
        b0, m0 = _other_cpu()
        t0 = time.perf_counter()
        results = run_ranks(fn, world_size=4, args=args, timeout=600)
        wall = time.perf_counter() - t0
        b1, m1 = _other_cpu()
        other = max(0.0, (b1 - b0) - (m1 - m0)) / wall
        if other <= busy_cores or attempt == retries:
            return results, other, attempt


def _vstage(schedule, rank, phase, ranks):
    """The virtual stage (as the simulator numbers them) of a chunk of ``phase`` on ``rank``."""
    from ds_ext.pipe import rank_chunks
    return rank_chunks(schedule, rank=rank, stages=ranks)[phase]


def stage_costs(schedule, ranks, costs, per_chunk):
    """Per-virtual-stage chunk costs (lists F, B, W, Bi) of the costed layers. The
    model's first layer takes the un-differentiated input, so autograd never runs its
    activation path: its backward costs W alone, and the first stage's B is B - W less
    (its input-gradient-only backward, Bi, is B - W less too)."""
    from ds_ext.pipe import virtual_stages
    F, B, W = costs
    stages = virtual_stages(schedule, ranks)
    f = [per_chunk * F] * stages
    b = [per_chunk * B - ((B - W) if v == 0 else 0.0) for v in range(stages)]
    w = [per_chunk * W] * stages
    return f, b, w, [bv - wv for bv, wv in zip(b, w)]


def _overheads(results, schedule, ranks, costs, per_chunk, *, async_p2p):
    """This machine's fixed cost per instruction, from each rank's recorded step:
    per kind of compute instruction (F, B, Bi: a deferring backward, W, FB), what the
    instruction took beyond its layers' sleeps and its waits for a peer (dispatch,
    DeepSpeed's bookkeeping, sleep overshoot), the median over all ranks' instructions
    of that kind; and ``comm``, the time a rank spends posting transfers (CommitP2P and
    the send/receive instructions) per compute op, the median over ranks. Only the
    asynchronous engines have the latter: DeepSpeed's own engines block in their
    communication instructions, which therefore count as waiting."""
    f, b, w, bi = stage_costs(schedule, ranks, costs, per_chunk)
    excess = {"F": [], "B": [], "Bi": [], "W": [], "FB": []}
    comm_share = []
    for r in results:
        events, rank = r["events"], r["stage"]
        waits = [(s, e) for n, _, s, e in events if n == "WaitRecv"]
        ops, comm = 0, 0.0
        for name, kwargs, s, e in events:
            if name in ("CommitP2P", "SendActivation", "RecvActivation", "SendGrad", "RecvGrad"):
                comm += (e - s) * 1e3
            if name not in COMPUTE:
                continue
            waited = sum(min(e, we) - max(s, ws) for ws, we in waits if ws < e and we > s)
            took = (e - s - waited) * 1e3
            if name == "ForwardPass":
                kind, nominal = "F", f[_vstage(schedule, rank, kwargs.get("phase", 0), ranks)]
            elif name == "BackwardPass":
                v = _vstage(schedule, rank, kwargs.get("phase", 0), ranks)
                kind, nominal = ("Bi", bi[v]) if kwargs.get("zb") else ("B", b[v])
            elif name == "WeightPass":
                kind, nominal = "W", w[0]
            else:
                kind = "FB"
                nominal = (f[_vstage(schedule, rank, kwargs["fwd_phase"], ranks)]
                           + b[_vstage(schedule, rank, kwargs["bwd_phase"], ranks)])
            excess[kind].append(took - nominal)
            ops += 2 if kind == "FB" else 1
        if ops:
            comm_share.append(comm / ops if async_p2p else 0.0)
    out = {k: statistics.median(v) for k, v in excess.items() if v}
    out["comm"] = statistics.median(comm_share) if comm_share else 0.0
    counts = {k: len(v) for k, v in excess.items()}
    out["mean"] = (sum(out.get(k, 0.0) * n for k, n in counts.items()) / max(sum(counts.values()), 1)
                   + out["comm"])
    return out


def simulate_measured(schedule, ranks, m, costs, per_chunk, overhead, latency):
    """The simulator on the costed layers' per-stage costs plus the measured fixed cost
    of each kind of instruction and the gloo latency per transfer."""
    from ds_ext.pipe.simulate import simulate
    f, b, w, bi = stage_costs(schedule, ranks, costs, per_chunk)
    c = overhead.get("comm", 0.0)

    def plus(xs, kind):
        return [x + overhead.get(kind, 0.0) + c for x in xs]
    return simulate(schedule, ranks=ranks, micro_batches=m, F=plus(f, "F"), B=plus(b, "B"), W=plus(w, "W"),
                    Bi=plus(bi, "Bi"), comm=latency)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--micro-batches", type=int, nargs="+", default=[8, 16])
    p.add_argument("--F", type=float, default=10.0, help="ms per layer forward (8 layers: per rank 2x this)")
    p.add_argument("--B", type=float, default=20.0, help="ms per layer backward, W included")
    p.add_argument("--W", type=float, default=10.0, help="ms per layer weight-gradient backward")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--recipe", action="store_true", help="also time the tiny recipe (8 layers) per schedule")
    p.add_argument("--busy-cores", type=float, default=0.3, help="repeat a run if others used more cores")
    p.add_argument("--retries", type=int, default=2)
    p.add_argument("--trace-dir", help="write each schedule's recorded step as PNG + Chrome trace here")
    p.add_argument("--json")
    args = p.parse_args()
    from ds_ext.pipe import schedule_spec, virtual_stages
    from ds_ext.pipe.simulate import formula_bubble, simulate
    layers, ranks = 8, 4
    costs = (args.F, args.B, args.W)
    from tests.distributed import run_ranks
    latency = statistics.median(run_ranks(_latency_rank, world_size=4, args=(50,), timeout=120))
    rows = []
    for m in args.micro_batches:
        for name in DS_SCHEDULES + TORCH_SCHEDULES:
            print(f"m={m} {name} ...", file=sys.stderr, flush=True)
            if name in DS_SCHEDULES:
                results, other, retried = _run(_ds_rank, (name, m, costs, args.steps, args.warmup, layers, 16),
                                               retries=args.retries, busy_cores=args.busy_cores)
            else:
                results, other, retried = _run(_torch_rank, (name, m, costs, args.steps, args.warmup, layers, 16),
                                               retries=args.retries, busy_cores=args.busy_cores)
            step = statistics.median(results[0]["times"]) * 1e3
            sim_name = {"torch-dualpipev": "dualpipev-zb", "torch-zbv": None}.get(name, name)
            # layers per stage chunk; the torch schedules are V-shaped (2 x ranks chunks)
            per_chunk = layers // (virtual_stages(name, ranks) if name in DS_SCHEDULES else 2 * ranks)
            c = [x * per_chunk for x in costs]
            row = {"schedule": name, "micro_batches": m, "step_ms": step,
                   "steps_ms": [t * 1e3 for t in results[0]["times"]], "other_cpu_cores": other,
                   "retried": retried}
            if sim_name:
                f, b, w, _ = stage_costs(sim_name, ranks, costs, per_chunk)
                sim = simulate(sim_name, ranks=ranks, micro_batches=m, F=f, B=b, W=w)
                row["simulated_ms"] = sim.makespan
                row["ideal_busy_ms"] = max(sim.busy)
                try:
                    uniform = simulate(sim_name, ranks=ranks, micro_batches=m, F=c[0], B=c[1], W=c[2])
                    row["formula_ms"] = max(uniform.busy) + formula_bubble(sim_name, ranks=ranks, F=c[0], B=c[1],
                                                                           W=c[2])
                except ValueError:
                    row["formula_ms"] = None
                if name in DS_SCHEDULES:
                    over = _overheads(results, name, ranks, costs, per_chunk,
                                      async_p2p=schedule_spec(name).async_p2p)
                    row["overhead_ms"] = over
                    row["overhead_ms_per_instruction"] = over["mean"]
                    sim2 = simulate_measured(name, ranks, m, costs, per_chunk, over, latency)
                    row["simulated_with_overhead_ms"] = sim2.makespan
                    # bubbles against the busy time that includes the per-instruction overhead
                    row["bubble_ms"] = step - max(sim2.busy)
                    row["simulated_bubble_ms"] = sim2.makespan - max(sim2.busy)
                    if args.trace_dir:
                        from ds_ext.pipe.trace import from_engine_events, plot_timeline, write_chrome_trace
                        os.makedirs(args.trace_dir, exist_ok=True)
                        lanes = [from_engine_events(r["events"], origin=0.0)
                                 for r in sorted(results, key=lambda r: r["stage"])]
                        base = os.path.join(args.trace_dir, f"{name}-m{m}")
                        write_chrome_trace(lanes, base + ".json", name=f"{name} m={m}")
                        plot_timeline(lanes, base + ".png", title=f"{name}, 4 ranks, m={m}, measured")
            rows.append(row)
        if args.recipe:
            for name in DS_SCHEDULES:
                print(f"m={m} recipe {name} ...", file=sys.stderr, flush=True)
                results, other, retried = _run(_recipe_rank, (name, m, args.steps, args.warmup, layers),
                                               retries=args.retries, busy_cores=args.busy_cores)
                rows.append({"schedule": f"tiny:{name}", "micro_batches": m,
                             "step_ms": statistics.median(results[0]["times"]) * 1e3,
                             "steps_ms": [t * 1e3 for t in results[0]["times"]], "other_cpu_cores": other,
                             "retried": retried})

    print(f"\n4 pipeline ranks, costed layers F/B/W = {args.F:g}/{args.B:g}/{args.W:g} ms per layer, 8 layers "
          f"(per rank: {2 * args.F:g}/{2 * args.B:g}/{2 * args.W:g} ms per micro-batch); median of {args.steps} steps; "
          f"gloo p2p latency {latency:.2f} ms")
    print(f"{'schedule':<18} {'m':>3} {'step ms':>8} {'formula':>8} {'simulated':>9} {'sim+ovh':>8} "
          f"{'ovh/instr':>9} {'bubble':>7} {'sim bub':>7} {'others':>7}")
    for r in rows:
        def f(key, fmt="8.1f"):
            v = r.get(key)  # noqa: B023
            return format(v, fmt) if v is not None else f"{'-':>{fmt.split('.')[0]}}"
        print(f"{r['schedule']:<18} {r['micro_batches']:>3} {r['step_ms']:8.1f} {f('formula_ms')} "
              f"{f('simulated_ms', '9.1f')} {f('simulated_with_overhead_ms')} "
              f"{f('overhead_ms_per_instruction', '9.2f')} {f('bubble_ms', '7.1f')} {f('simulated_bubble_ms', '7.1f')} "
              f"{r['other_cpu_cores']:7.2f}")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as fh:
            json.dump({"costs_ms": {"F": args.F, "B": args.B, "W": args.W}, "layers": layers, "ranks": ranks,
                       "p2p_latency_ms": latency, "rows": rows}, fh, indent=2)


if __name__ == "__main__":
    main()

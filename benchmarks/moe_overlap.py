"""How much of the expert-parallel all-to-all the F&B overlap hides (``seekspeed.overlap``).

A tiny-moe-shaped model (the shape below) on a simulated cluster of 2 nodes x 2 ranks
(launch/simcluster.py namespaces, the inter-node link shaped to ``--rate``): 2
pipeline stages x 2 data-parallel replicas, expert parallelism 2, ranks placed so that
every expert-parallel group (the two replicas of a stage) spans both nodes and the
pipeline links stay inside a node; so every all-to-all crosses the shaped link.
Schedules 1f1b, dualpipev-zb and dualpipe, overlap none and layer (1f1b has no F&B
chunk to interleave: none only), all five engines built in the same processes from
the same weights and trained step by step in turn, so noise hits them alike.

Per engine, medians over --steps after --warmup (barrier to barrier; the slowest rank's
step, the ranks' mean all-to-all figures):
- step_ms;
- a2a_issued_ms: each all-to-all from its issue to the end of its wait, summed over the
  step (in flight);
- a2a_exposed_ms: the time the computing thread was blocked waiting for them;
- fb_a2a_exposed_ms: the same, inside F&B chunks only. The goal counts these:
  hidden = 1 - fb_exposed(layer) / fb_exposed(none); fb_exposed_by_what_ms splits them
  by exchange (the counts, the dispatch, the combine; F forward, B backward).

``--moe sleep`` replaces the compute of the routed experts and of every SwiGLU MLP (the
shared experts and the first, dense layer's MLP) with sleeps of a set cost (--sleep-ms
per call forward, twice that backward) around the real all-to-all bytes: the CPU is then free while a half "computes", which
separates what the overlap hides from what two processes per core take from each other.

    sudo python benchmarks/moe_overlap.py --json benchmarks/results/moe_overlap.json
    sudo python benchmarks/moe_overlap.py --moe sleep --json bench_out/moe_overlap_sleep.json

Needs root (network namespaces). Each figure set runs in one launch of 4 processes.
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

from benchmarks import machine_line, ranks_in_namespaces, write_figures

ENGINES = [("1f1b", "none"), ("dualpipev-zb", "none"), ("dualpipev-zb", "layer"), ("dualpipe", "none"),
           ("dualpipe", "layer")]
STAGES, DP, EP = 2, 2, 2


def _model_overrides(args):
    return {"num_hidden_layers": args.layers, "first_k_dense_replace": 1, "hidden_size": args.hidden,
            "moe_intermediate_size": args.moe_inter, "n_routed_experts": args.experts,
            "num_experts_per_tok": args.top_k, "n_group": args.groups, "topk_group": args.topk_groups}


def _engines(args):
    return [(schedule, overlap) for schedule, overlap in ENGINES if schedule in args.schedules]


def _sleep_moe(sleep_s):
    """Route the routed experts' and every SwiGLU MLP's compute (shared experts, the
    dense layer's MLP) through sleeps: forward ``sleep_s`` per call, backward twice that;
    the values are a cheap elementwise function, so gradients still flow."""
    import torch
    from recipes.layers import moe

    class _Sleep(torch.autograd.Function):

        @staticmethod
        def forward(ctx, x):
            time.sleep(sleep_s)
            return x * 0.5

        @staticmethod
        def backward(ctx, grad):
            time.sleep(2 * sleep_s)
            return grad * 0.5

    def run_experts(self, received, counts):
        out = _Sleep.apply(received)
        # every local expert's weights still take part (all ranks reduce the same buckets)
        return out + sum(e.down_proj.sum() * 0.0 + e.gate_up_proj.sum() * 0.0 for e in self.experts)

    moe.DeepSeekMoE._run_experts = run_experts
    original_shared = moe.SwiGLU.forward

    def shared(self, x):
        return _Sleep.apply(original_shared(self, x))

    moe.SwiGLU.forward = shared


def _ranks(args):
    """One rank (under this script's own launcher): train every engine step by step."""
    import warnings
    warnings.filterwarnings("ignore")
    import torch
    import deepspeed
    from deepspeed import comm as dist
    from recipes import deepseek_v3
    from ds_ext.pipe.engine import InstructionTimeline, initialize
    torch.set_num_threads(1)
    deepspeed.init_distributed("gloo")
    if args.moe == "sleep":
        _sleep_moe(args.sleep_ms / 1e3)
    config = deepseek_v3.make_config("tiny-moe", _model_overrides(args))
    ds_config = {"train_micro_batch_size_per_gpu": args.micro_batch, "gradient_accumulation_steps": args.micro_batches,
                 "steps_per_print": 10**9, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
                 "zero_optimization": {"stage": 1}}
    from recipes.layers.dispatch import Dispatch
    engines = {}
    for dispatcher in args.dispatchers:
        for schedule, overlap in _engines(args):
            model = deepseek_v3.build_pipeline(config, num_stages=STAGES, schedule=schedule, seed=3,
                                               expert_parallel_size=EP, moe_dispatch=Dispatch(dispatcher))
            engines[(schedule, overlap, dispatcher)] = initialize(model=model, config=ds_config, schedule=schedule,
                                                                  overlap=overlap,
                                                                  model_parameters=list(model.parameters()))
    g = torch.Generator().manual_seed(0)
    dp_id = next(iter(engines.values())).grid.get_data_parallel_id()
    rows = torch.randint(0, config.vocab_size, (DP, args.micro_batch, args.seq + 1), generator=g)[dp_id]

    def batches():
        while True:
            yield rows[:, :-1], rows[:, 1:]

    per = {key: {"step": [], "issued": [], "exposed": [], "fb_exposed": [], "fb_issued": [], "fb_by_what": []}
           for key in engines}
    for i in range(args.warmup + args.steps):
        for key, engine in engines.items():
            engine.timeline = InstructionTimeline()
            dist.barrier()
            t0 = time.perf_counter()
            engine.train_batch(batches())
            dist.barrier()
            elapsed = time.perf_counter() - t0
            events, engine.timeline = engine.timeline.events, None
            if args.trace_dir and i == args.warmup + args.steps - 1:
                _write_trace(args.trace_dir, key, events, origin=t0)
            if i < args.warmup:
                continue
            fb = [(s, e) for name, _, s, e in events if name == "ForwardBackwardPass"]

            def total(kind, inside=False):
                return sum(e - s for name, _, s, e in events if name == kind and  # noqa: B023
                           (not inside or any(fs <= s and e <= fe for fs, fe in fb)))  # noqa: B023
            d = per[key]
            d["step"].append(elapsed)
            d["issued"].append(total("AllToAll"))
            d["exposed"].append(total("WaitAllToAll"))
            d["fb_issued"].append(total("AllToAll", inside=True))
            d["fb_exposed"].append(total("WaitAllToAll", inside=True))
            d["fb_by_what"].append(_waited_by_what(events, fb))
    mine = torch.tensor([[statistics.median(per[k][f]) for f in ("step", "issued", "exposed", "fb_issued", "fb_exposed")]
                         for k in engines], dtype=torch.float64)
    everyone = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mine)
    by_what = [None] * dist.get_world_size()
    dist.all_gather_object(by_what, [_median_by_what(per[k]["fb_by_what"]) for k in engines])
    if dist.get_rank() == 0:
        stack = torch.stack(everyone)          # [rank, engine, field]
        out = []
        for j, (schedule, overlap, dispatcher) in enumerate(engines):
            out.append({"schedule": schedule, "overlap": overlap, "dispatcher": dispatcher,
                        "step_ms": float(stack[:, j, 0].max()) * 1e3,
                        "a2a_issued_ms": float(stack[:, j, 1].mean()) * 1e3,
                        "a2a_exposed_ms": float(stack[:, j, 2].mean()) * 1e3,
                        "fb_a2a_issued_ms": float(stack[:, j, 3].mean()) * 1e3,
                        "fb_a2a_exposed_ms": float(stack[:, j, 4].mean()) * 1e3,
                        "fb_exposed_by_what_ms": {w: statistics.mean(r[j].get(w, 0.0) for r in by_what) * 1e3
                                                  for w in sorted({w for r in by_what for w in r[j]})},
                        "per_rank_step_ms": [float(v) * 1e3 for v in stack[:, j, 0]]})
        with open(args.rows_json, "w") as f:
            json.dump(out, f)
    dist.barrier()
    sys.stdout.flush()
    os._exit(0)


def _waited_by_what(events, fb):
    """Seconds the computing thread waited for all-to-alls inside F&B chunks, by exchange
    (the label: "F counts", "F dispatch", "B combine", ...)."""
    out = {}
    for name, kwargs, start, end in events:
        if name == "WaitAllToAll" and any(fs <= start and end <= fe for fs, fe in fb):
            out[kwargs["what"]] = out.get(kwargs["what"], 0.0) + end - start
    return out


def _median_by_what(steps):
    return {w: statistics.median(step.get(w, 0.0) for step in steps) for w in {w for step in steps for w in step}}


def _write_trace(directory, key, events, *, origin):
    """The last step's instructions and all-to-alls of every rank, one Chrome trace and
    one PNG per engine (lanes: ranks 0-3 by pipeline stage, then replica)."""
    from deepspeed import comm as dist
    from ds_ext.pipe.trace import from_engine_events, plot_timeline, write_chrome_trace
    lanes = [None] * dist.get_world_size()
    dist.all_gather_object(lanes, from_engine_events(events, origin=origin))
    if dist.get_rank() == 0:
        os.makedirs(directory, exist_ok=True)
        name = f"{key[0]}_{key[1]}_{key[2]}"
        write_chrome_trace(lanes, os.path.join(directory, f"{name}.json"), name=name)
        plot_timeline(lanes, os.path.join(directory, f"{name}.png"),
                      title=f"{key[0]}, overlap {key[1]}, {key[2]} dispatch (ranks 0-3)")


def _launch(args, rows_json):
    """4 ranks in the simulated cluster: ranks 0 and 2 on node 0, 1 and 3 on node 1, so
    DeepSpeed's expert-parallel groups {0, 1} and {2, 3} (the replicas of each stage)
    cross the shaped link and the pipeline pairs 0-2 and 1-3 do not."""
    script = [sys.executable, os.path.abspath(__file__), "--rows-json", rows_json]
    for name in ("steps", "warmup", "micro_batches", "micro_batch", "seq", "layers", "hidden", "moe_inter", "experts",
                 "top_k", "groups", "topk_groups", "moe", "sleep_ms"):
        script += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    script += ["--dispatchers", *args.dispatchers, "--schedules", *args.schedules]
    if args.trace_dir:
        script += ["--trace-dir", os.path.abspath(args.trace_dir)]
    return ranks_in_namespaces(script, node_of=[rank % 2 for rank in range(4)], rate=args.rate,
                               master_port=args.master_port, timeout=args.timeout, rows_json=rows_json,
                               name="moe_overlap")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rate", default="200mbit", help="the simulated inter-node link (tc rate, each direction)")
    p.add_argument("--moe", choices=("real", "sleep"), default="real")
    p.add_argument("--sleep-ms", type=float, default=4.0, help="--moe sleep: forward cost of one expert call")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--micro-batches", type=int, default=8)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--layers", type=int, default=5, help="decoder layers (the first dense, the rest MoE)")
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--moe-inter", type=int, default=96)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--groups", type=int, default=1, help="n_group: expert groups for group-limited routing "
                   "(tiny-moe's preset: 4)")
    p.add_argument("--topk-groups", type=int, default=1, help="topk_group: groups chosen per token (tiny-moe's: 2)")
    p.add_argument("--master-port", type=int, default=29741)
    p.add_argument("--timeout", type=int, default=1200)
    p.add_argument("--experts-shapes", nargs="*", default=["v2-lite-h512", "tiny-moe"],
                   help="also time the routed experts (benchmarks/grouped_experts.py) on these shapes, one process")
    p.add_argument("--experts-repeats", type=int, default=3)
    p.add_argument("--dispatchers", nargs="+", default=["every-copy", "deduplicated"],
                   choices=["every-copy", "deduplicated"], help="the MoE token dispatchers, each with every engine")
    p.add_argument("--schedules", nargs="+", default=["1f1b", "dualpipev-zb", "dualpipe"],
                   choices=["1f1b", "dualpipev-zb", "dualpipe"], help="the schedules to run (1f1b is the baseline)")
    p.add_argument("--trace-dir", help="write each engine's last step as a Chrome trace and a PNG here")
    p.add_argument("--json")
    p.add_argument("--rows-json", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.rows_json and "RANK" in os.environ:
        return _ranks(args)
    if "1f1b" not in args.schedules:
        p.error("--schedules must include 1f1b: the other schedules are set against it")
    print(f"[moe_overlap] {len(_engines(args))} engines on 2 simulated nodes x 2 ranks, {args.rate} between nodes, "
          f"moe {args.moe}; {args.warmup} + {args.steps} steps each ...", file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory(prefix="moe-overlap-rows-") as tmp:
        rows = _launch(args, os.path.join(tmp, "rows.json"))
    by = {(r["schedule"], r["overlap"], r["dispatcher"]): r for r in rows}
    base = by[("1f1b", "none", args.dispatchers[0])]
    share = base["a2a_exposed_ms"] / base["step_ms"]
    print(machine_line())
    print(f"\ntiny-moe shape: hidden {args.hidden}, {args.layers} layers ({args.layers - 1} MoE), {args.experts} experts "
          f"top-{args.top_k} ({args.topk_groups} of {args.groups} groups), moe_intermediate {args.moe_inter}; micro-batch {args.micro_batch} x {args.seq} tokens, "
          f"{args.micro_batches} micro-batches; 2 stages x 2 replicas, EP 2 across the {args.rate} link; moe {args.moe}")
    print(f"all-to-all waited for in the sequential 1f1b step: {share:.0%} of it")
    print(f"{'dispatcher':<13} {'schedule':<14} {'overlap':<7} {'step ms':>8} {'vs 1f1b':>8} {'vs every':>8} "
          f"{'a2a in flight':>13} {'a2a waited':>10} {'F&B waited':>10} {'hidden in F&B':>13}")
    for r in rows:
        own = by[("1f1b", "none", r["dispatcher"])]
        r["speedup_vs_1f1b"] = own["step_ms"] / r["step_ms"]
        every = by.get((r["schedule"], r["overlap"], "every-copy"))
        r["speedup_vs_every_copy"] = every["step_ms"] / r["step_ms"] if every else None
        none = by.get((r["schedule"], "none", r["dispatcher"]))
        r["fb_hidden"] = (1 - r["fb_a2a_exposed_ms"] / none["fb_a2a_exposed_ms"]
                          if r["overlap"] == "layer" and none and none["fb_a2a_exposed_ms"] > 0 else None)
        hidden = f"{r['fb_hidden']:.0%}" if r["fb_hidden"] is not None else "-"
        vs_every = f"{r['speedup_vs_every_copy']:7.2f}x" if r["speedup_vs_every_copy"] else "       -"
        print(f"{r['dispatcher']:<13} {r['schedule']:<14} {r['overlap']:<7} {r['step_ms']:8.0f} "
              f"{r['speedup_vs_1f1b']:7.2f}x {vs_every} "
              f"{r['a2a_issued_ms']:13.0f} {r['a2a_exposed_ms']:10.0f} {r['fb_a2a_exposed_ms']:10.0f} {hidden:>13}")
    print("\nwaited for inside F&B chunks, by exchange (ms, mean over ranks of the per-step median):")
    for r in rows:
        if r["fb_exposed_by_what_ms"]:
            print(f"  {r['dispatcher']:<13} {r['schedule']:<14} {r['overlap']:<6} "
                  + ", ".join(f"{w} {v:.0f}" for w, v in r["fb_exposed_by_what_ms"].items()))
    experts, experts_ratios = [], {}
    if args.experts_shapes:
        from benchmarks.grouped_experts import experts_rows, ratios
        experts = experts_rows(shapes=args.experts_shapes, repeats=args.experts_repeats)
        experts_ratios = ratios(experts)
        print(f"\nrouted experts, one process, 2 threads, forward + backward, median of {args.experts_repeats} (ms):")
        for shape, r in experts_ratios.items():
            ms = {e["impl"]: e["ms"] for e in experts if e["shape"] == shape}
            print(f"  {shape:<14} " + "  ".join(f"{k} {v:,.1f}" for k, v in ms.items())
                  + f"  | loop/grouped {r['loop_over_grouped']:.2f}x, best transformers/grouped "
                    f"{r['fastest_transformers_over_grouped']:.2f}x")
    write_figures(args.json, {"moe": args.moe, "rate": args.rate, "a2a_share_of_1f1b_step": share,
                              "experts": experts, "experts_ratios": experts_ratios,
                              "shape": _model_overrides(args) | {"micro_batch": args.micro_batch, "seq": args.seq,
                                                                 "micro_batches": args.micro_batches},
                              "rows": rows})


if __name__ == "__main__":
    main()

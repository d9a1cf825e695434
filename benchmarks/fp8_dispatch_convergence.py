"""FP8 dispatch trains as the dispatch in the activation dtype does: the tiny-moe run of
ds_configs/tiny_moe_cpu.json (4 ranks: 2 stages x 2 replicas, expert parallelism 2, fp32
activations, the config's AdamW) with ``seekspeed.moe.dispatch_dtype`` unset and "fp8"
(e4m3 rows, an fp32 scale per 128 channels, ds_ext/comm/fp8.py), per seed, side by side.
Rows {seed, dispatch_dtype, final_loss (mean of the last 20 steps), ref_final_loss (the
same seed's unset run), rel_pct}.

``--control`` adds a third run per seed that changes nothing but the fp32 rounding: the
rows unset, micro-batch 2 x accumulation 8 instead of 4 x 4 (the same 16 sequences a step
in the same order, the same mean loss; only the order of the fp32 sums differs). How far
that run ends from its twin is the trajectory's own sensitivity to a rounding-sized
perturbation: a per-seed difference of that size says nothing about FP8.

    python benchmarks/fp8_dispatch_convergence.py --steps 300 --seeds 0 1 2 \\
        --json benchmarks/results/fp8_dispatch_convergence.json
"""

import argparse
import json
import os
import statistics
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks import launch, machine_line, write_figures

CONFIG = os.path.join(ROOT, "ds_configs", "tiny_moe_cpu.json")
TAIL = 20


CONTROL = "fp32, re-associated"


def run(*, seed, dtype, steps, workdir):
    with open(CONFIG) as f:
        cfg = json.load(f)
    if dtype == CONTROL:
        micro, accum = cfg["train_micro_batch_size_per_gpu"], cfg["gradient_accumulation_steps"]
        cfg["train_micro_batch_size_per_gpu"], cfg["gradient_accumulation_steps"] = micro // 2, accum * 2
    s = cfg["seekspeed"]
    s["moe"]["expert_parallel_size"] = 2
    if dtype not in (None, CONTROL):
        s["moe"]["dispatch_dtype"] = dtype
    s["train"]["seed"] = seed
    s["train"]["log_interval"] = max(1, steps // 5)
    name = f"s{seed}-{'control' if dtype == CONTROL else dtype or 'act'}"
    path = os.path.join(workdir, f"{name}.json")
    with open(path, "w") as f:
        json.dump(cfg, f)
    out = launch(["launch/train.py", "--deepspeed", path, "--steps", str(steps), "--checkpoint-dir",
                  os.path.join(workdir, f"ck-{name}")], world=4, summary_json=os.path.join(workdir, f"{name}.sum.json"),
                 what=name)
    losses = out["losses"]
    return {"seed": seed, "dispatch_dtype": dtype or "activation (fp32)", "final_loss": statistics.mean(losses[-TAIL:]),
            "first_loss": losses[0], "steps": len(losses), "losses": losses}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--control", action="store_true", help="add the re-associated fp32 run per seed (docstring)")
    p.add_argument("--json")
    args = p.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="fp8-dispatch-") as tmp:
        arms = (None, "fp8", CONTROL) if args.control else (None, "fp8")
        for i, seed in enumerate(args.seeds):
            pair = []
            for j, dtype in enumerate(arms):
                print(f"[{len(arms) * i + j + 1}/{len(arms) * len(args.seeds)}] seed {seed}, dispatch "
                      f"{dtype or 'fp32'}: {args.steps} steps on 4 ranks ...", file=sys.stderr, flush=True)
                pair.append(run(seed=seed, dtype=dtype, steps=args.steps, workdir=tmp))
            ref = pair[0]["final_loss"]
            for r in pair:
                r["ref_final_loss"] = ref
                r["rel_pct"] = (r["final_loss"] / ref - 1) * 100
            rows += pair
    print(machine_line())
    print(f"\ntiny-moe, 4 ranks (2 stages x 2 replicas, EP 2), {args.steps} steps; final loss = mean of the last {TAIL}")
    print(f"{'seed':>4} {'dispatch':<20} {'final loss':>10} {'vs fp32':>8}")
    for r in rows:
        print(f"{r['seed']:>4} {r['dispatch_dtype']:<20} {r['final_loss']:10.4f} {r['rel_pct']:+7.2f}%")
    fp8 = [r["rel_pct"] for r in rows if r["dispatch_dtype"] == "fp8"]
    print(f"fp8 against fp32: {min(fp8):+.2f}% to {max(fp8):+.2f}% over seeds {args.seeds}, "
          f"mean {statistics.mean(fp8):+.2f}%")
    figures = {"steps": args.steps, "seeds": args.seeds, "rows": rows, "max_abs_rel_pct": max(abs(v) for v in fp8),
               "mean_rel_pct": statistics.mean(fp8)}
    control = [r["rel_pct"] for r in rows if r["dispatch_dtype"] == CONTROL]
    if control:
        print(f"re-associated fp32 against fp32: {min(control):+.2f}% to {max(control):+.2f}%, mean "
              f"{statistics.mean(control):+.2f}% (the same run but for the order of its fp32 sums)")
        figures |= {"control_max_abs_rel_pct": max(abs(v) for v in control),
                    "control_mean_rel_pct": statistics.mean(control)}
    write_figures(args.json, figures)


if __name__ == "__main__":
    main()

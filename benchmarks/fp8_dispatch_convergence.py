"""FP8 dispatch trains as the dispatch in the activation dtype does: the tiny-moe run of
ds_configs/tiny_moe_cpu.json (4 ranks: 2 stages x 2 replicas, expert parallelism 2, fp32
activations, the config's AdamW) with ``seekspeed.moe.dispatch_dtype`` unset and "fp8"
(e4m3 rows, an fp32 scale per 128 channels, ds_ext/comm/fp8.py), per seed, side by side.
Rows {seed, dispatch_dtype, final_loss (mean of the last 20 steps), ref_final_loss (the
same seed's unset run), rel_pct}.

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


def run(*, seed, dtype, steps, workdir):
    with open(CONFIG) as f:
        cfg = json.load(f)
    s = cfg["seekspeed"]
    s["moe"]["expert_parallel_size"] = 2
    if dtype is not None:
        s["moe"]["dispatch_dtype"] = dtype
    s["train"]["seed"] = seed
    s["train"]["log_interval"] = max(1, steps // 5)
    name = f"s{seed}-{dtype or 'act'}"
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
    p.add_argument("--json")
    args = p.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="fp8-dispatch-") as tmp:
        for i, seed in enumerate(args.seeds):
            pair = []
            for j, dtype in enumerate((None, "fp8")):
                print(f"[{2 * i + j + 1}/{2 * len(args.seeds)}] seed {seed}, dispatch {dtype or 'fp32'}: "
                      f"{args.steps} steps on 4 ranks ...", file=sys.stderr, flush=True)
                pair.append(run(seed=seed, dtype=dtype, steps=args.steps, workdir=tmp))
            ref = pair[0]["final_loss"]
            for r in pair:
                r["ref_final_loss"] = ref
                r["rel_pct"] = (r["final_loss"] / ref - 1) * 100
            rows += pair
    print(machine_line())
    print(f"\ntiny-moe, 4 ranks (2 stages x 2 replicas, EP 2), {args.steps} steps; final loss = mean of the last {TAIL}")
    print(f"{'seed':>4} {'dispatch':<18} {'final loss':>10} {'vs fp32':>8}")
    for r in rows:
        print(f"{r['seed']:>4} {r['dispatch_dtype']:<18} {r['final_loss']:10.4f} {r['rel_pct']:+7.2f}%")
    fp8 = [r["rel_pct"] for r in rows if r["dispatch_dtype"] == "fp8"]
    print(f"fp8 against fp32: {min(fp8):+.2f}% to {max(fp8):+.2f}% over seeds {args.seeds}")
    write_figures(args.json, {"steps": args.steps, "seeds": args.seeds, "rows": rows,
                              "max_abs_rel_pct": max(abs(v) for v in fp8)})


if __name__ == "__main__":
    main()

"""Auxiliary-loss-free load balancing on the tiny-moe recipe: the same run (4 ranks,
2 stages x 2 replicas, ds_configs/tiny_moe_cpu.json) with the bias update speed
gamma at several values, side by side. Reports the worst MoE layer's max/mean expert
load at the end (1.0 = perfectly balanced; 4.0 = every token's top-2 includes one
expert, with 8 experts) and the final loss.

    python benchmarks/moe_balance.py --steps 60 --speeds 0 0.001 0.01 --json bench_out/moe_balance.json
"""

import argparse
import json
import os
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks import launch
CONFIG = os.path.join(ROOT, "ds_configs", "tiny_moe_cpu.json")


def run(speed, steps, workdir):
    with open(CONFIG) as f:
        cfg = json.load(f)
    cfg["seekspeed"]["moe"]["bias_update_speed"] = speed
    path = os.path.join(workdir, f"speed-{speed}.json")
    with open(path, "w") as f:
        json.dump(cfg, f)
    return launch(["launch/train.py", "--deepspeed", path, "--steps", str(steps), "--checkpoint-dir",
                   os.path.join(workdir, f"ckpt-{speed}")], world=4,
                  summary_json=os.path.join(workdir, f"summary-{speed}.json"), what=f"speed {speed}")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--speeds", type=float, nargs="+", default=[0.0, 0.001, 0.01])
    p.add_argument("--json", help="write the figures here")
    args = p.parse_args()
    rows = {}
    with tempfile.TemporaryDirectory(prefix="seekspeed-moe-") as workdir:
        for speed in args.speeds:
            print(f"gamma {speed} ...", file=sys.stderr, flush=True)
            s = run(speed, args.steps, workdir)
            rows[str(speed)] = {"max_over_mean_load": s["moe"]["max_over_mean_load"],
                                "balance_loss": s["moe"]["balance_loss"], "loss_last": s["loss_last"],
                                "expert_load": s["moe"]["expert_load"]}
    print(f"\ntiny-moe, 4 ranks, {args.steps} steps; worst layer's expert load at the last step")
    print(f"{'gamma':>8} {'max/mean load':>14} {'final loss':>11}")
    for speed, row in rows.items():
        print(f"{float(speed):>8g} {row['max_over_mean_load']:>14.2f} {row['loss_last']:>11.4f}")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"steps": args.steps, "runs": rows}, f, indent=2)


if __name__ == "__main__":
    main()

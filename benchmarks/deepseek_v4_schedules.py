"""DeepSeek-V4 (tiny preset: sliding, CSA and HCA layers, hash and score routing, mHC with
4 streams) through launch/train.py under every schedule, with expert parallelism 1 and 2
(fp32), and in bf16 with fp32 gradient accumulation and activation checkpointing
(expert parallelism 2): the matrix tests/test_deepseek_v4.py and the kill-and-resume test
sample.

4 CPU ranks (2 pipeline stages x 2 replicas), ds_configs/tiny_v4_cpu.json at sequence
length 256, a constant learning rate, AdamW, --steps steps each under the deepspeed
launcher. Per run: the first and last loss, every step's loss against the expert-parallel
degree 1 run of the same schedule and precision where there is one (``max_loss_diff_ep1``:
0.0 means bitwise), the indexer's KL loss as the trainer reports it, the steady step time.

    python benchmarks/deepseek_v4_schedules.py --json benchmarks/results/deepseek_v4_schedules.json
"""

import argparse
import json
import os
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks import launch, machine_line, write_figures

SCHEDULES = ("1f1b", "dualpipev", "dualpipev-zb", "dualpipe")
# (precision, expert-parallel degree): fp32 at both degrees; bf16 at 2 (and 1, to compare)
VARIANTS = (("fp32", 1), ("fp32", 2), ("bf16", 1), ("bf16", 2))


def _config(directory, *, schedule, precision, ep, steps):
    with open(os.path.join(ROOT, "ds_configs", "tiny_v4_cpu.json")) as f:
        cfg = json.load(f)
    cfg.update(train_micro_batch_size_per_gpu=1, gradient_accumulation_steps=4)
    cfg.pop("scheduler")
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True}
        cfg["data_types"] = {"grad_accum_dtype": "fp32"}
        cfg["pipeline"]["activation_checkpoint_interval"] = 1
    s = cfg["seekspeed"]
    s["schedule"] = schedule
    s["moe"]["expert_parallel_size"] = ep
    s["train"].update(steps=steps, log_interval=1)
    name = f"{schedule}-{precision}-ep{ep}"
    s["checkpoint"].update(dir=os.path.join(directory, f"ckpt-{name}"), interval_steps=0)
    path = os.path.join(directory, f"{name}.json")
    with open(path, "w") as f:
        json.dump(cfg, f)
    return path, name


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--schedules", nargs="+", default=list(SCHEDULES), choices=SCHEDULES)
    p.add_argument("--json", help="write the figures here")
    args = p.parse_args()
    rows, losses = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        for schedule in args.schedules:
            for precision, ep in VARIANTS:
                print(f"{schedule} / {precision} / EP {ep} ...", flush=True)
                cfg, name = _config(tmp, schedule=schedule, precision=precision, ep=ep, steps=args.steps)
                summary = launch(["launch/train.py", "--deepspeed", cfg], world=4,
                                 summary_json=os.path.join(tmp, f"{name}.summary.json"), what=name)
                losses[(schedule, precision, ep)] = summary["losses"]
                base = losses.get((schedule, precision, 1)) if ep != 1 else None
                rows.append({"schedule": schedule, "ep": ep, "precision": precision, "optimizer": "AdamW",
                             "first_loss": summary["losses"][0], "final_loss": summary["losses"][-1],
                             "max_loss_diff_ep1": (max(abs(a - b) for a, b in zip(summary["losses"], base))
                                                   if base else None),
                             "indexer_loss": summary.get("layer_losses", {}).get("indexer"),
                             "s_per_step": summary["tokens"] / summary["steps"] / summary["steady_tokens_per_s"]})
    print(machine_line())
    print(f"{'schedule':<14} {'prec':<5} {'EP':>2} {'loss first':>10} {'loss last':>10} {'vs EP1':>9} "
          f"{'indexer KL':>11} {'s/step':>7}")
    for r in rows:
        diff = "-" if r["max_loss_diff_ep1"] is None else f"{r['max_loss_diff_ep1']:.1e}"
        print(f"{r['schedule']:<14} {r['precision']:<5} {r['ep']:>2} {r['first_loss']:>10.4f} {r['final_loss']:>10.4f} "
              f"{diff:>9} {r['indexer_loss']:>11.4f} {r['s_per_step']:>7.2f}")
    write_figures(args.json, {"steps": args.steps, "world": 4, "seq_len": 256, "rows": rows})


if __name__ == "__main__":
    main()

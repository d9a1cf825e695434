"""DeepSeek-V3.2 (DeepSeek Sparse Attention) through launch/train.py under every schedule
with expert parallelism, both DSA stages: the matrix tests/test_deepseek_v32.py samples
(1f1b in the warm-up, dualpipe in the sparse stage) and tests/test_recipes.py runs
without expert parallelism (1f1b, dualpipev-zb).

4 CPU ranks (2 pipeline stages x 2 replicas, expert parallelism 2), ds_configs/
tiny_v32_moe_cpu.json (tiny-moe: 3 MoE layers of 8 experts, 16 keys per query) at
sequence length 64, a constant learning rate, --steps steps each under the deepspeed
launcher. Per run: the first and last loss, the indexer's KL loss as the trainer
reports it (summed over layers) and the steady step time.

    python benchmarks/deepseek_v32_schedules.py --json benchmarks/results/deepseek_v32_schedules.json
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
STAGES = ("warmup", "sparse")


def _config(directory, *, schedule, stage, steps):
    with open(os.path.join(ROOT, "ds_configs", "tiny_v32_moe_cpu.json")) as f:
        cfg = json.load(f)
    cfg.update(train_micro_batch_size_per_gpu=1, gradient_accumulation_steps=4)
    cfg.pop("scheduler")
    s = cfg["seekspeed"]
    s.update(schedule=schedule, dsa={"stage": stage})
    s["moe"].update(expert_parallel_size=2, bias_update_speed=0.0 if stage == "warmup" else 0.01)
    s["data"]["seq_len"] = 64
    s["train"].update(steps=steps, log_interval=1)
    s["checkpoint"].update(dir=os.path.join(directory, f"ckpt-{schedule}-{stage}"), interval_steps=0)
    path = os.path.join(directory, f"{schedule}-{stage}.json")
    with open(path, "w") as f:
        json.dump(cfg, f)
    return path


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--schedules", nargs="+", default=list(SCHEDULES), choices=SCHEDULES)
    p.add_argument("--stages", nargs="+", default=list(STAGES), choices=STAGES)
    p.add_argument("--json", help="write the figures here")
    args = p.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for stage in args.stages:
            for schedule in args.schedules:
                print(f"{schedule} / {stage} ...", flush=True)
                cfg = _config(tmp, schedule=schedule, stage=stage, steps=args.steps)
                summary = launch(["launch/train.py", "--deepspeed", cfg], world=4,
                                 summary_json=os.path.join(tmp, f"{schedule}-{stage}.summary.json"),
                                 what=f"{schedule} {stage}")
                rows.append({"schedule": schedule, "stage": stage, "first_loss": summary["losses"][0],
                             "last_loss": summary["losses"][-1],
                             "indexer_loss": summary.get("layer_losses", {}).get("indexer"),
                             "step_s": summary["tokens"] / summary["steps"] / summary["steady_tokens_per_s"]})
    print(machine_line())
    print(f"{'schedule':<14} {'stage':<7} {'loss first':>10} {'loss last':>10} {'indexer KL':>11} {'step s':>7}")
    for r in rows:
        print(f"{r['schedule']:<14} {r['stage']:<7} {r['first_loss']:>10.4f} {r['last_loss']:>10.4f} "
              f"{r['indexer_loss']:>11.4f} {r['step_s']:>7.2f}")
    write_figures(args.json, {"steps": args.steps, "world": 4, "expert_parallel_size": 2, "rows": rows})


if __name__ == "__main__":
    main()

"""DeepSeek-V4 (tiny preset: sliding, CSA and HCA layers, hash and score routing, mHC with
4 streams) through launch/train.py under every schedule, with expert parallelism 1 and 2
(fp32), and in bf16 with activation checkpointing (expert parallelism 2; AdamW with fp32
gradient accumulation, Muon with bf16, the only bf16 form DeepSpeed runs Muon in with a
pipeline and MoE): the matrix tests/test_deepseek_v4.py and the kill-and-resume test
sample.

4 CPU ranks (2 pipeline stages x 2 replicas), ds_configs/tiny_v4_cpu.json at sequence
length 256, a constant learning rate, --steps steps each under the deepspeed launcher;
each variant with AdamW and with DeepSpeed's Muon (the config's own optimizer: matrices
on Newton-Schulz, the embedding, head, vectors and position biases on its auxiliary
Adam). `overlap` is the config's `auto`: `layer` (F&B chunks interleaved at every
expert all-to-all) for dualpipev-zb and dualpipe at expert parallelism 2, recorded per row.
Besides, fp32 at expert parallelism 2 with the sign-compressed data-parallel reduction
(``comm.compressor: sign``, one dense warm-up step), against the same run dense. Per
run: the first and last loss, every step's loss against the expert-parallel degree 1 run
of the same schedule, precision and optimizer where there is one (``max_loss_diff_ep1``:
0.0 means bitwise), or for a sign row against its dense run (``final_loss_vs_dense``), the
indexer's KL loss as the trainer reports it, the steady step time.

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
# (precision, expert-parallel degree, optimizer, compressor): fp32 at both degrees; bf16 at 2
# (and 1, to compare); Muon as AdamW; fp32 EP 2 with the sign compressor
VARIANTS = tuple((precision, ep, opt, "none") for opt in ("AdamW", "Muon")
                 for precision, ep in (("fp32", 1), ("fp32", 2), ("bf16", 1), ("bf16", 2))) + \
    tuple(("fp32", 2, opt, "sign") for opt in ("AdamW", "Muon"))
LAYER_OVERLAP = ("dualpipev-zb", "dualpipe")      # what overlap "auto" makes "layer" with expert parallelism
ADAMW = {"type": "AdamW", "params": {"lr": 2e-3, "betas": [0.9, 0.95], "weight_decay": 0.1}}


def _config(directory, *, schedule, precision, ep, optimizer, compressor, steps):
    with open(os.path.join(ROOT, "ds_configs", "tiny_v4_cpu.json")) as f:
        cfg = json.load(f)
    cfg.update(train_micro_batch_size_per_gpu=1, gradient_accumulation_steps=4)
    cfg.pop("scheduler")
    if optimizer == "AdamW":
        cfg["optimizer"] = ADAMW
    assert cfg["optimizer"]["type"] == optimizer, cfg["optimizer"]
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True}
        if optimizer == "AdamW":    # DeepSpeed's BF16 optimizer, which refuses Muon with a pipeline or MoE
            cfg["data_types"] = {"grad_accum_dtype": "fp32"}
        cfg["pipeline"]["activation_checkpoint_interval"] = 1
    s = cfg["seekspeed"]
    s["schedule"] = schedule
    s["moe"]["expert_parallel_size"] = ep
    s["train"].update(steps=steps, log_interval=1)
    if compressor != "none":
        s["comm"] = {"compressor": compressor, "warmup_steps": 1}
    name = f"{schedule}-{precision}-ep{ep}-{optimizer.lower()}-{compressor}"
    s["checkpoint"].update(dir=os.path.join(directory, f"ckpt-{name}"), interval_steps=0)
    path = os.path.join(directory, f"{name}.json")
    with open(path, "w") as f:
        json.dump(cfg, f)
    return path, name


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--schedules", nargs="+", default=list(SCHEDULES), choices=SCHEDULES)
    p.add_argument("--optimizers", nargs="+", default=["AdamW", "Muon"], choices=["AdamW", "Muon"])
    p.add_argument("--json", help="write the figures here")
    args = p.parse_args()
    rows, losses = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        for schedule in args.schedules:
            for precision, ep, opt, comp in VARIANTS:
                if opt not in args.optimizers:
                    continue
                print(f"{schedule} / {precision} / EP {ep} / {opt} / {comp} ...", flush=True)
                cfg, name = _config(tmp, schedule=schedule, precision=precision, ep=ep, optimizer=opt,
                                    compressor=comp, steps=args.steps)
                summary = launch(["launch/train.py", "--deepspeed", cfg], world=4,
                                 summary_json=os.path.join(tmp, f"{name}.summary.json"), what=name)
                got = summary["losses"]
                losses[(schedule, precision, ep, opt, comp)] = got
                base = losses.get((schedule, precision, 1, opt, comp)) if ep != 1 else None
                dense = losses.get((schedule, precision, ep, opt, "none")) if comp != "none" else None
                rows.append({"schedule": schedule, "ep": ep, "precision": precision, "optimizer": opt,
                             "grad_accum": "fp32" if precision == "fp32" or opt == "AdamW" else "bf16",
                             "compressor": comp, "overlap": "layer" if ep > 1 and schedule in LAYER_OVERLAP else "none",
                             "first_loss": got[0], "final_loss": got[-1],
                             "max_loss_diff_ep1": max(abs(a - b) for a, b in zip(got, base)) if base else None,
                             "final_loss_vs_dense": got[-1] / dense[-1] - 1 if dense else None,
                             "indexer_loss": summary.get("layer_losses", {}).get("indexer"),
                             "s_per_step": summary["tokens"] / summary["steps"] / summary["steady_tokens_per_s"]})
    print(machine_line())
    print(f"{'schedule':<14} {'opt':<5} {'comm':<5} {'prec':<5} {'EP':>2} {'overlap':<7} {'loss first':>10} "
          f"{'loss last':>10} {'vs EP1':>9} {'vs dense':>9} {'indexer KL':>11} {'s/step':>7}")
    for r in rows:
        diff = "-" if r["max_loss_diff_ep1"] is None else f"{r['max_loss_diff_ep1']:.1e}"
        vs_dense = "-" if r["final_loss_vs_dense"] is None else f"{r['final_loss_vs_dense']:+.2%}"
        print(f"{r['schedule']:<14} {r['optimizer']:<5} {r['compressor']:<5} {r['precision']:<5} {r['ep']:>2} "
              f"{r['overlap']:<7} {r['first_loss']:>10.4f} {r['final_loss']:>10.4f} {diff:>9} {vs_dense:>9} "
              f"{r['indexer_loss']:>11.4f} {r['s_per_step']:>7.2f}")
    write_figures(args.json, {"steps": args.steps, "world": 4, "seq_len": 256, "rows": rows})


if __name__ == "__main__":
    main()

"""Does compressed gradient communication still train? The tiny recipe, data parallel
over --ranks ranks (one pipeline stage), trained --steps steps with DeepSpeed's own
reduction and with each compressor, same data and seed, one after another in one run.
The final loss (mean of the last 20 steps) of each is compared with the dense run's.

    python benchmarks/compression_convergence.py --json benchmarks/results/compression_convergence.json

Runs (--runs): none (DeepSpeed's dense reduction), the gradient compressors (top-k 1 % with
and without error feedback, PowerSGD, int8, int4, sign) and target momentum (1-bit Adam's
scheme: the variance frozen after --momentum-warmup dense steps, the momentum sent through
sign, int4 or top-k; 0/1 Adam's variance schedule, ``var_update_scaler``, with no fixed
warm-up). --seeds runs each once per seed; rows carry run, seed, final_loss,
dense_final_loss (the same seed's dense run on the same machine, recorded in machine: a CPU
rounds differently from another), bytes_per_step (sent per rank per step after
the warm-up; DeepSpeed's dense: a ring all-reduce's), dense_bytes_per_step and
run_bytes_per_step, bytes_total and dense_bytes_total (every step, dense warm-up and 0/1
Adam's variance refreshes included; DeepSpeed's dense: a ring all-reduce's) and steps; target
momentum rows also clipped_steps (momentum steps whose clip coefficient was below 1: M kept
in fp32 after them) and momentum_codes_steps (M kept as the compressor's codes after them).
About 1.5 minutes a run of 300 steps on 2 cores.

    python benchmarks/compression_convergence.py --seeds 0 1 2 --runs none int4-ef momentum-sign ... \
        --json benchmarks/results/compression_adamw.json
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from ds_ext.distributed import free_port

RUNS = {
    "none": {"compressor": "none"},
    "topk-1%-ef": {"compressor": "topk", "ratio": 0.01, "error_feedback": True},
    "topk-1%-no-ef": {"compressor": "topk", "ratio": 0.01, "error_feedback": False},
    "powersgd-r4-ef": {"compressor": "powersgd", "rank": 4, "error_feedback": True},
    "powersgd-r4-no-ef": {"compressor": "powersgd", "rank": 4, "error_feedback": False},
    "powersgd-r8-ef": {"compressor": "powersgd", "rank": 8, "error_feedback": True},
    "int8-ef": {"compressor": "int8", "error_feedback": True},
    "int4-ef": {"compressor": "int4", "error_feedback": True},          # a scale per 64 entries, its default
    "int4-ef-b256": {"compressor": "int4", "error_feedback": True, "block_size": 256},
    "sign-ef": {"compressor": "sign", "error_feedback": True},
    # 1-bit Adam's scheme: Adam's variance frozen after the warm-up, the momentum sent compressed
    "momentum-fp32": {"compressor": "fp32", "target": "momentum"},     # the frozen variance alone, uncompressed
    "momentum-sign": {"compressor": "sign", "target": "momentum"},
    "momentum-sign-bf16": {"compressor": "sign", "target": "momentum", "residual_dtype": "bf16"},   # residuals kept in bf16
    "momentum-int4": {"compressor": "int4", "target": "momentum", "block_size": 256},
    "momentum-topk-1%": {"compressor": "topk", "ratio": 0.01, "target": "momentum"},
    # 0/1 Adam's variance schedule on the momentum target (no fixed warm-up: the schedule
    # starts dense): its kappa 16; kappa 4; kappa 1 (refreshes at the powers of two) with
    # the variance frozen for good after step 64
    "momentum-sign-01": {"compressor": "sign", "target": "momentum", "var_update_scaler": 16},
    "momentum-fp32-01": {"compressor": "fp32", "target": "momentum", "var_update_scaler": 16},   # the schedule alone
    "momentum-sign-01-k4": {"compressor": "sign", "target": "momentum", "var_update_scaler": 4},
    "momentum-sign-01-k1-f64": {"compressor": "sign", "target": "momentum", "var_update_scaler": 1,
                                "var_freeze_step": 64},
    # kappa 1 frozen after 256: two more refreshes (steps 128 and 256) for long runs
    "momentum-sign-01-k1-f256": {"compressor": "sign", "target": "momentum", "var_update_scaler": 1,
                                 "var_freeze_step": 256},
    # and after 512: one refresh more (step 512), 21.6x over 1,000 steps by the arithmetic
    "momentum-sign-01-k1-f512": {"compressor": "sign", "target": "momentum", "var_update_scaler": 1,
                                 "var_freeze_step": 512},
    # refreshed at the powers of two to 64, then every 64th step to the end (var_update_max_interval):
    # the schedule alone (fp32), and with signs
    "momentum-fp32-01-k1-c64": {"compressor": "fp32", "target": "momentum", "var_update_scaler": 1,
                                "var_update_max_interval": 64},
    "momentum-sign-01-k1-c64": {"compressor": "sign", "target": "momentum", "var_update_scaler": 1,
                                "var_update_max_interval": 64},
    # and the refreshes sent as int4 (two-phase, a scale per 64 entries, no error feedback)
    "momentum-sign-01-k1-c64-r4": {"compressor": "sign", "target": "momentum", "var_update_scaler": 1,
                                   "var_update_max_interval": 64, "refresh_compressor": "int4"},
    "momentum-sign-01-k1-c32-r4": {"compressor": "sign", "target": "momentum", "var_update_scaler": 1,
                                   "var_update_max_interval": 32, "refresh_compressor": "int4"},
    # the same with the variance's moving average kept in steps (var_refresh_decay "elapsed")
    "momentum-sign-01-k1-c32-r4-el": {"compressor": "sign", "target": "momentum", "var_update_scaler": 1,
                                      "var_update_max_interval": 32, "refresh_compressor": "int4",
                                      "var_refresh_decay": "elapsed"},
    "momentum-sign-01-k1-c16-r4": {"compressor": "sign", "target": "momentum", "var_update_scaler": 1,
                                   "var_update_max_interval": 16, "refresh_compressor": "int4"},
    # the clip norm as an all-reduced count sketch of the average (clip_norm "sketch") instead of
    # the root mean square of the ranks' own norms, which clips harder than dense AdamW
    "momentum-sign-01-k1-f64-sketch": {"compressor": "sign", "target": "momentum", "var_update_scaler": 1,
                                       "var_freeze_step": 64, "clip_norm": "sketch"},
    "momentum-fp32-01-k1-f64-sketch": {"compressor": "fp32", "target": "momentum", "var_update_scaler": 1,
                                       "var_freeze_step": 64, "clip_norm": "sketch"},
    "momentum-sign-01-k1-f256-sketch": {"compressor": "sign", "target": "momentum", "var_update_scaler": 1,
                                        "var_freeze_step": 256, "clip_norm": "sketch"},
    # and the frozen variance rescaled between its updates by the tracked level of the averaged
    # clipped gradient's squared norm (var_rescale, the sketched norm)
    "momentum-sign-01-k1-f64-rescale": {"compressor": "sign", "target": "momentum", "var_update_scaler": 1,
                                        "var_freeze_step": 64, "clip_norm": "sketch", "var_rescale": True},
    "momentum-fp32-01-k1-f64-rescale": {"compressor": "fp32", "target": "momentum", "var_update_scaler": 1,
                                        "var_freeze_step": 64, "clip_norm": "sketch", "var_rescale": True},
    # a factor per parameter tensor instead (var_rescale "tensor": each tensor's own sketched
    # squared norm, 32 entries a tensor in the same all-reduce), signs and uncompressed
    "momentum-sign-01-k1-f64-tensor": {"compressor": "sign", "target": "momentum", "var_update_scaler": 1,
                                       "var_freeze_step": 64, "clip_norm": "sketch", "var_rescale": "tensor"},
    "momentum-fp32-01-k1-f64-tensor": {"compressor": "fp32", "target": "momentum", "var_update_scaler": 1,
                                       "var_freeze_step": 64, "clip_norm": "sketch", "var_rescale": "tensor"},
    # kappa 1 frozen after 64: the schedule alone; sign with a scale every 32 entries (1 + 1 bit
    # an entry instead of 1 + 1/8); sign with the embedding and output head sent dense
    "momentum-fp32-01-k1-f64": {"compressor": "fp32", "target": "momentum", "var_update_scaler": 1,
                                "var_freeze_step": 64},
    # the control for one seed's spread: the uncompressed schedule in 1 MB chunks instead of one
    # 16 MB chunk, a rounding-only change (gloo's all-reduce then sums 22 % of the entries in
    # another order, measured on 4 ranks with the tiny model's 927k entries)
    "momentum-fp32-01-k1-f64-chunk1": {"compressor": "fp32", "target": "momentum", "var_update_scaler": 1,
                                       "var_freeze_step": 64, "chunk_mb": 1.0},
    "momentum-sign-01-k1-f64-b32": {"compressor": "sign", "target": "momentum", "var_update_scaler": 1,
                                    "var_freeze_step": 64, "block_size": 32},
    "momentum-sign-01-k1-f64-dense-emb": {"compressor": "sign", "target": "momentum", "var_update_scaler": 1,
                                          "var_freeze_step": 64,
                                          "dense_params": ["*embed_tokens.weight", "*lm_head.weight"]},
    # DGC's momentum correction: the momentum lives in the compressor, the optimizer runs without (--optimizer sgd)
    "topk-1%-dgc": {"compressor": "topk", "ratio": 0.01, "error_feedback": True, "momentum": 0.9},
}


def machine():
    """The CPU the run trained on (its floating-point results differ between CPUs: rows
    are compared only with the dense run of the same machine)."""
    fields = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        import platform
        return platform.processor() or platform.machine()
    return (f"{fields.get('model name', '?')} (family {fields.get('cpu family', '?')} model {fields.get('model', '?')}), "
            f"{os.cpu_count()} cores")


def run_one(name, comm, args, tmp):
    with open(os.path.join(ROOT, args.config)) as f:
        cfg = json.load(f)
    cfg["pipeline"] = {"stages": 1}
    cfg["train_micro_batch_size_per_gpu"] = args.micro_batch
    cfg["gradient_accumulation_steps"] = args.grad_accum
    cfg.pop("train_batch_size", None)
    if args.optimizer == "sgd":      # torch.optim.SGD through DeepSpeed's fallback to torch optimizers
        momentum = 0.0 if comm.get("momentum", 0) > 0 else 0.9
        cfg["optimizer"] = {"type": "SGD", "params": {"lr": args.lr, "momentum": momentum}}
    elif comm.get("momentum", 0) > 0:
        sys.exit(f"{name}: momentum correction replaces the optimizer's momentum; run it with --optimizer sgd")
    elif args.lr is not None:
        cfg["optimizer"]["params"]["lr"] = args.lr
    s = cfg["seekspeed"]
    s["data"]["seq_len"] = args.seq_len
    if args.seed is not None:
        s["train"]["seed"] = args.seed
    s["train"]["log_interval"] = max(1, args.steps // 5)
    warmup = args.momentum_warmup if comm.get("target") == "momentum" else args.warmup
    if "var_update_scaler" in comm:
        warmup = 0
    s["comm"] = {**comm, "warmup_steps": warmup, "min_numel": args.min_numel}
    path = os.path.join(tmp, f"{name}.json")
    with open(path, "w") as f:
        json.dump(cfg, f)
    summary = os.path.join(tmp, f"{name}-summary.json")
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu")
    cmd = [os.path.join(os.path.dirname(sys.executable), "deepspeed"), "--num_gpus", str(args.ranks),
           "--master_port", str(free_port()), os.path.join(ROOT, "launch", "train.py"), "--deepspeed", path,
           "--steps", str(args.steps), "--checkpoint-dir", os.path.join(tmp, f"ck-{name}"), "--summary-json",
           summary]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"{name} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return row_from_summary(name, comm, s["train"]["seed"], s["comm"]["warmup_steps"], summary)


def row_from_summary(name, comm, seed, warmup, summary):
    """The benchmark's row of one finished run, from the trainer's --summary-json."""
    with open(summary) as f:
        out = json.load(f)
    losses = out["losses"]
    tail = min(20, len(losses))
    row = {"name": name, "comm": comm, "seed": seed, "final_loss": statistics.mean(losses[-tail:]),
           "first_loss": losses[0], "losses": losses, "tokens_per_s": out.get("steady_tokens_per_s"),
           "warmup_steps": warmup if comm["compressor"] != "none" else 0, "machine": machine()}
    row["steps"] = len(losses)
    if "comm" in out:
        ranks = out["comm"]["per_rank_mean_per_step"]
        row["wire_mb_per_step"] = statistics.mean(r["wire_bytes"] for r in ranks) / 1e6
        # every step's bytes, the dense ones (warm-up, refreshes) through the same path included
        row["bytes_total"] = statistics.mean(r["wire_bytes"] for r in out["comm"]["per_rank_total"])
        row["compress_ms_per_step"] = statistics.mean(r["compress_s"] + r["decompress_s"] for r in ranks) * 1e3
        if comm.get("target") == "momentum":    # momentum steps clipped (M in fp32 after them) or kept as codes
            totals = out["comm"]["per_rank_total"][0]
            row["clipped_steps"], row["momentum_codes_steps"] = totals["clipped"], totals["momentum_codes"]
    return row


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="ds_configs/tiny_1rank.json")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--grad-accum", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--warmup", type=int, default=10, help="dense optimizer steps before compressing")
    p.add_argument("--momentum-warmup", type=int, default=60,
                   help="target momentum: dense AdamW steps before the variance is frozen")
    p.add_argument("--min-numel", type=int, default=4096, help="tensors smaller than this go dense")
    p.add_argument("--optimizer", choices=["config", "sgd"], default="config",
                   help="config: the config's AdamW; sgd: SGD with momentum 0.9 (DGC's setting)")
    p.add_argument("--lr", type=float, help="learning rate (default: the config's; required with sgd)")
    p.add_argument("--seed", type=int, help="training seed: weights and data order (default: the config's)")
    p.add_argument("--seeds", type=int, nargs="+", help="run every --runs once per seed (overrides --seed)")
    p.add_argument("--runs", nargs="+", default=["none", "topk-1%-ef", "topk-1%-no-ef", "powersgd-r4-ef", "int8-ef"],
                   choices=list(RUNS))
    p.add_argument("--json")
    p.add_argument("--append", action="store_true",
                   help="keep the rows already in --json that this run does not redo (same run, seed, step "
                        "count and machine), and compare against their dense rows where this run has none: one file for "
                        "several run lengths and runs")
    args = p.parse_args(argv)
    if args.optimizer == "sgd" and args.lr is None:
        p.error("--optimizer sgd needs --lr")
    before = None
    if args.append and args.json and os.path.exists(args.json):
        with open(args.json) as f:
            before = json.load(f)
        fixed = ("config", "ranks", "micro_batch", "grad_accum", "seq_len", "optimizer", "lr", "min_numel")
        differ = [k for k in fixed if before["args"].get(k) != getattr(args, k)]
        if differ:
            was = ", ".join(f"{k} {before['args'].get(k)}" for k in differ)
            p.error(f"--append: {args.json} was measured with other {', '.join(differ)} ({was}); use those, or "
                    f"another --json")
    seeds = args.seeds or [args.seed]
    dense_mb = _dense_mb(args)
    rows = []
    with tempfile.TemporaryDirectory(prefix="seekspeed-conv-") as tmp:
        todo = [(seed, name) for seed in seeds for name in args.runs]
        for i, (seed, name) in enumerate(todo):
            args.seed = seed
            print(f"[{i + 1}/{len(todo)}] {name} seed {seed}: {args.steps} steps on {args.ranks} ranks ...",
                  file=sys.stderr, flush=True)
            rows.append(run_one(f"{name}" if seed is None else f"{name}-s{seed}", RUNS[name], args, tmp) | {"run": name})
            if args.json:       # after every run: an interrupted benchmark keeps the runs it finished
                _write(args, before, _complete(rows, before, dense_mb))
    _complete(rows, before, dense_mb)
    opt = "the config's AdamW" if args.optimizer == "config" else f"SGD lr {args.lr} momentum 0.9"
    print(f"\ntiny recipe, {args.ranks} data-parallel ranks, {args.steps} steps, micro-batch {args.micro_batch} x "
          f"{args.grad_accum} accumulation x {args.seq_len} tokens, {opt}; final loss = mean of the last 20 steps; "
          f"bytes: sent per rank per step after the warm-up (dense fp32 ring: {dense_mb:.3f} MB)")
    print(f"{'run':<24} {'seed':>4} {'final loss':>10} {'vs dense':>9} {'MB sent/step':>12} {'x fewer':>7} "
          f"{'run avg MB':>10} {'run x fewer':>11} {'compress ms':>11}")
    for r in rows:
        rel, sent = r["vs_dense_pct"], r["bytes_per_step"] / 1e6
        ms = f"{r['compress_ms_per_step']:.1f}" if "compress_ms_per_step" in r else "-"
        print(f"{r['run']:<24} {str(r['seed']):>4} {r['final_loss']:10.4f} {rel:+8.2f}% {sent:12.3f} "
              f"{dense_mb / sent:7.1f} {r['run_bytes_per_step'] / 1e6:10.3f} "
              f"{r['dense_bytes_total'] / r['bytes_total']:11.1f} {ms:>11}")
    if len(seeds) > 1:
        print(f"\n{'run':<24} {'mean vs dense':>13} {'min':>8} {'max':>8}  over seeds {seeds}")
        for name in args.runs:
            rel = [r["vs_dense_pct"] for r in rows if r["run"] == name]
            print(f"{name:<24} {statistics.mean(rel):+12.2f}% {min(rel):+7.2f}% {max(rel):+7.2f}%")
    if args.json:
        _write(args, before, rows)
    return rows


def _complete(rows, before, dense_mb):
    """Each row's comparison with the dense run of its seed, steps and machine (in
    ``rows`` or, --append, in the file's earlier rows) and its bytes against DeepSpeed's
    dense fp32 ring (``dense_mb`` a step); recomputed whole, as a later run may be the
    dense one."""
    earlier = before["rows"] if before else []
    for r in rows:
        dense = next((d for d in rows + earlier if d["run"] == "none" and _same_run(d, r)), None)
        r["dense_final_loss"] = dense["final_loss"] if dense else None
        r["vs_dense_pct"] = (r["final_loss"] / dense["final_loss"] - 1) * 100 if dense else float("nan")
        r["dense_bytes_per_step"] = dense_mb * 1e6
        r["bytes_per_step"] = r.get("wire_mb_per_step", dense_mb) * 1e6     # DeepSpeed's own: the ring's bytes
        r["dense_bytes_total"] = dense_mb * 1e6 * r["steps"]
        r.setdefault("bytes_total", r["dense_bytes_total"])      # DeepSpeed's own reduction: the ring's
        r["run_bytes_per_step"] = r["bytes_total"] / r["steps"]
    return rows


def _write(args, before, rows):
    """--json: this run's rows, after the file's earlier ones that it does not redo (--append)."""
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    out = {"args": vars(args), "rows": rows}
    if before:
        redone = {_row_key(r) for r in rows}
        kept = [r for r in before["rows"] if _row_key(r) not in redone]
        out = {"args": vars(args), "earlier_args": before.get("earlier_args", []) + [before["args"]],
               "rows": kept + rows}
    with open(args.json, "w") as f:
        json.dump(out, f, indent=2)


def _row_key(row):
    """What --append replaces: the same run, seed, step count and machine."""
    return row["run"], row["seed"], row["steps"], row.get("machine")


def _same_run(dense, row):
    """``dense`` is ``row``'s reference: the same seed and steps, trained on the same machine."""
    return _row_key(dense)[1:] == _row_key(row)[1:]


def _dense_mb(args):
    """What DeepSpeed's dense fp32 reduction sends per rank per step: a ring all-reduce
    of every parameter's gradient, 2 (W-1)/W x 4 bytes each (one stage: all of them)."""
    from recipes import deepseek_v3
    from ds_ext.pipe.partition import count_parameters
    with open(os.path.join(ROOT, args.config)) as f:
        recipe = json.load(f)["seekspeed"]["recipe"]
    config = deepseek_v3.make_config(recipe.get("preset", "tiny"), recipe.get("overrides"))
    numel = sum(count_parameters(spec) for spec in deepseek_v3.layer_specs(config, seed=0))
    return 2 * (args.ranks - 1) / args.ranks * 4 * numel / 1e6

if __name__ == "__main__":
    main()

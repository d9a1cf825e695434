"""How far dense AdamW's second moment moves over a run: what a variance frozen early misses.

0/1 Adam's schedule (seekspeed.comm.var_update_scaler) freezes Adam's variance v after its
last refresh. This reads the optimizer state of one dense run's DeepSpeed checkpoints
(``seekspeed.checkpoint.engine: "deepspeed"``, ZeRO 0, one pipeline stage) at two or more
steps and prints, against the first step given: the bias-corrected v summed over every
element (what ``var_rescale``'s one factor follows), per parameter tensor the same level
(what a factor per tensor would follow), and per element the spread of log(v_later / v_first)
left after each of those factors (the shape neither can follow: 0 would mean the frozen v
is right up to the factor). --json writes the figures.

    python benchmarks/variance_drift.py --checkpoints /tmp/vdiag/ck --steps 64 1000 \\
        --json benchmarks/results/variance_drift.json

The dense run is the convergence benchmark's (``compression_convergence.py --ranks 4``: the
tiny recipe, micro-batch 4 x 4 accumulation x 128 tokens) with checkpoints every 64 steps:
``launch/train.py --deepspeed CONFIG --steps 1000 --checkpoint-dir DIR`` on 4 ranks, CONFIG
ds_configs/tiny_1rank.json with those batch settings, ``train.seed`` and
``checkpoint: {"interval_steps": 64, "engine": "deepspeed"}``.
"""

import argparse
import glob
import json
import math
import os
import statistics

import torch


def load_variance(ckdir, step):
    """{parameter name: bias-corrected v} of the checkpoint of ``step``."""
    path = os.path.join(ckdir, f"global_step{step}", "mp_rank_00_model_states.pt")
    if not os.path.exists(path):
        raise SystemExit(f"{path} not found: --checkpoints must hold a DeepSpeed-engine checkpoint of step {step} "
                         f"(seekspeed.checkpoint.engine \"deepspeed\", interval dividing the step)")
    sd = torch.load(path, map_location="cpu", weights_only=False)
    opt = sd["optimizer"]
    # the pipeline engine saves each layer's weights in its own file, in the optimizer's order
    names = []
    for layer in sorted(glob.glob(os.path.join(ckdir, f"global_step{step}", "layer_*-model_states.pt"))):
        prefix = os.path.basename(layer).split("-")[0]
        names += [f"{prefix}.{name}" for name in torch.load(layer, map_location="cpu", weights_only=False)]
    ids = [i for group in opt["param_groups"] for i in group["params"]]
    if len(names) != len(ids):
        raise SystemExit(f"{path}: {len(names)} parameter names for {len(ids)} optimizer entries: ZeRO 0 and one "
                         f"stage only")
    beta2 = opt["param_groups"][0]["betas"][1]
    out = {}
    for name, i in zip(names, ids):
        st = opt["state"][i]
        # the optimizer's own count where it keeps one; DeepSpeed's CPU Adam leaves it 0 in the
        # state, and a dense run's optimizer has stepped every global step
        t = float(st["step"]) or float(sd["global_steps"])
        out[name] = st["exp_avg_sq"].double() / (1.0 - beta2 ** t)
    return out


def spread(log_ratio):
    """Quantiles of per-element log ratios: the 10th, 50th and 90th percentiles' exp."""
    q = torch.quantile(log_ratio, torch.tensor([0.1, 0.5, 0.9], dtype=torch.float64))
    return [math.exp(float(x)) for x in q]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoints", required=True, help="the dense run's checkpoint directory")
    p.add_argument("--steps", type=int, nargs="+", required=True, help="steps to compare, the first the reference")
    p.add_argument("--json")
    args = p.parse_args(argv)
    first, *later = args.steps
    ref = load_variance(args.checkpoints, first)
    rows = []
    tiny = 1e-30
    for step in later:
        now = load_variance(args.checkpoints, step)
        total = sum(float(v.sum()) for v in now.values()) / sum(float(v.sum()) for v in ref.values())
        logs, per_tensor, tensor_logs = [], {}, []
        for name, v0 in ref.items():
            v1 = now[name]
            lr = (v1 + tiny).log() - (v0 + tiny).log()
            level = float(v1.sum()) / max(float(v0.sum()), tiny)
            per_tensor[name] = level
            logs.append(lr.reshape(-1))
            tensor_logs.append(lr.reshape(-1) - math.log(max(level, tiny)))
        logs = torch.cat(logs)
        after_global = spread(logs - math.log(total))
        after_tensor = spread(torch.cat(tensor_logs))
        levels = sorted(per_tensor.values())
        row = {"step": step, "reference_step": first, "global_level": total,
               "tensor_level_min": levels[0], "tensor_level_median": statistics.median(levels),
               "tensor_level_max": levels[-1], "element_ratio_p10_p50_p90": spread(logs),
               "after_global_factor_p10_p50_p90": after_global, "after_tensor_factor_p10_p50_p90": after_tensor,
               "tensor_levels": per_tensor}
        rows.append(row)
        print(f"v at step {step} against step {first} (bias-corrected; ratios later / first)")
        print(f"  summed over every element (var_rescale's factor): {total:.3f}")
        print(f"  per tensor: min {levels[0]:.3f}, median {statistics.median(levels):.3f}, max {levels[-1]:.3f} "
              f"over {len(levels)} tensors")
        print(f"  {'per element':<34} {'p10':>7} {'p50':>7} {'p90':>7}")
        for label, q in (("as frozen", spread(logs)), ("after the one factor", after_global),
                         ("after a factor per tensor", after_tensor)):
            print(f"  {label:<34} {q[0]:7.3f} {q[1]:7.3f} {q[2]:7.3f}")
        top = sorted(per_tensor.items(), key=lambda kv: kv[1])
        print("  tensors furthest from the summed level:")
        for name, level in top[:3] + top[-3:]:
            print(f"    {name:<52} {level:7.3f}")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=2)
    return rows


if __name__ == "__main__":
    main()

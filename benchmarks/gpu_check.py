"""The checks the CPU machines cannot make, in one command on one CUDA GPU (at most
about 8 minutes; each part has its own time limit):

    python benchmarks/gpu_check.py --json benchmarks/results/gpu_check.json

1 tiny       ds_configs/tiny_1rank.json in bf16 (ZeRO-1, fp32 gradient accumulation, as
             the production configs), a few steps through launch/train.py's trainer
             (DeepSpeed's pipeline engine), one rank, NCCL.
2 v2-lite    the deepseek-v2-lite preset cut to 2 decoder layers (the preset's
             first_k_dense_replace 1: layer 0 dense, layer 1 MoE with 64 routed and 2
             shared experts), seq 512, micro-batch 1 x 2 accumulation, bf16, same path.
3 planner    ds_ext/planner/'s memory for that run (1 node x 1 GPU, StageMemory)
             against torch.cuda.max_memory_allocated() after it.
4 checkpoint the async-zstd engine's blocking time (the snapshot into host buffers, pinned
             when the tensors are on CUDA, reused from the second save on) against
             DeepSpeed's torch.save engine, on benchmarks/checkpoint_engine.py's model
             moved to the GPU; the share of snapshot bytes in pinned memory is observed.
5 decode     MLA latent-KV greedy decoding against transformers' DeepseekV3ForCausalLM
             (same random weights, fp32, CUDA, batch 1): logits difference, tokens equal,
             milliseconds per token.

Each part runs in its own process (a fresh CUDA context, its own peak memory, a crash
or out-of-memory in one does not stop the others). Nothing is downloaded: the data is
the stdlib demo corpus (seekspeed.data.source "stdlib", byte tokenizer), the models are
random-init. Exits 2 with one line when CUDA is unavailable, 1 when a part fails.
"""

import argparse
import json
import logging
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

GB = 1e9

# The training runs: changes to ds_configs/tiny_1rank.json (dotted keys). bf16 as the
# production configs train (DeepSpeed's BF16_Optimizer: ZeRO-1, fp32 accumulation).
BF16 = {"bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "fp32"}, "zero_optimization": {"stage": 1}}
RUNS = {
    "tiny": {**BF16, "seekspeed.train.steps": 6, "seekspeed.train.log_interval": 1},
    "v2-lite": {**BF16, "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 2,
                "seekspeed.recipe.preset": "deepseek-v2-lite",
                "seekspeed.recipe.overrides": {"num_hidden_layers": 2},
                "seekspeed.data.seq_len": 512, "seekspeed.train.steps": 4, "seekspeed.train.log_interval": 1},
}
# per part (each its own process): wall-clock limit (s); together under 8 minutes
LIMITS = {"device": 40, "tiny": 90, "v2-lite": 150, "checkpoint": 90, "decode": 95}
DECODE = {"prompt": 128, "new": 32, "repeats": 3}
CHECKPOINT = ["--layers", "4", "--width", "4096", "--batch", "16", "--repeats", "3", "--steps-after", "4",
              "--threads", "1"]


class PartError(Exception):
    """A part could not produce its figures; the message is its table cell."""


# ---- CPU side: configs and the table ------------------------------------------------

def run_config(name, *, workdir):
    """The DeepSpeed JSON for training run ``name``: ds_configs/tiny_1rank.json with
    RUNS[name] applied, checkpoints off (none of these runs writes one)."""
    with open(os.path.join(ROOT, "ds_configs", "tiny_1rank.json")) as f:
        cfg = json.load(f)
    changes = {**RUNS[name], "seekspeed.checkpoint": {"dir": os.path.join(workdir, f"{name}-ckpt"),
                                                      "interval_steps": 0, "save_final": False}}
    for dotted, value in changes.items():
        node, (*parents, leaf) = cfg, dotted.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return cfg


def write_run_config(name, *, workdir):
    path = os.path.join(workdir, f"{name}.json")
    with open(path, "w") as f:
        json.dump(run_config(name, workdir=workdir), f, indent=2)
    return path


def _gb(x):
    return f"{x / GB:.2f} GB"


def describe(part, r):
    """One table cell: the figures of ``part`` (its result dict)."""
    if part in ("tiny", "v2-lite"):
        return (f"{r['steps']} steps, loss {r['loss_first']:.3f} -> {r['loss_last']:.3f}, "
                f"{r['steady_tokens_per_s']:,.0f} tok/s after step 1, peak {_gb(r['max_memory_allocated'])} allocated "
                f"({_gb(r['max_memory_reserved'])} reserved)")
    if part == "planner":
        p = r["planned"]
        return (f"planned {_gb(p['total'])} (weights {_gb(p['weights'])}, grads {_gb(p['gradients'])}, optimizer "
                f"{_gb(p['optimizer'])}, activations {_gb(p['activations_counted'])}, buffers {_gb(p['buffers'])}); "
                f"measured peak {_gb(r['measured'])}: {r['measured_over_planned']:.3f}x")
    if part == "checkpoint":
        pinned = (f"{r['pinned_fraction']:.0%} of the {_gb(r['snapshot_buffer_bytes'])} snapshot buffers pinned"
                  if r["snapshot_buffer_bytes"] else "no snapshot buffers (no pinned-buffer path taken)")
        return (f"async-zstd blocks {r['async_first_blocking_s']:.3f} s on the first save (allocates the buffers), "
                f"{r['async_reused_blocking_s']:.3f} s reused (snapshot {r['async_reused_snapshot_s']:.3f} s); "
                f"DeepSpeed torch.save {r['deepspeed_blocking_s']:.3f} s ({r['deepspeed_over_async']:.1f}x); "
                f"{pinned}; {_gb(r['state_bytes'])} of state")
    if part == "decode":
        return (f"prefill max|dlogit| {r['prefill_max_abs_diff']:.2e} (|logit| <= {r['prefill_max_abs_logit']:.2f}), "
                f"decode {r['decode_max_abs_diff']:.2e} over {r['compared_steps']} steps; tokens "
                f"{r['tokens_equal']}/{r['new']} equal (smallest top-2 margin {r['min_margin']:.2e}); "
                f"{r['ms_per_token_latent']:.2f} ms/token latent vs {r['ms_per_token_transformers']:.2f} transformers "
                f"(latent {r['ms_per_token_transformers'] / r['ms_per_token_latent']:.2f}x as fast)")
    raise AssertionError(part)


TITLES = {"tiny": "1 tiny, bf16, 1 rank", "v2-lite": "2 v2-lite 2 layers, bf16", "planner": "3 planner vs measured",
          "checkpoint": "4 async checkpoint", "decode": "5 latent-KV decode"}


def table(device_line, results):
    """The human table: one row per part, ``results[part]`` = {"status", "figures"
    or "error"}."""
    width = max(len(t) for t in TITLES.values())
    lines = [device_line, "", f"{'part':<{width}}  {'status':<8}  figures"]
    for part, title in TITLES.items():
        r = results.get(part)
        if r is None:
            lines.append(f"{title:<{width}}  {'not run':<8}")
            continue
        cell = describe(part, r["figures"]) if "figures" in r else r["error"]
        lines.append(f"{title:<{width}}  {r['status']:<8}  {cell}")
    return "\n".join(lines)


# ---- GPU side: one part per process -----------------------------------------------------

def _device():
    import torch
    props = torch.cuda.get_device_properties(0)
    return {"name": props.name, "memory_bytes": props.total_memory, "torch": torch.__version__,
            "cuda": torch.version.cuda, "capability": f"{props.major}.{props.minor}"}


def part_train(name, workdir):
    import torch

    from ds_ext.trainer import main as train
    config = write_run_config(name, workdir=workdir)
    summary_path = os.path.join(workdir, f"{name}.summary.json")
    torch.cuda.reset_peak_memory_stats()
    rc = train(["--deepspeed", config, "--summary-json", summary_path])
    if rc != 0:
        raise PartError(f"the trainer exited {rc} (its error is in the part's log)")
    with open(summary_path) as f:
        summary = json.load(f)
    losses = summary["losses"]
    if not losses or not all(math.isfinite(x) for x in losses):
        raise PartError(f"losses not finite: {losses}")
    return {"config": config, "steps": summary["steps"], "losses": losses, "loss_first": losses[0],
            "loss_last": losses[-1], "steady_tokens_per_s": summary["steady_tokens_per_s"],
            "max_memory_allocated": torch.cuda.max_memory_allocated(),
            "max_memory_reserved": torch.cuda.max_memory_reserved(), "layout": summary.get("layout")}


def part_checkpoint(workdir):
    import torch
    import torch.distributed as tdist

    from benchmarks import checkpoint_engine as bench
    from ds_ext.checkpoint.engine import AsyncCheckpointEngine
    from ds_ext.config import CheckpointSection
    from ds_ext.distributed import free_port, init_distributed
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    torch.cuda.set_device(0)
    init_distributed()
    args = bench.parse_args(CHECKPOINT)
    engine = bench._build(args)
    weights = next(engine.module.parameters())
    if not weights.is_cuda:
        raise PartError(f"the engine's parameters are on {weights.device}, not CUDA")
    # the engine's agreement rounds are CPU collectives: a gloo group, as ds_ext.checkpoint.engine.install makes
    async_engine = AsyncCheckpointEngine(CheckpointSection(dir="unused", engine="async-zstd",
                                                           zstd_level=args.zstd_level),
                                         group=tdist.new_group(backend="gloo"), log=lambda m: None)
    engines = {"deepspeed": engine.checkpoint_engine, "async-zstd": async_engine}
    rows, noise = bench.measure_saves(engine, engines, bench._batches(args), args, workdir, args.threads[0])
    buffers = list(async_engine._pool._buffers.values())
    buffer_bytes = sum(b.numel() * b.element_size() for b in buffers)
    pinned_bytes = sum(b.numel() * b.element_size() for b in buffers if b.is_pinned())
    saves = [r for r in rows if r["engine"] == "async-zstd"]
    snapshots = [h["snapshot_s"] for h in async_engine.history if h.get("status") == "committed"]
    ds = statistics.median(r["blocking_s"] for r in rows if r["engine"] == "deepspeed")
    reused = statistics.median(r["blocking_s"] for r in saves[1:])
    params = sum(p.numel() for p in engine.module.parameters())
    return {"saves": rows, "noise": noise, "async_first_blocking_s": saves[0]["blocking_s"],
            "async_reused_blocking_s": reused, "async_snapshot_s": snapshots,
            "async_reused_snapshot_s": statistics.median(snapshots[1:]), "deepspeed_blocking_s": ds,
            "deepspeed_over_async": ds / reused, "snapshot_buffer_bytes": buffer_bytes,
            "pinned_bytes": pinned_bytes, "pinned_fraction": pinned_bytes / buffer_bytes if buffer_bytes else 0.0,
            "parameters": params, "state_bytes": 16 * params, "argv": CHECKPOINT}


def part_decode():
    import torch
    from transformers import DeepseekV3ForCausalLM

    from benchmarks.latent_kv_decode import SHAPES
    from recipes import deepseek_v3
    from recipes.layers.hf import copy_into_transformers
    from recipes.layers.latent_kv import LatentKVCache, MLADecoder
    from recipes.layers.reference import SequentialReference
    torch.backends.cuda.matmul.allow_tf32 = False          # fp32 both sides, no TF32 rounding
    torch.manual_seed(0)
    preset, overrides = SHAPES["v2-lite-layers"]
    config = deepseek_v3.make_config(preset, overrides)
    model = SequentialReference(deepseek_v3.layer_specs(config, seed=1)).eval()   # seeded on the CPU
    with torch.device("cuda"):                            # transformers' own init, on the GPU: faster
        hf = DeepseekV3ForCausalLM(config.to_hf_config()).eval()
    copy_into_transformers(hf, model.state_dict(), config)
    model = model.cuda()
    decoder = MLADecoder(model, config)
    prompt = torch.randint(0, config.vocab_size, (1, DECODE["prompt"]), device="cuda")
    new = DECODE["new"]

    @torch.no_grad()
    def ours():
        cache = LatentKVCache(config, batch=1, max_tokens=prompt.shape[1] + new, dtype=torch.float32, device="cuda")
        steps = [decoder.forward_cached(prompt, cache)[:, -1]]
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(new):
            steps.append(decoder.forward_cached(steps[-1].argmax(-1, keepdim=True), cache)[:, -1])
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) / new, steps

    @torch.no_grad()
    def theirs():
        out = hf(input_ids=prompt, use_cache=True)
        cache, steps = out.cache, [out.logits[:, -1]]
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(new):
            out = hf(input_ids=steps[-1].argmax(-1, keepdim=True), cache=cache, use_cache=True)
            cache = out.cache
            steps.append(out.logits[:, -1])
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) / new, steps

    ours(), theirs()                                      # warm-up: kernels, allocator
    times_ours, times_theirs = [], []
    for _ in range(DECODE["repeats"]):                    # interleaved, so drift hits both
        t, a = ours()
        times_ours.append(t)
        t, b = theirs()
        times_theirs.append(t)
    tokens_a = [s.argmax(-1).item() for s in a[:-1]]       # the tokens each side fed back
    tokens_b = [s.argmax(-1).item() for s in b[:-1]]
    equal = next((i for i, (x, y) in enumerate(zip(tokens_a, tokens_b)) if x != y), new)
    # logits are comparable while both sides have fed back the same tokens
    diffs = [(x - y).abs().max().item() for x, y in zip(a[:equal + 1], b[:equal + 1])]
    margins = [s.topk(2, dim=-1).values.diff(dim=-1).abs().min().item() for s in a[:-1]]
    return {"preset": preset, "overrides": overrides, "layers": config.num_hidden_layers, "batch": 1,
            "dtype": "float32", **DECODE, "tokens_equal": equal, "compared_steps": len(diffs) - 1,
            "prefill_max_abs_diff": diffs[0], "prefill_max_abs_logit": a[0].abs().max().item(),
            "decode_max_abs_diff": max(diffs[1:], default=0.0), "min_margin": min(margins),
            "ms_per_token_latent": statistics.median(times_ours) * 1e3,
            "ms_per_token_transformers": statistics.median(times_theirs) * 1e3,
            "runs_ms_latent": [t * 1e3 for t in times_ours], "runs_ms_transformers": [t * 1e3 for t in times_theirs]}


def run_part(part, workdir):
    """Inside the part's own process."""
    if part == "device":
        return _device()
    if part in RUNS:
        return part_train(part, workdir)
    if part == "checkpoint":
        return part_checkpoint(workdir)
    if part == "decode":
        return part_decode()
    raise AssertionError(part)


def spawn(part, *, workdir, limit):
    """Run ``part`` in a child process; {"status", "figures" | "error", "log"}."""
    out, log = os.path.join(workdir, f"{part}.result.json"), os.path.join(workdir, f"{part}.log")
    env = dict(os.environ, DS_ACCELERATOR="cuda", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)                     # each part is a one-rank world of its own
    start = time.perf_counter()
    with open(log, "w") as f:
        try:
            proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--part", part, "--workdir", workdir,
                                   "--out", out], cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT,
                                  timeout=limit, check=False)
            rc = proc.returncode
        except subprocess.TimeoutExpired:
            rc = None
    took = time.perf_counter() - start
    if rc is None:
        return {"status": "timeout", "error": f"stopped after its {limit} s limit (log: {log})", "seconds": took}
    if rc == 0 and os.path.exists(out):
        with open(out) as f:
            return {"status": "ok", "figures": json.load(f), "seconds": took, "log": log}
    with open(log, errors="replace") as f:
        tail = [line.strip() for line in f if line.strip()]
    reason = next((line for line in reversed(tail) if line.startswith(("error", "PartError", "RuntimeError",
                                                                       "torch.OutOfMemoryError", "ValueError"))),
                  tail[-1] if tail else "no output")
    return {"status": "failed", "error": f"exit {rc}: {reason[:300]} (log: {log})", "seconds": took}


def planner_figures(config_path, measured):
    """The planner's StageMemory for ``config_path`` on 1 node x 1 GPU, and its ratio to
    ``measured`` bytes (None: no run to compare)."""
    from ds_ext.planner import make_plan
    plan = make_plan(config_path, nodes=1, ranks_per_node=1)
    stage = plan.stages[0].to_json()
    stage["activations_counted"] = stage["activations_checkpointed"] if stage["checkpointing"] else stage["activations"]
    out = {"planned": stage, "config": config_path}
    return out if measured is None else compare(out, measured)


def compare(plan, measured):
    return plan | {"measured": measured, "measured_over_planned": measured / plan["planned"]["total"]}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", metavar="PATH", help="write the figures here")
    p.add_argument("--workdir", help="configs, logs and per-part results (default: a temporary directory, kept "
                                     "when a part fails)")
    p.add_argument("--part", choices=list(LIMITS), help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    import torch
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device (torch.cuda.is_available() is False): run it on a machine with an NVIDIA "
              "GPU", file=sys.stderr, flush=True)
        return 2
    if args.part:                                         # a child: one part, its result as JSON
        try:
            result = run_part(args.part, args.workdir)
        except PartError as exc:
            print(f"PartError: {exc}", flush=True)
            return 1
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
        return 0

    from benchmarks import write_figures
    os.environ["DS_ACCELERATOR"] = "cpu"      # this process plans on the meta device only; the parts get "cuda"
    workdir = args.workdir or tempfile.mkdtemp(prefix="seekspeed-gpu-check-")
    os.makedirs(workdir, exist_ok=True)
    probe = spawn("device", workdir=workdir, limit=LIMITS["device"])   # no CUDA context in this process
    if probe["status"] != "ok":
        print(f"gpu_check: cannot query the GPU: {probe['error']}", file=sys.stderr, flush=True)
        return 1
    device = probe["figures"]
    device_line = (f"gpu_check: {device['name']} ({device['memory_bytes'] / GB:.1f} GB, compute {device['capability']}), "
                   f"torch {device['torch']}, CUDA {device['cuda']}")
    print(device_line, flush=True)
    results = {}
    print(f"tiny: running (limit {LIMITS['tiny']} s) ...", flush=True)
    results["tiny"] = spawn("tiny", workdir=workdir, limit=LIMITS["tiny"])
    config = write_run_config("v2-lite", workdir=workdir)
    plan = planner_figures(config, None)                      # first: skip a run that cannot fit
    planned = plan["planned"]
    if planned["total"] > device["memory_bytes"]:
        results["v2-lite"] = {"status": "skipped", "error": f"the planner puts it at {_gb(planned['total'])}, over "
                                                            f"this GPU's {_gb(device['memory_bytes'])}"}
    else:
        print(f"v2-lite: running (limit {LIMITS['v2-lite']} s) ...", flush=True)
        results["v2-lite"] = spawn("v2-lite", workdir=workdir, limit=LIMITS["v2-lite"])
    if results["v2-lite"]["status"] == "ok":
        results["planner"] = {"status": "ok", "figures": compare(plan, results["v2-lite"]["figures"][
            "max_memory_allocated"])}
    else:
        results["planner"] = {"status": "failed", "error": "no measured run to compare (part 2 did not finish)"}
    for part in ("checkpoint", "decode"):
        print(f"{part}: running (limit {LIMITS[part]} s) ...", flush=True)
        results[part] = spawn(part, workdir=workdir, limit=LIMITS[part])
    decode = results["decode"]
    if decode["status"] == "ok" and decode["figures"]["tokens_equal"] < decode["figures"]["new"]:
        decode["status"] = "differs"      # see the smallest top-2 margin against the logits difference
    print()
    print(table(device_line, results), flush=True)
    write_figures(args.json, {"device": device, "runs": RUNS, "limits_s": LIMITS, "results": results})
    ok = all(r["status"] == "ok" for r in results.values())
    if ok and not args.workdir:
        shutil.rmtree(workdir, ignore_errors=True)
    elif not ok:
        print(f"logs and configs: {workdir}", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

"""tokens/s and peak RSS per rank for the tiny recipe at 4 ranks, side by side:

  1f1b       seekspeed pipeline, 2 stages x 2 replicas, DeepSpeed's 1F1B
  dualpipev  seekspeed pipeline, 2 stages x 2 replicas, DeepSpeed's DualPipeV
  hf-dp      what a user would otherwise run: transformers' DeepseekV3ForCausalLM of
             the same config, plain DeepSpeed data parallelism (ZeRO-1, 4 replicas)

``--preset tiny-moe``: the MoE recipe (ds_configs/tiny_moe_cpu.json) with expert
parallelism 2 under 1f1b and dualpipev-zb (overlap "layer", the default there)
against the same hf-dp baseline (transformers' model holds every expert on every
rank). Bias updates and the sequence balance loss are off in all three, since
transformers' model has neither; the rest of the config is the JSON's.

Same tokens per optimizer step (the JSON's train_batch_size x seq_len), same initial
weights (the recipe's seeded init, copied into the transformers model), the same
micro-batches in every step (each hf-dp rank takes its share of one pipeline
replica's micro-batches), same optimizer and scheduler (all from
ds_configs/tiny_cpu.json), so the losses are comparable too. Runs are interleaved
(a, b, c, a, b, c, ...) and each figure is the median over repeats; ratios are
against hf-dp. Every run goes through the real deepspeed launcher.

    python benchmarks/tiny_throughput.py --steps 40 --repeats 3 --json bench_out/tiny.json
    python benchmarks/tiny_throughput.py --preset tiny-moe --steps 40 --repeats 3 --json bench_out/tiny_moe.json
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

RUNS = {
    "1f1b": ["launch/train.py", "--deepspeed", "ds_configs/tiny_cpu.json"],
    "dualpipev": ["launch/train.py", "--deepspeed", "ds_configs/tiny_dualpipev_cpu.json"],
    "hf-dp": ["benchmarks/tiny_throughput.py", "--worker", "hf-dp", "--config", "ds_configs/tiny_cpu.json"],
}
WORLD = 4
MOE_EP = 2


def _moe_runs(workdir):
    """The tiny-moe runs: configs derived from ds_configs/tiny_moe_cpu.json."""
    with open(os.path.join(ROOT, "ds_configs", "tiny_moe_cpu.json")) as f:
        base = json.load(f)
    base["seekspeed"]["moe"] = {"bias_update_speed": 0.0, "balance_loss_alpha": 0.0, "expert_parallel_size": MOE_EP}
    runs = {}
    for name, schedule in (("1f1b-ep2", "1f1b"), ("dualpipev-zb-ep2", "dualpipev-zb")):
        cfg = json.loads(json.dumps(base))
        cfg["seekspeed"]["schedule"] = schedule
        path = os.path.join(workdir, f"{name}.json")
        with open(path, "w") as f:
            json.dump(cfg, f)
        runs[name] = ["launch/train.py", "--deepspeed", path]
    runs["hf-dp"] = ["benchmarks/tiny_throughput.py", "--worker", "hf-dp", "--config", runs["1f1b-ep2"][2]]
    return runs


def _launch(runs, name, steps, workdir):
    summary = os.path.join(workdir, f"{name}-{len(os.listdir(workdir))}.json")
    args = [*runs[name], "--steps", str(steps)]
    if name != "hf-dp":
        args += ["--checkpoint-dir", os.path.join(workdir, f"ckpt-{os.path.basename(summary)}")]
    return launch(args, world=WORLD, summary_json=summary, what=name)


def _hf_worker(args):
    """One rank of the transformers + DeepSpeed data-parallel baseline."""
    import torch
    import deepspeed
    from deepspeed import comm as dist
    from transformers import DeepseekV3ForCausalLM
    from ds_ext.config import load_config
    from ds_ext.data import PackedBatches, load_tokenizer, packed_sequences
    from ds_ext.progress import Progress, peak_rss_mib
    from recipes import deepseek_v3
    from recipes.layers.hf import copy_into_transformers
    from recipes.layers.pipe import causal_lm_loss
    from recipes.layers.reference import SequentialReference

    world = int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    from ds_ext.distributed import init_distributed
    init_distributed("gloo")
    cfg = load_config(args.config, world_size=world, overrides={"train.steps": args.steps})
    s, lay = cfg.section, cfg.layout
    ds = {k: v for k, v in cfg.ds.items() if k not in ("seekspeed", "pipeline", "gradient_accumulation_steps")}
    ds["train_batch_size"] = lay.train_batch           # same tokens per step, now over `world` replicas
    ds["gradient_accumulation_steps"] = lay.train_batch // (lay.micro_batch * world)
    ds["steps_per_print"] = 10**9
    model_cfg = deepseek_v3.make_config(s.recipe.preset, s.recipe.overrides)
    torch.manual_seed(s.train.seed)
    model = DeepseekV3ForCausalLM(model_cfg.to_hf_config())
    recipe_init = SequentialReference(deepseek_v3.layer_specs(model_cfg, seed=s.train.seed)).state_dict()
    copy_into_transformers(model, recipe_init, model_cfg)
    engine, *_ = deepspeed.initialize(model=model, config=ds, model_parameters=model.parameters())
    rank = dist.get_rank()
    # pipeline replica r's micro-batches m = 0..gas-1 of each step are split over the
    # `stride` hf-dp ranks that stand in for it: rank r*stride+o takes m = o, o+stride, ...
    stride = world // lay.data_parallel
    if world % lay.data_parallel or lay.grad_accum % stride:
        sys.exit(f"hf-dp needs {world} ranks to split {lay.data_parallel} replicas x {lay.grad_accum} micro-batches evenly")
    replica, offset = divmod(rank, stride)
    rows = packed_sequences(s.data, load_tokenizer(s.data.tokenizer, vocab_size=model_cfg.vocab_size),
                            vocab_size=model_cfg.vocab_size, shard=replica, num_shards=lay.data_parallel)
    stream = PackedBatches(rows, micro_batch=lay.micro_batch, seed=s.train.seed)

    def micro_batch(step, m):
        stream.position = (step - 1) * lay.grad_accum + m * stride + offset
        return next(stream)
    progress = Progress(start_step=0, total_steps=args.steps, tokens_per_step=lay.tokens_per_step,
                        log_interval=s.train.log_interval, enabled=rank == 0)
    gas = engine.gradient_accumulation_steps()
    for step in range(1, args.steps + 1):
        total = torch.zeros(())
        for m in range(gas):
            x, y = micro_batch(step, m)
            loss = causal_lm_loss(engine(input_ids=x).logits, y)
            engine.backward(loss)
            engine.step()
            total += loss.detach() / gas
        dist.all_reduce(total)
        progress.update(step, total.item() / world, lr=engine.get_lr()[0])
    summary = progress.summary()
    rss = torch.tensor([peak_rss_mib()], dtype=torch.float64)
    gathered = [torch.zeros_like(rss) for _ in range(world)]
    dist.all_gather(gathered, rss)
    summary["peak_rss_mib"] = [float(t.item()) for t in gathered]
    if rank == 0:
        with open(args.summary_json, "w") as f:
            json.dump(summary, f)
    dist.barrier()


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=("tiny", "tiny-moe"), default="tiny")
    p.add_argument("--steps", type=int, default=40, help="optimizer steps per run")
    p.add_argument("--repeats", type=int, default=3, help="interleaved repeats of each configuration")
    p.add_argument("--json", help="write the figures here")
    p.add_argument("--worker", choices=["hf-dp"], help=argparse.SUPPRESS)
    p.add_argument("--config", help=argparse.SUPPRESS)
    p.add_argument("--summary-json", help=argparse.SUPPRESS)
    p.add_argument("--local_rank", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return _hf_worker(args)

    with tempfile.TemporaryDirectory(prefix="seekspeed-bench-") as workdir:
        runs = RUNS if args.preset == "tiny" else _moe_runs(workdir)
        results = {name: [] for name in runs}
        for rep in range(args.repeats):
            for name in runs:
                print(f"[{rep + 1}/{args.repeats}] {name} ...", file=sys.stderr, flush=True)
                results[name].append(_launch(runs, name, args.steps, workdir))

    rows = {}
    for name, runs in results.items():
        rows[name] = {
            "tokens_per_s": statistics.median(r["steady_tokens_per_s"] for r in runs),
            "tokens_per_s_runs": [r["steady_tokens_per_s"] for r in runs],
            "peak_rss_mib_per_rank": [statistics.median(col) for col in zip(*(r["peak_rss_mib"] for r in runs))],
            "loss_last": statistics.median(r["loss_last"] for r in runs),
            "losses": runs[0]["losses"],
        }
    base = rows["hf-dp"]["tokens_per_s"]
    for row in rows.values():
        row["max_abs_loss_diff_vs_hf_dp"] = max(abs(a - b) for a, b in zip(row["losses"], rows["hf-dp"]["losses"]))
    print(machine_line())
    print(f"\n{args.preset} recipe, {WORLD} ranks, {args.steps} steps x {args.repeats} interleaved repeats "
          f"(median; steady state after the first step)")
    print(f"{'run':<16} {'tok/s':>9} {'vs hf-dp':>9}  {'peak RSS per rank (MiB)':<28} {'final loss':>10} "
          f"{'max |dloss| vs hf-dp':>21}")
    for name, row in rows.items():
        rss = " ".join(f"{v:5.0f}" for v in row["peak_rss_mib_per_rank"])
        print(f"{name:<16} {row['tokens_per_s']:>9,.0f} {row['tokens_per_s'] / base:>8.2f}x  {rss:<28} "
              f"{row['loss_last']:>10.4f} {row['max_abs_loss_diff_vs_hf_dp']:>21.2e}")
    write_figures(args.json, {"preset": args.preset, "steps": args.steps, "repeats": args.repeats, "world_size": WORLD,
                              "runs": rows})


if __name__ == "__main__":
    sys.exit(main())

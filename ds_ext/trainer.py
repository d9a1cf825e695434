"""The training run behind launch/train.py: config -> recipe -> DeepSpeed pipeline
engine -> data -> loop with progress and checkpoints -> summary.

Runs under the deepspeed launcher, torchrun, or plain ``python`` (one rank).
"""

import argparse
import json
import logging
import os
import socket
import sys
import time

from .config import load_config, print_warnings
from .errors import ConfigError, DataError, SeekspeedError
from .progress import Progress, fmt_duration, peak_rss_mib


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="Train a seekspeed recipe with DeepSpeed's pipeline engine.")
    p.add_argument("--deepspeed", "--deepspeed_config", dest="config", required=True, metavar="JSON",
                   help="DeepSpeed config with a 'seekspeed' section (ds_configs/*.json)")
    p.add_argument("--steps", type=int, help="override seekspeed.train.steps (total optimizer steps)")
    p.add_argument("--checkpoint-dir", help="override seekspeed.checkpoint.dir")
    p.add_argument("--resume", action="store_true",
                   help="continue from the latest checkpoint in the checkpoint directory")
    p.add_argument("--summary-json", metavar="PATH", help="write the run summary (rank 0) to PATH")
    p.add_argument("--verbose", action="store_true", help="keep DeepSpeed's INFO logging")
    p.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _single_process_env():
    """Plain ``python launch/train.py``: a one-rank world on this machine."""
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))


def _config_overrides(args):
    overrides = {}
    if args.steps is not None:
        overrides["train.steps"] = args.steps
    if args.checkpoint_dir is not None:
        overrides["checkpoint.dir"] = args.checkpoint_dir
    return overrides


def _checkpoint_exists(directory):
    return directory is not None and os.path.isfile(os.path.join(directory, "latest"))


def validate(args, *, world_size):
    """Everything that can be checked before a process group exists: config, recipe,
    stages vs layers, tokenizer vs vocabulary, data path, resume. Writes nothing."""
    from recipes import get_recipe
    from .data import load_tokenizer, resolve_source
    cfg = load_config(args.config, world_size=world_size, overrides=_config_overrides(args))
    s = cfg.section
    recipe = get_recipe(s.recipe.name)
    model_config = recipe.make_config(s.recipe.preset, s.recipe.overrides)
    recipe.check_stages(model_config, stages=cfg.layout.pipe_stages, schedule=s.schedule)
    if model_config.max_position_embeddings < s.data.seq_len:
        raise ConfigError(f"seekspeed.data.seq_len {s.data.seq_len} exceeds the model's max_position_embeddings "
                          f"{model_config.max_position_embeddings}: lower seq_len or raise it in recipe.overrides")
    tokenizer = load_tokenizer(s.data.tokenizer, vocab_size=model_config.vocab_size)
    resolve_source(s.data)
    if args.resume and not _checkpoint_exists(s.checkpoint.dir):
        raise ConfigError(f"--resume: no checkpoint in {s.checkpoint.dir!r} (no 'latest' file): "
                          f"run without --resume, or set seekspeed.checkpoint.dir / --checkpoint-dir")
    if args.resume is False and s.checkpoint.dir and _checkpoint_exists(s.checkpoint.dir):
        raise ConfigError(f"checkpoint directory {s.checkpoint.dir} already holds a checkpoint: pass --resume to "
                          f"continue it, or choose another --checkpoint-dir (nothing was overwritten)")
    return cfg, recipe, model_config, tokenizer


def _partition_method(ds, recipe):
    method = ds.get("pipeline", {}).get("partition", "best")
    return recipe.DEFAULT_PARTITION if method == "best" else method


def _all_ranks_ok(error):
    """Collective: True when no rank failed; lets every rank stop together."""
    import torch
    from deepspeed import comm as dist
    flag = torch.tensor([0 if error is None else 1], dtype=torch.int32)
    dist.all_reduce(flag)
    return int(flag.item()) == 0


def run(args):
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    cfg, recipe, model_config, tokenizer = validate(args, world_size=world_size)
    print_warnings(cfg.warnings, rank=rank)
    s, layout = cfg.section, cfg.layout

    import torch
    import deepspeed
    from deepspeed import comm as dist
    from deepspeed.accelerator import get_accelerator
    from .data import PackedBatches, packed_sequences
    from .pipe import data_stages

    if not args.verbose:
        logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    _single_process_env()
    if get_accelerator().device_name() == "cpu":
        local = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(local, 1)))
    deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name())
    try:
        return _train(args, cfg, recipe, model_config, tokenizer, torch, deepspeed, dist, PackedBatches,
                      packed_sequences, data_stages)
    finally:
        if dist.is_initialized():
            dist.barrier()
            torch.distributed.destroy_process_group()


def _train(args, cfg, recipe, model_config, tokenizer, torch, deepspeed, dist, PackedBatches, packed_sequences,
           data_stages):
    s, layout = cfg.section, cfg.layout
    rank = dist.get_rank()
    if rank == 0:
        print(f"seekspeed: {s.recipe.name}/{s.recipe.preset} | {layout.describe()}", flush=True)
    torch.manual_seed(s.train.seed)
    model = recipe.build_pipeline(model_config, num_stages=layout.pipe_stages, schedule=s.schedule,
                                  partition_method=_partition_method(cfg.ds, recipe),
                                  activation_checkpoint_interval=cfg.ds.get("pipeline", {}).get(
                                      "activation_checkpoint_interval", 0),
                                  seed=s.train.seed)
    grid = model._grid
    stage, dp_rank = grid.get_stage_id(), grid.get_data_parallel_id()

    batches, error = None, None
    if stage in data_stages(s.schedule, layout.pipe_stages):
        try:
            t0 = time.perf_counter()
            rows = packed_sequences(s.data, tokenizer, vocab_size=model_config.vocab_size, shard=dp_rank,
                                    num_shards=layout.data_parallel)
            batches = PackedBatches(rows, micro_batch=layout.micro_batch, seed=s.train.seed)
            if dp_rank == 0 and stage == 0:
                print(f"data: {s.data.source} -> {len(rows):,} sequences of {s.data.seq_len} tokens on data-parallel "
                      f"shard 0 ({time.perf_counter() - t0:.1f}s)", flush=True)
        except SeekspeedError as exc:
            error = exc
    if not _all_ranks_ok(error):
        if error is not None:
            raise error
        raise _PeerFailed("another rank failed while loading data (its error is printed above)")

    ds_config = {k: v for k, v in cfg.ds.items() if k != "seekspeed"}
    engine, _, _, _ = deepspeed.initialize(model=model, config=ds_config,
                                           model_parameters=[p for p in model.parameters() if p.requires_grad])
    ckpt_dir = s.checkpoint.dir
    if args.resume:
        load_path, _ = engine.load_checkpoint(ckpt_dir)
        if load_path is None:
            raise ConfigError(f"--resume: DeepSpeed found no loadable checkpoint in {ckpt_dir}")
        if rank == 0:
            print(f"resumed from {load_path} at step {engine.global_steps}", flush=True)
    start = engine.global_steps
    if batches is not None:
        batches.position = start * layout.grad_accum
    total = s.train.steps
    if start >= total and rank == 0:
        print(f"nothing to do: the checkpoint is at step {start} and seekspeed.train.steps is {total}", flush=True)

    progress = Progress(start_step=start, total_steps=total, tokens_per_step=layout.tokens_per_step,
                        log_interval=s.train.log_interval, enabled=rank == 0)
    saved = []
    for step in range(start + 1, total + 1):
        loss = engine.train_batch(batches).item()
        lr = engine.get_lr()[0]
        progress.update(step, loss, lr=lr)
        if ckpt_dir and s.checkpoint.interval_steps and step % s.checkpoint.interval_steps == 0 and step < total:
            engine.save_checkpoint(ckpt_dir, tag=f"global_step{step}")
            saved.append(step)
    if ckpt_dir and s.checkpoint.save_final and total > start:
        engine.save_checkpoint(ckpt_dir, tag=f"global_step{total}")
        saved.append(total)

    summary = progress.summary()
    rss = torch.tensor([peak_rss_mib()], dtype=torch.float64)
    gathered = [torch.zeros_like(rss) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, rss)
    summary.update(peak_rss_mib=[round(float(t.item()), 1) for t in gathered], config=cfg.path,
                   layout=vars(layout) | {"tokens_per_step": layout.tokens_per_step},
                   checkpoints=[os.path.join(ckpt_dir, f"global_step{n}") for n in saved] if ckpt_dir else [])
    if rank == 0:
        _print_summary(summary)
        if args.summary_json:
            os.makedirs(os.path.dirname(os.path.abspath(args.summary_json)), exist_ok=True)
            with open(args.summary_json, "w") as f:
                json.dump(summary, f, indent=2)
    return 0


class _PeerFailed(SeekspeedError):
    """Raised on ranks that did nothing wrong when another rank failed."""


def _print_summary(summary):
    lines = [
        "=" * 64,
        f"done: {summary['steps']} steps (step {summary['start_step']} -> {summary['final_step']}) in "
        f"{fmt_duration(summary['wall_s'])}",
    ]
    if summary["steps"]:
        lines += [
            f"loss: {summary['loss_first']:.4f} (mean of first {summary['loss_window']}) -> "
            f"{summary['loss_last']:.4f} (mean of last {summary['loss_window']})",
            f"throughput: {summary['tokens_per_s']:,.0f} tok/s overall, {summary['steady_tokens_per_s']:,.0f} tok/s "
            f"after the first step; {summary['tokens']:,} tokens",
        ]
    lines.append("peak RSS per rank (MiB): " + ", ".join(f"{r:.0f}" for r in summary["peak_rss_mib"]))
    if summary["checkpoints"]:
        lines.append(f"checkpoints: {', '.join(summary['checkpoints'])}")
    lines.append("=" * 64)
    print("\n".join(lines), flush=True)


def main(argv=None):
    args = parse_args(argv)
    rank = int(os.environ.get("RANK", "0"))
    try:
        return run(args)
    except _PeerFailed:
        return 2
    except ConfigError as exc:
        if rank == 0:  # every rank validates the same config; say it once
            print(f"error: {exc}", file=sys.stderr, flush=True)
        return 2
    except DataError as exc:
        print(f"error (rank {rank}): {exc}", file=sys.stderr, flush=True)
        return 2

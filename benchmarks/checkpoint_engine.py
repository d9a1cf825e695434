"""What a checkpoint costs the training loop: seekspeed's async-zstd engine against
DeepSpeed's default torch.save engine, in one run on one model.

    python benchmarks/checkpoint_engine.py --json benchmarks/results/checkpoint_engine.json

The model is a one-stage DeepSpeed pipeline of --layers square Linear layers (--width)
trained with AdamW under ZeRO-1 in fp32, i.e. weights, fp32 master partition and
two Adam moments: 16 bytes per parameter, 1.07 GB with the defaults. For each number
of training threads (1: the spare core stands in for a GPU node's idle host CPUs; 2:
both cores busy), each engine saves --repeats times; per save:
  blocking  the wall time of engine.save_checkpoint (the snapshot, for async-zstd);
  extra     how much longer the --steps-after training steps that follow took than the
            same number of steps just before the save (the background write competing);
            the spread of those save-free segments is printed: it is the resolution;
  total     blocking + extra: what the checkpoint cost the run.
DeepSpeed's engine does not fsync (its files may still be in the page cache when it
returns); async-zstd fsyncs every file before it commits.

Then the bytes on disk for the trained weights (fp32, and cast to bf16) and the Adam
moments: plain zstd and zstd after byte grouping, with the compression-and-write
throughput of each (one writer thread, fsync included). About 5 minutes on 2 cores.
"""

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks import machine_line, write_figures


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--width", type=int, default=4096)
    p.add_argument("--batch", type=int, default=16, help="rows per micro-batch")
    p.add_argument("--steps-after", type=int, default=14, help="training steps timed after each save")
    p.add_argument("--repeats", type=int, default=2, help="saves per engine and thread count")
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2], help="torch threads for training")
    p.add_argument("--zstd-level", type=int, default=3)
    p.add_argument("--dir", help="where checkpoints go (default: a temporary directory, removed at the end)")
    p.add_argument("--json", metavar="PATH", help="write the figures here")
    return p.parse_args(argv)


def _build(args):
    import torch
    import deepspeed
    from deepspeed.pipe import PipelineModule, LayerSpec
    from ds_ext.pipe.engine import initialize

    torch.manual_seed(0)
    specs = [LayerSpec(torch.nn.Linear, args.width, args.width) for _ in range(args.layers)]
    model = PipelineModule(layers=specs, num_stages=1, loss_fn=lambda out, y: torch.nn.functional.mse_loss(out, y),
                           partition_method="uniform")
    config = {"train_micro_batch_size_per_gpu": args.batch, "gradient_accumulation_steps": 1,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.1}},
              "zero_optimization": {"stage": 1}, "steps_per_print": 10 ** 9}
    engine = initialize(model=model, config=config, schedule="1f1b",
                        model_parameters=[p for p in model.parameters()])
    del deepspeed
    return engine


def _batches(args):
    import torch
    g = torch.Generator().manual_seed(1)
    x = torch.randn(args.batch, args.width, generator=g)
    while True:
        yield x, x * 0.5


def _timed_steps(engine, data, n):
    times = []
    for _ in range(n):
        t = time.perf_counter()
        engine.train_batch(data)
        times.append(time.perf_counter() - t)
    return times


def _engines(args, torch_engine):
    from ds_ext.checkpoint.engine import AsyncCheckpointEngine
    from ds_ext.config import CheckpointSection
    section = CheckpointSection(dir="unused", engine="async-zstd", zstd_level=args.zstd_level)
    return {"deepspeed": torch_engine, "async-zstd": AsyncCheckpointEngine(section, log=lambda m: None)}


def measure_saves(engine, engines, data, args, save_root, threads):
    import torch
    torch.set_num_threads(threads)
    _timed_steps(engine, data, 3)                                   # warm-up
    rows, controls = [], []
    for rep in range(args.repeats):
        for name, ckpt_engine in engines.items():                 # alternate, so drift hits both
            engine.checkpoint_engine = ckpt_engine
            save_dir = os.path.join(save_root, f"{name}-t{threads}-r{rep}")
            # the same number of steps without a save, just before: the reference for "extra"
            control = _timed_steps(engine, data, args.steps_after)
            controls.append(sum(control))
            base = sum(control) / len(control)
            t = time.perf_counter()
            engine.save_checkpoint(save_dir, tag=f"global_step{engine.global_steps}")
            blocking = time.perf_counter() - t
            t = time.perf_counter()
            steps = _timed_steps(engine, data, args.steps_after)
            busy_until = None
            if name == "async-zstd":
                ckpt_engine.wait()
                busy_until = ckpt_engine.history[-1]["commit_after_s"]
            after = time.perf_counter() - t
            assert type(engine.checkpoint_engine).__name__ == {"deepspeed": "TorchCheckpointEngine",
                                                               "async-zstd": "AsyncCheckpointEngine"}[name]
            on_disk = sum(os.path.getsize(os.path.join(dp, f)) for dp, _, fs in os.walk(save_dir) for f in fs)
            extra = sum(steps) - sum(control)
            rows.append({"threads": threads, "engine": name, "repeat": rep, "blocking_s": blocking, "extra_s": extra,
                         "total_s": blocking + extra, "base_step_s": base, "steps_after": len(steps),
                         "wall_after_s": after, "committed_after_s": busy_until, "bytes_on_disk": on_disk})
            print(f"  threads {threads} | {name:10s} | blocking {blocking:6.3f} s | extra {extra:6.3f} s over "
                  f"{len(steps)} steps of {base * 1000:.0f} ms | {on_disk / 1e9:.3f} GB on disk"
                  + (f" | committed {busy_until:.2f} s after the save began" if busy_until else ""), flush=True)
            shutil.rmtree(save_dir, ignore_errors=True)
    spread = statistics.stdev(controls) if len(controls) > 1 else 0.0
    print(f"  noise: the {len(controls)} save-free segments of {args.steps_after} steps took "
          f"{min(controls):.2f}-{max(controls):.2f} s (stdev {spread:.3f} s)", flush=True)
    return rows, {"segment_s": controls, "segment_stdev_s": spread}


def measure_bytes(engine, args, tmp):
    import torch
    from ds_ext.checkpoint import format as fmt
    torch.set_num_threads(1)
    weights = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    opt = engine.optimizer.optimizer        # ZeRO-1's torch optimizer over the fp32 partition
    def moment(key):
        return {f"{key}{i}": st[key] for i, st in enumerate(opt.state.values())}
    groups = {"fp32 weights": weights, "bf16 weights": {n: w.to(torch.bfloat16) for n, w in weights.items()},
              "adam exp_avg": moment("exp_avg"), "adam exp_avg_sq": moment("exp_avg_sq")}
    rows = []
    for label, state in groups.items():
        snap = fmt.snapshot(state)
        raw = snap.nbytes
        path = os.path.join(tmp, "bytes.pt")
        torch.save(state, path)
        row = {"state": label, "raw_bytes": raw, "torch_save_bytes": os.path.getsize(path)}
        os.unlink(path)
        for variant, kw in {"none": dict(codec="none"), "zstd": dict(byte_group=False),
                            "zstd+group": dict(byte_group=True)}.items():
            path = os.path.join(tmp, "bytes.ckpt")
            t = time.perf_counter()
            size, _ = fmt.write(path, snap, level=args.zstd_level, **kw)
            elapsed = time.perf_counter() - t
            os.unlink(path)
            row[variant] = {"bytes": size, "ratio": raw / size, "vs_torch_save": size / row["torch_save_bytes"],
                            "mb_per_s": raw / elapsed / 1e6}
        rows.append(row)
        print(f"  {label:20s} {raw / 1e6:8.1f} MB | zstd {row['zstd']['ratio']:.3f}x "
              f"({row['zstd']['mb_per_s']:.0f} MB/s) | byte-grouped {row['zstd+group']['ratio']:.3f}x "
              f"({row['zstd+group']['mb_per_s']:.0f} MB/s), {row['zstd+group']['vs_torch_save']:.3f} of torch.save's "
              f"bytes | uncompressed write {row['none']['mb_per_s']:.0f} MB/s", flush=True)
    return rows


def main(argv=None):
    args = parse_args(argv)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
    from ds_ext.distributed import free_port
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    import logging
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    from ds_ext.distributed import init_distributed
    init_distributed("gloo")
    engine = _build(args)
    params = sum(p.numel() for p in engine.module.parameters())
    print(machine_line())
    print(f"model: {args.layers} x Linear({args.width}, {args.width}) = {params / 1e6:.1f}M parameters; AdamW, "
          f"ZeRO-1, fp32: {16 * params / 1e9:.2f} GB of state", flush=True)
    data = _batches(args)
    root = args.dir or tempfile.mkdtemp(prefix="seekspeed-ckpt-bench-")
    os.makedirs(root, exist_ok=True)
    try:
        saves, bases = [], {}
        engines = _engines(args, engine.checkpoint_engine)       # DeepSpeed's own, as initialize made it
        for threads in args.threads:
            print(f"saves with {threads} training thread(s):", flush=True)
            rows, bases[threads] = measure_saves(engine, engines, data, args, root, threads)
            saves += rows
        print("bytes on disk (zstd level %d):" % args.zstd_level, flush=True)
        sizes = measure_bytes(engine, args, root)
    finally:
        if not args.dir:
            shutil.rmtree(root, ignore_errors=True)

    summary = []
    print()
    print(f"{'threads':>7} {'engine':>11} {'blocking s':>11} {'extra s':>8} {'total s':>8} {'vs deepspeed':>13}")
    for threads in args.threads:
        med = {}
        for name in ("deepspeed", "async-zstd"):
            rs = [r for r in saves if r["threads"] == threads and r["engine"] == name]
            med[name] = {k: statistics.median(r[k] for r in rs) for k in ("blocking_s", "extra_s", "total_s")}
        for name in ("deepspeed", "async-zstd"):
            m = med[name]
            ratio = m["total_s"] / med["deepspeed"]["total_s"]
            print(f"{threads:>7} {name:>11} {m['blocking_s']:>11.3f} {m['extra_s']:>8.3f} {m['total_s']:>8.3f} "
                  f"{ratio:>12.2f}x")
            summary.append({"threads": threads, "engine": name, **m, "total_vs_deepspeed": ratio})
    figures = {"parameters": params,
               "state_bytes": 16 * params, "control_segments": bases, "saves": saves, "summary": summary,
               "bytes": sizes}
    write_figures(args.json, figures)


if __name__ == "__main__":
    main()

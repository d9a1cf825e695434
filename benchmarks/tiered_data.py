"""Does training wait for data? The tiered pipeline against direct reads of a slow
cold tier, in one run.

    python benchmarks/tiered_data.py --json benchmarks/results/tiered_data.json

A synthetic corpus is tokenised and packed once (the tokens/s of that stage is
reported), into shards of --rows-per-shard rows of --seq-len + 1 byte-level tokens.
The cold tier is read through a throttled reader: --cold-mb-s shared by all readers
and --latency-ms added to every request (this kernel's tc has no netem, so latency
comes from the reader). --ranks data-parallel readers run in threads, each taking a
micro-batch of --micro-batch rows and then "training" for --step-ms (a sleep, so the
two cores do not distort it). After --warmup micro-batches, the fraction of wall time
the readers spent waiting for data, per mode:

  direct              every row read from the cold tier when it is needed
  lru                 hot tier of --hot-mb per reader, fetched on a miss, LRU eviction
  lru+prefetch        the same, with the prefetcher fetching the shards the order needs next
  next-use+prefetch   prefetch, and eviction of the shard whose next use is farthest

Goal: under 2 % waiting with tiering plus prefetch. About 3 minutes on 2 cores.
"""

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks import machine_line, write_figures

MODES = ("direct", "lru", "lru+prefetch", "next-use+prefetch")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--corpus-mb", type=float, default=48.0)
    p.add_argument("--seq-len", type=int, default=2047)
    p.add_argument("--rows-per-shard", type=int, default=256)
    p.add_argument("--shuffle-window", type=int, default=4)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--step-ms", type=float, default=40.0)
    p.add_argument("--batches", type=int, default=500, help="micro-batches per reader and mode")
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--cold-mb-s", type=float, default=20.0)
    p.add_argument("--latency-ms", type=float, default=5.0)
    p.add_argument("--hot-mb", type=float, default=12.0)
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    p.add_argument("--json", metavar="PATH")
    return p.parse_args(argv)


def make_corpus(path, mb):
    import numpy as np
    rng = np.random.default_rng(0)
    words = [f"w{i}" for i in range(5000)]
    written = 0
    with open(path, "w") as f:
        while written < mb * 1e6:
            n = int(rng.integers(50, 3000))
            text = " ".join(words[i] for i in rng.integers(0, len(words), size=n))
            f.write(json.dumps({"text": text}) + "\n")
            written += len(text)


def run_mode(mode, store, args, tmp):
    from ds_ext.data.order import SampleOrder
    from ds_ext.data.tiers import ColdTier, HotTier, TierStats, TieredBatches
    cold = ColdTier(store.root, throttle_mb_s=args.cold_mb_s, latency_ms=args.latency_ms)   # one shared link
    order = SampleOrder([s["rows"] for s in store.shards], seed=1, window=args.shuffle_window, dp_size=args.ranks,
                        micro_batch=args.micro_batch)
    readers = []
    for r in range(args.ranks):
        hot = None
        if mode != "direct":
            hot = HotTier(store, cold, os.path.join(tmp, f"hot-{mode}-{r}"), budget_bytes=int(args.hot_mb * 1e6),
                          policy=mode.split("+")[0], stats=TierStats(), min_shards=args.shuffle_window)
        readers.append(TieredBatches(store, order, dp_rank=r, cold=cold, hot=hot, prefetch=mode.endswith("prefetch")))
    results = [None] * args.ranks

    def reader(r):
        it = readers[r]
        waits, t0 = 0.0, None
        for i in range(args.batches):
            if i == args.warmup:
                t0, waits = time.perf_counter(), 0.0
            t = time.perf_counter()
            next(it)
            waits += time.perf_counter() - t
            time.sleep(args.step_ms / 1000)
        wall = time.perf_counter() - t0
        it.close()
        results[r] = {"wait_s": waits, "wall_s": wall, "wait_fraction": waits / wall, **it.figures()}

    threads = [threading.Thread(target=reader, args=(r, )) for r in range(args.ranks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for r in range(args.ranks):
        shutil.rmtree(os.path.join(tmp, f"hot-{mode}-{r}"), ignore_errors=True)
    return {"mode": mode, "per_rank": results,
            "wait_fraction": statistics.mean(x["wait_fraction"] for x in results),
            "bytes_from_cold": cold.bytes_read,
            "hit_rate": statistics.mean(x["hit_rate"] for x in results) if mode != "direct" else None}


def main(argv=None):
    args = parse_args(argv)
    import torch
    torch.set_num_threads(1)        # as a training rank here; torch's idle thread pool costs ~10 ms to wake
    from ds_ext.config import DataSection
    from ds_ext.data import ByteTokenizer
    from ds_ext.data.store import build
    tmp = tempfile.mkdtemp(prefix="seekspeed-tiers-")
    try:
        corpus = os.path.join(tmp, "corpus.jsonl")
        make_corpus(corpus, args.corpus_mb)
        data = DataSection(source=corpus, seq_len=args.seq_len, pipeline="tiered", rows_per_shard=args.rows_per_shard)
        t = time.perf_counter()
        store = build(data, ByteTokenizer(), root=os.path.join(tmp, "cold"), rows_per_shard=args.rows_per_shard,
                      log=lambda m: print(m, flush=True))
        build_s = time.perf_counter() - t
        shard_mb = store.shard_bytes(0) / 1e6
        per_reader = args.micro_batch * store.row_len * store.dtype.itemsize / (args.step_ms / 1000) / 1e6
        print(f"corpus: {store.num_rows:,} rows in {len(store.shards)} shards of {shard_mb:.2f} MB; "
              f"tokenise+pack {store.index['tokens'] / build_s:,.0f} tokens/s; each reader consumes "
              f"{per_reader:.1f} MB/s, the cold tier gives {args.cold_mb_s:g} MB/s in all (+{args.latency_ms:g} ms "
              f"per request); hot tier {args.hot_mb:g} MB = {args.hot_mb / shard_mb:.1f} shards per reader", flush=True)
        rows = []
        for mode in args.modes:
            row = run_mode(mode, store, args, tmp)
            rows.append(row)
            print(f"  {mode:18s} waiting {100 * row['wait_fraction']:6.2f} % of the time | "
                  f"{row['bytes_from_cold'] / 1e6:7.1f} MB from cold"
                  + (f" | hit rate {100 * row['hit_rate']:.1f} %" if row["hit_rate"] is not None else ""), flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(machine_line())
    print()
    print(f"{'mode':>18} {'waiting %':>10} {'MB from cold':>13} {'hit rate %':>11}")
    for row in rows:
        hit = f"{100 * row['hit_rate']:.1f}" if row["hit_rate"] is not None else "-"
        print(f"{row['mode']:>18} {100 * row['wait_fraction']:>10.2f} {row['bytes_from_cold'] / 1e6:>13.1f} {hit:>11}")
    figures = {"args": vars(args),
               "tokenize_pack_tokens_per_s": store.index["tokens"] / build_s, "rows": store.num_rows,
               "shards": len(store.shards), "shard_bytes": store.shard_bytes(0), "modes": rows}
    write_figures(args.json, figures)


if __name__ == "__main__":
    main()

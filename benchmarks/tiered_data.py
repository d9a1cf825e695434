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

Then one hot tier per rank against one per node (data.hot_scope), with --readers
readers (each count in turn) as separate processes of one node sharing the
--cold-mb-s link (paced across the processes), next-use eviction and prefetch:

  rank                each reader its own hot tier of --hot-mb (hot_scope "rank")
  node                one directory for all readers, budget readers x --hot-mb (the
                      same disk), each shard fetched from cold once per node

reporting the node's bytes from cold (summed over its readers), the waiting share
and the hit rate, and their ratio rank / node. Goals: at least 1.8x fewer cold bytes
with 2 readers per node, and under 2 % waiting with tiering plus prefetch. About 4
to 5 minutes on 2 cores (the load average is recorded with each run).
"""

import argparse
import json
import multiprocessing
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
    p.add_argument("--readers", nargs="*", type=int, default=[2, 4],
                   help="reader processes of one node for the rank/node comparison (none: skip it)")
    p.add_argument("--pin-window", type=int, default=4, help="node tier: micro-batches a reader may lag the others")
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


def timed_reads(it, args):
    """Read --batches micro-batches from ``it``, "training" --step-ms after each; (seconds
    waited for data, wall seconds), both after --warmup micro-batches; closes ``it``."""
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
    return waits, wall


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
        waits, wall = timed_reads(it, args)
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


class SharedLink:
    """One --cold-mb-s link shared by reader processes (fork): the time it is next free."""

    def __init__(self, ctx, mb_s):
        self.rate = mb_s * 1e6
        self.next_free = ctx.Value("d", 0.0, lock=False)
        self.lock = ctx.Lock()


def shared_link_cold(root, *, link, latency_ms):
    from ds_ext.data.tiers import ColdTier

    class SharedLinkCold(ColdTier):
        def _pace(self, nbytes):                 # ColdTier's pacing, across processes (CLOCK_MONOTONIC)
            self.bytes_read += nbytes
            with link.lock:
                start = max(link.next_free.value, time.monotonic())
                link.next_free.value = start + nbytes / link.rate
                wait = link.next_free.value - time.monotonic()
            if wait > 0:
                time.sleep(wait)

    return SharedLinkCold(root, latency_ms=latency_ms)


def scope_reader(scope, r, readers, store, args, tmp, link, barrier, queue):
    """One reader process: its tier, then --batches micro-batches with a --step-ms sleep each."""
    import torch
    torch.set_num_threads(1)
    from ds_ext.data.node_tier import NodeHotTier, node_directory
    from ds_ext.data.order import SampleOrder
    from ds_ext.data.tiers import HotTier, TierStats, TieredBatches
    cold = shared_link_cold(store.root, link=link, latency_ms=args.latency_ms)
    order = SampleOrder([s["rows"] for s in store.shards], seed=1, window=args.shuffle_window, dp_size=readers,
                        micro_batch=args.micro_batch)
    tier = dict(policy="next-use", stats=TierStats(), min_shards=args.shuffle_window)
    if scope == "rank":
        hot = HotTier(store, cold, os.path.join(tmp, f"hot-rank{readers}-{r}"), budget_bytes=int(args.hot_mb * 1e6),
                      **tier)
        it = TieredBatches(store, order, dp_rank=r, cold=cold, hot=hot, prefetch=True)
    else:
        hot = NodeHotTier(store, cold, node_directory(os.path.join(tmp, f"hot-node{readers}"), store),
                          budget_bytes=int(readers * args.hot_mb * 1e6), **tier)
        it = TieredBatches(store, order, dp_rank=r, cold=cold, hot=hot, prefetch=True,
                           node_dp_ranks=range(readers), pin_window=args.pin_window)
    barrier.wait()
    waits, wall = timed_reads(it, args)
    queue.put((r, it.figures() | {"wait_s": waits, "wall_s": wall, "wait_fraction": waits / wall,   # after warm-up
                                  "cold_bytes": cold.bytes_read}))


def run_scope(scope, readers, store, args, tmp):
    ctx = multiprocessing.get_context("fork")
    link, barrier, queue = SharedLink(ctx, args.cold_mb_s), ctx.Barrier(readers), ctx.Queue()
    procs = [ctx.Process(target=scope_reader, args=(scope, r, readers, store, args, tmp, link, barrier, queue))
             for r in range(readers)]
    for p in procs:
        p.start()
    results = {}
    while len(results) < readers:
        try:
            r, figures = queue.get(timeout=5)
            results[r] = figures
        except Exception:
            bad = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            if bad:
                raise SystemExit(f"{scope} tier, {readers} readers: a reader exited with {bad}") from None
    for p in procs:
        p.join()
    per_rank = [results[r] for r in range(readers)]
    hits, misses = sum(x["hits"] for x in per_rank), sum(x["misses"] for x in per_rank)
    return {"scope": scope, "readers": readers, "per_rank": per_rank,
            "wait_fraction": statistics.mean(x["wait_fraction"] for x in per_rank),
            "wait_fraction_max": max(x["wait_fraction"] for x in per_rank),
            "cold_bytes": sum(x["cold_bytes"] for x in per_rank),
            "hit_rate": hits / (hits + misses), "load_average": os.getloadavg()}


def main(argv=None):
    args = parse_args(argv)
    import torch
    torch.set_num_threads(1)        # as a training rank here; torch's idle thread pool costs ~10 ms to wake
    from ds_ext.config import DataSection
    from ds_ext.data import ByteTokenizer
    from ds_ext.data.build import build
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
            rows.append(row | {"load_average": os.getloadavg()})
            print(f"  {mode:18s} waiting {100 * row['wait_fraction']:6.2f} % of the time | "
                  f"{row['bytes_from_cold'] / 1e6:7.1f} MB from cold"
                  + (f" | hit rate {100 * row['hit_rate']:.1f} %" if row["hit_rate"] is not None else ""), flush=True)
        scopes = {}
        for readers in args.readers:
            for scope in ("rank", "node"):
                row = scopes.setdefault(readers, {})[scope] = run_scope(scope, readers, store, args, tmp)
                print(f"  {readers} readers, {scope:4s} tier  waiting {100 * row['wait_fraction']:6.2f} % (worst "
                      f"reader {100 * row['wait_fraction_max']:.2f} %) | {row['cold_bytes'] / 1e6:7.1f} MB from cold "
                      f"| hit rate {100 * row['hit_rate']:.1f} % | load {row['load_average'][0]:.2f}", flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(machine_line())
    print()
    print(f"{'mode':>18} {'waiting %':>10} {'MB from cold':>13} {'hit rate %':>11}")
    for row in rows:
        hit = f"{100 * row['hit_rate']:.1f}" if row["hit_rate"] is not None else "-"
        print(f"{row['mode']:>18} {100 * row['wait_fraction']:>10.2f} {row['bytes_from_cold'] / 1e6:>13.1f} {hit:>11}")
    if scopes:
        print()
        print(f"{'readers':>7} {'tier':>5} {'waiting %':>10} {'MB from cold':>13} {'hit rate %':>11} {'load':>5}")
        for readers, pair in scopes.items():
            for scope, row in pair.items():
                print(f"{readers:>7} {scope:>5} {100 * row['wait_fraction']:>10.2f} {row['cold_bytes'] / 1e6:>13.1f} "
                      f"{100 * row['hit_rate']:>11.1f} {row['load_average'][0]:>5.2f}")
            print(f"{readers:>7} cold bytes rank / node: {pair['rank']['cold_bytes'] / pair['node']['cold_bytes']:.2f}x")
    hot_scope = {str(readers): {"cold_bytes_rank": pair["rank"]["cold_bytes"], "cold_bytes_node": pair["node"]["cold_bytes"],
                                "cold_ratio": pair["rank"]["cold_bytes"] / pair["node"]["cold_bytes"],
                                "wait_fraction_rank": pair["rank"]["wait_fraction"],
                                "wait_fraction_node": pair["node"]["wait_fraction"],
                                "hit_rate_rank": pair["rank"]["hit_rate"], "hit_rate_node": pair["node"]["hit_rate"],
                                "runs": pair}
                 for readers, pair in scopes.items()}
    figures = {"args": vars(args),
               "tokenize_pack_tokens_per_s": store.index["tokens"] / build_s, "rows": store.num_rows,
               "shards": len(store.shards), "shard_bytes": store.shard_bytes(0), "modes": rows,
               "hot_scope": hot_scope}
    write_figures(args.json, figures)


if __name__ == "__main__":
    main()

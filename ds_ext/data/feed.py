"""This rank's training data as the trainer sees it: one object that opens the
configured pipeline (the tiered pipeline's packed store and its hot/cold tiers, or the
rows packed in memory), continues where a resumed engine stands, serves timed
batches, and reports its figures for the run summary."""

import os
import time

from ds_ext.errors import DataError, SeekspeedError
from ds_ext.log import print_line


class DataFeed:
    """Opened on every rank (collective: errors are decided together through
    ``control``); ranks of stages that read no data hold no batches. ``resume(engine)``
    continues after the samples the engine has consumed (DeepSpeed's
    ``global_samples``; 0 for a fresh run), then ``batches`` is the timed iterator the
    engine pulls from (None on ranks that read no data)."""

    def __init__(self, plan, control, *, rank, stage, dp_rank, node_dp_ranks=()):
        s, layout, tokenizer = plan.section, plan.layout, plan.tokenizer
        self.store, self._batches, self.batches = None, None, None
        if s.data.pipeline == "tiered":
            self.store = _packed_store(s.data, tokenizer, control, rank=rank)
        error = None
        if stage in plan.data_stages:
            try:
                if self.store is not None:
                    self._batches = tiered_batches(s, layout, self.store, dp_rank=dp_rank, stage=stage,
                                                   node_dp_ranks=node_dp_ranks)
                    if rank == 0:
                        _describe_hot_tier(self._batches)
                else:
                    self._batches = _memory_batches(plan, dp_rank=dp_rank, stage=stage)
            except SeekspeedError as exc:
                error = exc
        control.stop_if_any_failed(error, rank=rank)

    def resume(self, engine):
        """Continue after the rows ``engine`` has consumed, whatever the layout was (the
        tiered pipeline's one global order; the memory pipeline's per-replica cut, whose
        layout a resume keeps), and time each pull."""
        if self._batches is None:
            return None
        from ds_ext.profile.run import TimedBatches
        self._batches.seek(engine.global_samples)
        self.batches = TimedBatches(self._batches)
        return self.batches

    def summary(self, control):
        """The hot/cold tiers' figures of every reading rank (collective), or None
        without the tiered pipeline; closes the tiers."""
        if self.store is None:
            return None
        tiers = control.gather(self.batches.figures() if self.batches is not None else None)
        if self.batches is not None:
            self.batches.close()
        return [t for t in tiers if t is not None]


def _describe_hot_tier(batches):
    if batches.hot is None:
        return
    f = batches.figures()
    shared = (f"shared by data-parallel ranks {f['node_dp_ranks']} of this node"
              if f["scope"] == "node" else "this data rank's own")
    print(f"data: hot tier {batches.hot.dir}: budget {f['budget_bytes'] / 1e6:,.1f} MB, {shared}; "
          f"hit rate and bytes from cold in the progress line", flush=True)


def _memory_batches(plan, *, dp_rank, stage):
    """data.pipeline "memory": this replica's cut of the corpus, packed in memory."""
    from .packing import PackedBatches
    s, layout = plan.section, plan.layout
    t0 = time.perf_counter()
    stats = {}
    rows = _load_rows(s, layout, plan.tokenizer, plan.model_config, shard=dp_rank, stats=stats)
    batches = PackedBatches(rows, micro_batch=layout.micro_batch, seed=s.train.seed, num_shards=layout.data_parallel)
    if dp_rank == 0 and stage == 0:
        from .textfiles import describe_undecodable
        undecodable = describe_undecodable(stats["replaced"], stats["skipped"])
        print(f"data: {s.data.source} -> {len(rows):,} sequences of {s.data.seq_len} tokens on data-parallel "
              f"shard 0 ({time.perf_counter() - t0:.1f}s){'; corpus: ' + undecodable if undecodable else ''}",
              flush=True)
    return batches


def node_dp_ranks(plan, topo, *, rank):
    """The data-parallel ranks read on this rank's node (the topology plan's nodes):
    the readers that share a node hot tier (data.hot_scope "node")."""
    from ds_ext.topology.placement import deepspeed_topology
    grid = deepspeed_topology(topo.placement, pp=plan.layout.pipe_stages, dp=plan.layout.data_parallel)
    return sorted({grid.get_coord(r).data for r, node in enumerate(topo.node_of)
                   if node == topo.node_of[rank] and grid.get_coord(r).pipe in plan.data_stages})


def _packed_store(data, tokenizer, control, *, rank):
    """The tiered pipeline's packed shards: rank 0 builds them if missing (the others
    wait), then every rank opens the same cache."""
    from .sources import cache_dir
    from .build import build_all
    from .store import open_all
    root = data.cache_dir or str(cache_dir() / "packed")
    error = None
    if rank == 0:
        try:
            build_all(data, tokenizer, root=root, rows_per_shard=data.rows_per_shard,
                      log=print_line)
        except SeekspeedError as exc:
            error = exc
        except OSError as exc:
            error = DataError(f"seekspeed.data.cache_dir {root}: cannot build the packed cache ({exc})")
    control.stop_if_any_failed(error, rank=rank)
    store = open_all(data, tokenizer, root=root, rows_per_shard=data.rows_per_shard)
    control.stop_if_any_failed(None if store is not None else DataError(
        f"seekspeed.data.cache_dir {root}: rank 0 built the packed cache but this rank cannot read it; the "
        f"cache directory must be shared by all ranks"), rank=rank)
    if rank == 0:
        from .store import describe_store
        mix = "" if len(store.stores) == 1 else \
            f"; mixture of {len(store.stores)} sources, weights {', '.join(f'{w:g}' for w in store.weights)}"
        print(f"data: {store.num_rows:,} packed rows in {len(store.shards)} shards under {store.root} "
              f"({store.index['documents']:,} documents, {store.index['tokens']:,} tokens{mix})", flush=True)
        for i, (part, weight) in enumerate(zip(store.stores, store.weights)):
            print(f"data: source {i + 1}/{len(store.stores)}{f' (weight {weight:g})' if len(store.stores) > 1 else ''}: "
                  f"{describe_store(part)}", flush=True)
    return store


def tiered_batches(s, layout, store, *, dp_rank, stage, node_dp_ranks=()):
    """This reader's TieredBatches; with data.hot_scope "node" its hot tier is shared
    with the readers of ``node_dp_ranks`` (one directory and one budget per node)."""
    from .node_tier import NodeHotTier, node_directory
    from .order import SampleOrder
    from .tiers import ColdTier, HotTier, TierStats, TieredBatches
    d = s.data
    order = SampleOrder([sh["rows"] for sh in store.shards], seed=s.train.seed, window=d.shuffle_window,
                        dp_size=layout.data_parallel, micro_batch=layout.micro_batch,
                        sources=store.source_of_shard, weights=store.weights)
    cold = ColdTier(store.root)
    hot, node = None, {}
    tier = dict(budget_bytes=int(d.hot_budget_mb * 1e6), policy=d.policy, stats=TierStats(),
                min_shards=d.shuffle_window * len(store.stores))
    if d.hot_dir and d.hot_scope == "rank":
        hot = HotTier(store, cold, os.path.join(d.hot_dir, f"dp{dp_rank}-stage{stage}"), **tier)
    elif d.hot_dir:
        hot = NodeHotTier(store, cold, node_directory(d.hot_dir, store), **tier)
        # the node's readers are within about one optimizer step of each other
        node = {"node_dp_ranks": node_dp_ranks, "pin_window": layout.grad_accum}
    return TieredBatches(store, order, dp_rank=dp_rank, cold=cold, hot=hot, prefetch=d.prefetch,
                         prefetch_batches=d.prefetch_batches, **node)


def _load_rows(s, layout, tokenizer, model_config, *, shard, stats=None):
    from . import packed_sequences
    try:
        return packed_sequences(s.data, tokenizer, vocab_size=model_config.vocab_size, shard=shard,
                                num_shards=layout.data_parallel, stats=stats)
    except SeekspeedError:
        raise
    except Exception as exc:  # a corrupt file surfaces as whatever its reader raises
        first = (str(exc).splitlines() or [""])[0][:300]
        raise DataError(f"cannot load seekspeed.data.source {s.data.source} ({type(exc).__name__}: {first}); "
                        f"check the files, or point data.source elsewhere") from None

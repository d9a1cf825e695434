"""One hot tier per node (ds_ext/data/node_tier.py, ``data.hot_scope: node``).

Reader processes (multiprocessing, fork), each its own TieredBatches over one shared
node directory: their micro-batches equal direct cold reads; with a budget that
holds the working set every shard is fetched from the cold tier once per node (the
readers' bytes from cold add up to the shards resident, once each); under a small
budget the directory never holds more than the budget (sampled under its lock while
three readers evict each other's shards); a reader SIGKILLed in the middle of a
fetch leaves no file under the shard's name, and the next reader cleans its leftovers
and reads the right rows. ``hot_scope: rank`` builds today's per-rank tier through
the trainer; the node directory is keyed by the store; a resident file of the wrong
size is replaced; the node's readers come from the topology plan. Every wait is an
event (a file appearing, a process ending) under a pytest timeout, never a timed
assert. About 15 s on two loaded cores."""

import fcntl
import json
import multiprocessing
import os
import signal
import time
import types

import numpy as np
import pytest

from ds_ext.config import DataSection
from ds_ext.data import ByteTokenizer
from ds_ext.data.node_tier import NodeHotTier, _flock, node_directory
from ds_ext.data.order import SampleOrder
from ds_ext.data.build import build
from ds_ext.data.store import ShardSet
from ds_ext.data.tiers import ColdTier, HotTier, TierStats, TieredBatches
from ds_ext.errors import ConfigError

FORK = multiprocessing.get_context("fork")


def _store(tmp_path, *, rows_per_shard=16, name="docs.jsonl", n=300):
    rng = np.random.default_rng(len(name))
    path = tmp_path / name
    with open(path, "w") as f:
        for i in range(n):
            words = " ".join(f"w{int(x)}" for x in rng.integers(0, 50, size=int(rng.integers(5, 80))))
            f.write(json.dumps({"text": f"doc {i}: {words}"}) + "\n")
    data = DataSection(source=str(path), seq_len=31, pipeline="tiered", rows_per_shard=rows_per_shard)
    return build(data, ByteTokenizer(), root=str(tmp_path / "cold"), rows_per_shard=rows_per_shard,
                 log=lambda m: None)


def _order(store, dp_size):
    return SampleOrder([s["rows"] for s in store.shards], seed=7, window=2, dp_size=dp_size, micro_batch=3)


def _direct(store, dp_rank, dp_size, count):
    it = TieredBatches(store, _order(store, dp_size), dp_rank=dp_rank, cold=ColdTier(store.root))
    return [next(it)[0].numpy() for _ in range(count)]


def _node_batches(store, directory, *, dp_rank, dp_size, budget_shards, cold=None, prefetch=True):
    cold = cold or ColdTier(store.root)
    hot = NodeHotTier(store, cold, directory, budget_bytes=budget_shards * store.shard_bytes(0), policy="next-use",
                      stats=TierStats(), min_shards=2)
    return TieredBatches(store, _order(store, dp_size), dp_rank=dp_rank, cold=cold, hot=hot, prefetch=prefetch,
                         node_dp_ranks=range(dp_size), pin_window=2)


def _reader(store, directory, dp_rank, dp_size, budget_shards, count, queue):
    it = _node_batches(store, directory, dp_rank=dp_rank, dp_size=dp_size, budget_shards=budget_shards)
    rows = [next(it)[0].numpy() for _ in range(count)]
    it.close()
    queue.put((dp_rank, rows, it.figures()))


def _run_readers(store, directory, *, dp_size, budget_shards, count, watch=None):
    """Run ``dp_size`` reader processes to the end; ``watch()`` is called while they run."""
    queue = FORK.Queue()
    procs = [FORK.Process(target=_reader, args=(store, directory, r, dp_size, budget_shards, count, queue))
             for r in range(dp_size)]
    for p in procs:
        p.start()
    results = {}
    while len(results) < dp_size:
        if watch is not None:
            watch()
        try:
            r, rows, figures = queue.get(timeout=0.01 if watch else 60)
            results[r] = (rows, figures)
        except Exception:
            assert all(p.exitcode in (None, 0) for p in procs), [p.exitcode for p in procs]
    for p in procs:
        p.join()
        assert p.exitcode == 0
    return results


def _listing(directory, store):
    """(resident shard files, shards resident or reserved, other dot files), under the
    directory's lock, so no reservation or eviction happens meanwhile."""
    files = {store.shard_name(s).replace("/", "__"): s for s in range(len(store.shards))}
    with _flock(os.path.join(directory, ".locks", ".dir"), fcntl.LOCK_EX):
        names = os.listdir(directory)
        resident = {n: os.path.getsize(os.path.join(directory, n)) for n in names if n in files}
    reserved = {files[n[1:-len(".reserved")]] for n in names if n.endswith(".reserved")}
    others = [n for n in names if n.startswith(".") and n not in (".locks", ".counters.json")]
    return resident, {files[n] for n in resident} | reserved, others


@pytest.mark.timeout(120)
def test_node_readers_read_direct_rows_and_fetch_each_shard_once(tmp_path):
    store = _store(tmp_path)
    directory = node_directory(str(tmp_path / "hot"), store)
    count = 2 * _order(store, 3).steps_per_epoch                  # two epochs: every shard used twice
    results = _run_readers(store, directory, dp_size=3, budget_shards=len(store.shards), count=count)
    for r, (rows, _) in results.items():
        for got, want in zip(rows, _direct(store, r, 3, count)):
            np.testing.assert_array_equal(got, want)
    resident, _, others = _listing(directory, store)
    assert others == []                                            # no temporary file or reservation left
    assert len(resident) == len(store.shards)                      # the budget held all: nothing evicted
    fetched = sum(f["bytes_fetched"] for _, f in results.values())
    assert fetched == sum(resident.values()) == sum(store.shard_bytes(s) for s in range(len(store.shards)))
    with open(os.path.join(directory, ".counters.json")) as f:
        counters = json.load(f)
    assert counters["bytes_fetched"] == fetched
    assert counters["hits"] + counters["misses"] == sum(f["hits"] + f["misses"] for _, f in results.values())
    figures = results[0][1]
    assert figures["scope"] == "node" and figures["budget_bytes"] == len(store.shards) * store.shard_bytes(0)
    assert figures["node_dp_ranks"] == [0, 1, 2] and figures["node_resident_bytes"] == fetched


@pytest.mark.timeout(120)
def test_the_node_budget_is_never_exceeded(tmp_path):
    store = _store(tmp_path, rows_per_shard=8)
    directory = node_directory(str(tmp_path / "hot"), store)
    budget = 6 * store.shard_bytes(0)
    count = _order(store, 3).steps_per_epoch
    samples = []

    def watch():
        if os.path.isdir(os.path.join(directory, ".locks")):
            resident, held, _ = _listing(directory, store)
            samples.append((sum(resident.values()), sum(store.shard_bytes(s) for s in held)))

    results = _run_readers(store, directory, dp_size=3, budget_shards=6, count=count, watch=watch)
    assert samples and max(b for b, _ in samples) <= budget and max(h for _, h in samples) <= budget, samples
    for r, (rows, _) in results.items():
        for got, want in zip(rows, _direct(store, r, 3, count)):
            np.testing.assert_array_equal(got, want)
    # 3 readers x 4 shards a micro-batch can touch, under 6: they had to evict each other's
    assert sum(f["bytes_fetched"] for _, f in results.values()) > len(store.shards) * store.shard_bytes(0)


class _StallingCold(ColdTier):
    """A cold tier whose copies stop for good after the first 128 bytes (a reader
    killed then is killed mid-fetch, however loaded the machine)."""

    def copy_to(self, name, dest, *, chunk=128):
        return super().copy_to(name, dest, chunk=chunk)

    def _pace(self, nbytes):
        super()._pace(nbytes)
        if self.bytes_read > 128:
            time.sleep(3600)


def _stalled_reader(store, directory):
    it = _node_batches(store, directory, dp_rank=0, dp_size=2, budget_shards=6, cold=_StallingCold(store.root),
                       prefetch=False)
    next(it)


@pytest.mark.timeout(120)
def test_a_reader_killed_mid_fetch_leaves_no_shard_and_the_next_one_recovers(tmp_path):
    store = _store(tmp_path)
    directory = node_directory(str(tmp_path / "hot"), store)
    first = int(_order(store, 2).shard_of(_order(store, 2).rows(0, 0)).min())     # the first one fetched
    name = store.shard_name(first).replace("/", "__")
    proc = FORK.Process(target=_stalled_reader, args=(store, directory))
    proc.start()
    reservation = os.path.join(directory, f".{name}.reserved")
    while not (os.path.exists(reservation) and any(n.startswith(f".{name}.") and n.endswith(".tmp")
                                                   for n in os.listdir(directory))):
        assert proc.is_alive()
        time.sleep(0.01)
    os.kill(proc.pid, signal.SIGKILL)
    proc.join()
    assert proc.exitcode == -signal.SIGKILL
    assert not os.path.exists(os.path.join(directory, name))       # no half shard under the final name
    assert os.path.exists(reservation)                              # what the dead reader left

    it = _node_batches(store, directory, dp_rank=0, dp_size=2, budget_shards=6, prefetch=False)
    count = 4
    for got, want in zip([next(it)[0].numpy() for _ in range(count)], _direct(store, 0, 2, count)):
        np.testing.assert_array_equal(got, want)
    resident, _, others = _listing(directory, store)
    assert others == [] and resident[name] == store.shard_bytes(first)
    assert it.figures()["bytes_fetched"] == sum(resident.values())


def _section(tmp_path, store, scope):
    data = DataSection(source="unused", pipeline="tiered", hot_dir=str(tmp_path / f"hot-{scope}"), hot_scope=scope,
                       hot_budget_mb=20 * store.shard_bytes(0) / 1e6, shuffle_window=2)
    data.check("seekspeed.data")
    return types.SimpleNamespace(data=data, train=types.SimpleNamespace(seed=7))


@pytest.mark.timeout(60)
def test_hot_scope_rank_is_the_per_rank_tier_and_node_shares_one(tmp_path):
    from ds_ext.data.feed import tiered_batches
    store = _store(tmp_path)
    store = ShardSet(tmp_path / "cold", [store], [1.0])             # what the trainer opens
    layout = types.SimpleNamespace(data_parallel=2, micro_batch=3, grad_accum=4)
    rank = tiered_batches(_section(tmp_path, store, "rank"), layout, store, dp_rank=1, stage=0,
                           node_dp_ranks=[0, 1])
    assert type(rank.hot) is HotTier and rank.hot.dir == str(tmp_path / "hot-rank" / "dp1-stage0")
    assert rank.node_dp_ranks == (1,) and rank.pin_window == 0 and rank.figures()["scope"] == "rank"
    node = tiered_batches(_section(tmp_path, store, "node"), layout, store, dp_rank=1, stage=0,
                           node_dp_ranks=[0, 1])
    assert type(node.hot) is NodeHotTier and node.hot.dir == node_directory(str(tmp_path / "hot-node"), store)
    assert node.node_dp_ranks == (0, 1) and node.pin_window == 4
    ref = TieredBatches(store, rank.order, dp_rank=1, cold=ColdTier(store.root))
    for _ in range(2 * rank.order.steps_per_epoch):
        want = next(ref)[0]
        assert np.array_equal(next(rank)[0], want) and np.array_equal(next(node)[0], want)
    rank.close()
    node.close()
    with pytest.raises(ConfigError, match="hot_scope 'disk' is not one of"):
        DataSection(hot_scope="disk").check("seekspeed.data")


@pytest.mark.timeout(60)
def test_node_directories_are_per_store_and_a_wrong_size_file_is_replaced(tmp_path):
    a, b = _store(tmp_path), _store(tmp_path, rows_per_shard=8)
    assert node_directory("/hot", a) != node_directory("/hot", b)
    directory = node_directory(str(tmp_path / "hot"), a)
    it = _node_batches(a, directory, dp_rank=0, dp_size=1, budget_shards=6, prefetch=False)
    first = int(it.order.shard_of(it.order.rows(0, 0)).min())
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, a.shard_name(first).replace("/", "__")), "wb") as f:
        f.write(b"not a shard")
    np.testing.assert_array_equal(next(it)[0].numpy(), _direct(a, 0, 1, 1)[0])
    assert it.figures()["misses"] >= 1 and it.figures()["bytes_fetched"] >= a.shard_bytes(first)


@pytest.mark.timeout(60)
def test_the_node_readers_come_from_the_topology_plan():
    """2 stages x 2 replicas on 2 nodes of 2 ranks: with pipe-data numbering a node holds
    both replicas of one stage, with data-pipe both stages of one replica."""
    from ds_ext.data.feed import node_dp_ranks
    plan = types.SimpleNamespace(layout=types.SimpleNamespace(pipe_stages=2, data_parallel=2),
                                 data_stages=frozenset({0, 1}))
    for placement, want in (("pipe-data", [[0, 1], [0, 1]]), ("data-pipe", [[0], [1]])):
        topo = types.SimpleNamespace(placement=placement, node_of=[0, 0, 1, 1])
        assert [node_dp_ranks(plan, topo, rank=r) for r in (0, 2)] == want
    plan.data_stages = frozenset({0})                   # only stage 0 reads: node 1 of pipe-data reads nothing
    topo = types.SimpleNamespace(placement="pipe-data", node_of=[0, 0, 1, 1])
    assert node_dp_ranks(plan, topo, rank=2) == []

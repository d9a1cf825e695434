"""The tiered data pipeline (ds_ext/data/store.py, order.py, tiers.py), single process.

Packed shards built once and reused, rebuilt (never reused) when a setting they
depend on changes; a failed build leaves nothing that looks complete. The sample
order: every row once per epoch across the data-parallel ranks, different epochs
differ, and the micro-batches are identical whatever the tiering (direct cold reads,
LRU, next-use with prefetch, budgets) and whether the run was resumed mid-epoch.
Next-use eviction fetches fewer bytes than LRU under the same budget. A mixture
keeps its weights in every stretch of the order (a small source repeats its own
epochs) and its batches are the same through the tiers. A cold tier
that disappears is retried with back-off, then reported naming the path. Bad input
(empty documents, undecodable bytes, too little data) fails in one line and leaves
no cache behind. Undecodable bytes under data.encoding_errors "replace" and "skip"
(the documents counted in index.json, one cache per setting), "strict" failing with
file:line without touching the caches in place, as launch/prepare_data.py reports
them; a failed rebuild leaves the cache it would replace.
A few seconds."""

import json
import os
import shutil

import numpy as np
import pytest
import torch

from ds_ext.config import DataSection
from ds_ext.data import ByteTokenizer
from ds_ext.data.order import SampleOrder
from ds_ext.data.build import build
from ds_ext.data.store import cache_key
from ds_ext.data.tiers import ColdTier, HotTier, TierStats, TieredBatches
from ds_ext.errors import DataError


def _corpus(tmp_path, n=300, name="docs.jsonl"):
    rng = np.random.default_rng(0)
    path = tmp_path / name
    if path.exists():
        return path
    with open(path, "w") as f:
        for i in range(n):
            words = " ".join(f"w{int(x)}" for x in rng.integers(0, 50, size=int(rng.integers(5, 80))))
            f.write(json.dumps({"text": f"doc {i}: {words}"}) + "\n")
    return path


def _data(path, **kw):
    return DataSection(source=str(path), seq_len=31, pipeline="tiered", **kw)


def _store(tmp_path, rows_per_shard=16, **kw):
    data = _data(_corpus(tmp_path), rows_per_shard=rows_per_shard, **kw)
    return build(data, ByteTokenizer(), root=str(tmp_path / "cold"), rows_per_shard=rows_per_shard,
                 log=lambda m: None)


def test_build_packs_every_document_with_an_end_token_and_is_reused(tmp_path):
    store = _store(tmp_path)
    rows = np.concatenate([np.load(os.path.join(store.root, s["name"])) for s in store.shards])
    assert rows.shape == (store.num_rows, 32) and rows.dtype == np.uint16
    assert store.index["documents"] == 300
    # the stream is the documents' bytes with 256 after each, cut into rows
    text = [json.loads(line)["text"] for line in open(tmp_path / "docs.jsonl")]
    stream = np.concatenate([np.frombuffer(t.encode(), np.uint8).astype(np.uint16).tolist() + [256] for t in text])
    np.testing.assert_array_equal(rows.reshape(-1), stream[:rows.size])
    mtime = os.path.getmtime(os.path.join(store.root, "index.json"))
    again = _store(tmp_path)
    assert again.root == store.root and os.path.getmtime(os.path.join(again.root, "index.json")) == mtime


def test_other_settings_are_rebuilt_never_reused(tmp_path):
    a = _store(tmp_path)
    b = _store(tmp_path, rows_per_shard=8)
    assert a.root != b.root
    data = _data(tmp_path / "docs.jsonl", rows_per_shard=16)
    with open(tmp_path / "docs.jsonl", "a") as f:                 # the corpus changed
        f.write(json.dumps({"text": "one more document"}) + "\n")
    assert cache_key(data, ByteTokenizer(), rows_per_shard=16)[1] != os.path.basename(a.root)
    # a cache whose index disagrees with its directory's settings is rebuilt in place
    settings, key = cache_key(data, ByteTokenizer(), rows_per_shard=16)
    bogus = tmp_path / "cold" / key
    bogus.mkdir()
    (bogus / "index.json").write_text(json.dumps({"settings": {"other": 1}}))
    rebuilt = build(data, ByteTokenizer(), root=str(tmp_path / "cold"), rows_per_shard=16, log=lambda m: None)
    assert rebuilt.root == str(bogus) and rebuilt.index["documents"] == 301


def test_a_failed_build_leaves_nothing_that_looks_complete(tmp_path):
    class Exploding(ByteTokenizer):
        def encode_documents(self, texts):
            raise DataError("tokenizer broke")
    with pytest.raises(Exception, match="tokenizer broke"):
        build(_data(_corpus(tmp_path)), Exploding(), root=str(tmp_path / "cold"), rows_per_shard=16,
              log=lambda m: None)
    assert [n for n in os.listdir(tmp_path / "cold") if not n.startswith(".")] == []
    assert not any(n.startswith(".building") for n in os.listdir(tmp_path / "cold"))


def test_every_row_once_per_epoch_across_ranks():
    order = SampleOrder([16] * 9 + [5], seed=3, window=3, dp_size=3, micro_batch=4)
    assert order.num_rows == 149 and order.steps_per_epoch == 149 // 12
    # the steps' rows, replica after replica, are the stream of epochs: 25 steps = 300 rows
    seen = np.concatenate([order.rows(m, r) for m in range(25) for r in range(3)])
    for epoch in range(2):
        assert np.array_equal(seen[149 * epoch:149 * (epoch + 1)], order.epoch(epoch))
        assert np.array_equal(np.sort(order.epoch(epoch)), np.arange(149))
    assert np.array_equal(seen[298:], order.epoch(2)[:2])
    assert not np.array_equal(order.epoch(0), order.epoch(1))
    # a window of the order touches at most `window` shards
    even = SampleOrder([16] * 9, seed=3, window=3, dp_size=3, micro_batch=4)
    for w in range(3):
        assert len(np.unique(even.shard_of(even.epoch(0)[48 * w:48 * (w + 1)]))) == 3


def test_a_resume_with_another_layout_continues_at_the_next_row():
    """3 replicas x micro-batch 4 for 7 steps, then 2 x 3 from the rows consumed (as a
    resume on fewer ranks seeks to DeepSpeed's global_samples): every row of the
    stream exactly once, in order, across the change and the end of the epoch."""
    before = SampleOrder([16] * 9 + [5], seed=3, window=3, dp_size=3, micro_batch=4)
    seen = [before.rows(m, r) for m in range(7) for r in range(3)]
    after = SampleOrder([16] * 9 + [5], seed=3, window=3, dp_size=2, micro_batch=3, start_row=7 * 12)
    seen += [after.rows(m, r) for m in range(40) for r in range(2)]
    seen = np.concatenate(seen)
    assert len(seen) == 84 + 240
    assert np.array_equal(seen, before.at(np.arange(len(seen))))
    assert len(set(seen[:149].tolist())) == 149 and len(set(seen[149:298].tolist())) == 149


def test_seek_moves_a_tiered_reader_to_another_row(tmp_path):
    store = _store(tmp_path)
    one = _batches(store, tmp_path, "next-use", dp_size=1)        # its own hot directory, no prefetch thread
    seq = [next(one)[0] for _ in range(12)]              # micro-batches of 3 rows, one replica
    one.close()
    for rank in range(2):
        two = _batches(store, tmp_path, "next-use+prefetch", dp_rank=rank, dp_size=2)
        next(two)
        two.seek(5 * 3)                                  # after 5 micro-batches of the single replica
        for m in range(3):                               # replica r at m reads micro-batch 5 + 2 m + r of one
            assert torch.equal(next(two)[0], seq[5 + 2 * m + rank])
        two.close()


def _batches(store, tmp_path, mode, *, dp_rank=0, dp_size=2, budget_shards=5, start=0, cold=None):
    order = SampleOrder([s["rows"] for s in store.shards], seed=7, window=2, dp_size=dp_size, micro_batch=3)
    cold = cold or ColdTier(store.root)
    hot = None
    if mode != "direct":
        hot = HotTier(store, cold, str(tmp_path / f"hot-{mode}-{dp_rank}-{start}"),
                      budget_bytes=budget_shards * store.shard_bytes(0), policy=mode.split("+")[0],
                      stats=TierStats(), min_shards=2)
    it = TieredBatches(store, order, dp_rank=dp_rank, cold=cold, hot=hot, prefetch=mode.endswith("+prefetch"))
    it.position = start
    return it


def test_a_large_hot_tier_keeps_few_files_open(tmp_path):
    """Every resident shard is memory-mapped when read, and each map holds a descriptor:
    a budget of thousands of shards must not reach the process's descriptor limit (with
    one map per resident shard this run held 404 descriptors)."""
    store = _store(tmp_path, rows_per_shard=4)
    it = _batches(store, tmp_path, "next-use", dp_size=1, budget_shards=len(store.shards))
    open_fds = lambda: len(os.listdir("/proc/self/fd"))
    before = open_fds()
    for _ in range(it.order.steps_per_epoch):                   # every shard, all of them resident
        next(it)
    assert len(it.hot._resident) > 4 * it.hot.max_open, (len(it.hot._resident), it.hot.max_open)
    assert open_fds() - before <= it.hot.max_open


@pytest.mark.parametrize("mode", ["lru", "next-use", "next-use+prefetch"])
def test_tiers_never_change_the_batches(tmp_path, mode):
    store = _store(tmp_path)
    n = 2 * SampleOrder([s["rows"] for s in store.shards], seed=7, window=2, dp_size=2,
                        micro_batch=3).steps_per_epoch + 5        # into the third epoch
    for rank in range(2):
        ref = _batches(store, tmp_path, "direct", dp_rank=rank)
        tiered = _batches(store, tmp_path, mode, dp_rank=rank)
        for _ in range(n):
            a, b = next(ref), next(tiered)
            assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
        tiered.close()
        assert tiered.figures()["hits"] > 0


def test_resume_mid_epoch_continues_exactly(tmp_path):
    store = _store(tmp_path)
    full = _batches(store, tmp_path, "next-use+prefetch")
    seq = [next(full)[0] for _ in range(20)]
    full.close()
    resumed = _batches(store, tmp_path, "next-use+prefetch", start=11)
    for m in range(11, 20):
        assert torch.equal(next(resumed)[0], seq[m])
    resumed.close()


def test_next_use_fetches_fewer_bytes_than_lru(tmp_path):
    store = _store(tmp_path, rows_per_shard=8)
    fetched = {}
    for mode in ("lru", "next-use"):
        it = _batches(store, tmp_path, mode, dp_size=1, budget_shards=6)
        for _ in range(3 * it.order.steps_per_epoch):               # three epochs: reuse across epochs matters
            next(it)
        fetched[mode] = it.figures()["bytes_fetched"]
    assert fetched["next-use"] < fetched["lru"], fetched


def test_a_vanishing_cold_tier_is_retried_then_named(tmp_path):
    store = _store(tmp_path)
    moved = str(tmp_path / "elsewhere")
    it = _batches(store, tmp_path, "lru", cold=ColdTier(store.root, retries=2, backoff_s=0.01))
    next(it)
    shutil.move(store.root, moved)
    with pytest.raises(DataError, match=r"cold tier: cannot read .*shard_\d+\.npy .* after 3 tries"):
        for _ in range(200):
            next(it)
    shutil.move(moved, store.root)


def test_bad_input_fails_in_one_line(tmp_path):
    nothing = tmp_path / "nothing.jsonl"
    nothing.write_text("")
    with pytest.raises(DataError, match="every data file is empty"):
        build(_data(nothing), ByteTokenizer(), root=str(tmp_path / "c0"), rows_per_shard=4, log=lambda m: None)
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    (mixed / "a.jsonl").write_text("")
    shutil.copy(_corpus(tmp_path), mixed / "b.jsonl")
    assert build(_data(mixed), ByteTokenizer(), root=str(tmp_path / "c0"), rows_per_shard=4,
                 log=lambda m: None).index["documents"] == 300           # the empty file is passed over
    empty = tmp_path / "empty.jsonl"
    empty.write_text(json.dumps({"text": ""}) + "\n" + json.dumps({"text": ""}) + "\n")
    with pytest.raises(DataError, match="no non-empty documents"):
        build(_data(empty), ByteTokenizer(), root=str(tmp_path / "c1"), rows_per_shard=4, log=lambda m: None)
    short = tmp_path / "short.jsonl"
    short.write_text(json.dumps({"text": "tiny"}) + "\n")
    with pytest.raises(DataError, match="fewer than one sequence"):
        build(_data(short), ByteTokenizer(), root=str(tmp_path / "c2"), rows_per_shard=4, log=lambda m: None)
    assert not os.listdir(tmp_path / "c2")                          # nothing half-built left behind
    raw = tmp_path / "latin1"
    raw.mkdir()
    (raw / "a.txt").write_bytes("caf\xe9 ".encode("latin-1") * 40)  # not UTF-8
    (raw / "b.txt").write_bytes(b"plain ascii text " * 10)
    with pytest.raises(DataError, match=r"latin1/a\.txt:1: byte 0xe9 at column 4 is not UTF-8"):
        build(DataSection(source=str(raw), seq_len=15, pipeline="tiered"), ByteTokenizer(),
              root=str(tmp_path / "c3"), rows_per_shard=4, log=lambda m: None)
    assert not os.listdir(tmp_path / "c3")


def _mixture(tmp_path):
    from ds_ext.config import MixtureSource
    from ds_ext.data.build import build_all
    big = _corpus(tmp_path, n=300, name="big.jsonl")
    small = _corpus(tmp_path, n=40, name="small.jsonl")
    data = DataSection(source="unused", seq_len=31, pipeline="tiered", rows_per_shard=16,
                       mixture=[MixtureSource(source=str(big), weight=1.0), MixtureSource(source=str(small), weight=1.0)])
    return build_all(data, ByteTokenizer(), root=str(tmp_path / "cold"), rows_per_shard=16, log=lambda m: None)


def test_mixture_weights_hold_in_every_stretch_and_a_small_source_repeats(tmp_path):
    shards = _mixture(tmp_path)
    src = np.asarray(shards.source_of_shard)
    order = SampleOrder([s["rows"] for s in shards.shards], seed=5, window=2, dp_size=1, micro_batch=4,
                        sources=src, weights=shards.weights)
    sizes = [int(sum(s["rows"] for s, k in zip(shards.shards, src) if k == i)) for i in range(2)]
    assert sizes[1] < sizes[0] // 4                       # the small source is much smaller ...
    assert order.counts == [round(order.num_rows / 2), round(order.num_rows / 2)]   # ... yet half of every epoch
    rows = order.epoch(0)
    from_small = src[order.shard_of(rows)] == 1
    for stretch in range(0, len(rows) - 100, 100):       # even interleave: 50 +- 1 of every 100
        assert abs(int(from_small[stretch:stretch + 100].sum()) - 50) <= 1
    small_rows = rows[from_small]
    first = small_rows[:sizes[1]]                         # its own epoch: every row of it once, then again
    assert len(set(first.tolist())) == sizes[1]
    assert set(small_rows[sizes[1]:2 * sizes[1]].tolist()) == set(first.tolist())


def test_tiers_never_change_mixture_batches(tmp_path):
    shards = _mixture(tmp_path)
    order = lambda: SampleOrder([s["rows"] for s in shards.shards], seed=5, window=2, dp_size=2, micro_batch=3,
                                sources=shards.source_of_shard, weights=shards.weights)
    ref = TieredBatches(shards, order(), dp_rank=1, cold=ColdTier(shards.root))
    hot = HotTier(shards, ColdTier(shards.root), str(tmp_path / "hot"), budget_bytes=9 * shards.shard_bytes(0),
                  policy="next-use", stats=TierStats(), min_shards=4)
    tiered = TieredBatches(shards, order(), dp_rank=1, cold=hot.cold, hot=hot, prefetch=True)
    for _ in range(2 * ref.order.steps_per_epoch):
        a, b = next(ref), next(tiered)
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    tiered.close()


def test_prepare_data_builds_the_cache_a_job_then_finds(tmp_path):
    import subprocess
    import sys
    from ds_ext.data.store import open_all
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "ds_configs", "tiny_cpu.json")) as f:
        cfg = json.load(f)
    cfg["seekspeed"]["data"].update(source=str(_corpus(tmp_path)), seq_len=31, pipeline="tiered",
                                    cache_dir=str(tmp_path / "cold"), rows_per_shard=16)
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps(cfg))
    run = lambda: subprocess.run([sys.executable, os.path.join(root, "launch", "prepare_data.py"), "--deepspeed",
                                  str(path)], capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=root))
    first = run()
    assert first.returncode == 0 and "ready:" in first.stdout and "packed 300 documents" in first.stdout, \
        first.stdout + first.stderr
    data = DataSection(source=str(tmp_path / "docs.jsonl"), seq_len=31, pipeline="tiered", rows_per_shard=16)
    found = open_all(data, ByteTokenizer(), root=str(tmp_path / "cold"), rows_per_shard=16)
    assert found is not None and found.index["documents"] == 300
    second = run()
    assert second.returncode == 0 and "packed" not in second.stdout         # found, not rebuilt
    cfg["seekspeed"]["data"]["pipeline"] = "memory"
    path.write_text(json.dumps(cfg))
    bad = run()
    assert bad.returncode == 2 and bad.stderr.strip().startswith("error: ") and len(bad.stderr.strip().splitlines()) == 1


def test_a_hot_budget_too_small_for_one_micro_batch_is_refused_up_front(tmp_path):
    store = _store(tmp_path)
    with pytest.raises(DataError, match="holds fewer than 5 shards"):     # 2 windows of 2 shards, plus one
        HotTier(store, ColdTier(store.root), str(tmp_path / "hot"), budget_bytes=4 * store.shard_bytes(0),
                policy="next-use", stats=TierStats(), min_shards=2)


def _undecodable_corpus(tmp_path):
    """300 documents, 3 of them with a byte that is not UTF-8."""
    path = tmp_path / "mixed.jsonl"
    lines = open(_corpus(tmp_path), "rb").read().splitlines(keepends=True)
    for i in (10, 150, 299):
        lines[i] = lines[i].replace(b"doc", b"d\xf6c", 1)
    path.write_bytes(b"".join(lines))
    return path, [json.loads(l.decode(errors="replace"))["text"] for l in lines], (10, 150, 299)


def _cache_listing(root):
    return sorted((d, f, os.path.getmtime(os.path.join(root, d, f))) for d in os.listdir(root)
                  for f in os.listdir(os.path.join(root, d)))


def test_undecodable_bytes_under_each_setting_and_the_cache_key(tmp_path):
    path, docs, bad = _undecodable_corpus(tmp_path)
    root = str(tmp_path / "cold")
    built = {}
    for mode in ("replace", "skip"):
        store = build(_data(path, encoding_errors=mode), ByteTokenizer(), root=root, rows_per_shard=16,
                      log=lambda m: None)
        rows = np.concatenate([np.load(os.path.join(store.root, s["name"])) for s in store.shards]).reshape(-1)
        kept = docs if mode == "replace" else [d for i, d in enumerate(docs) if i not in bad]
        stream = np.concatenate([list(d.encode()) + [256] for d in kept])
        np.testing.assert_array_equal(rows, stream[:rows.size])
        assert store.index["documents"] == len(kept)
        assert (store.index["replaced_documents"], store.index["skipped_documents"]) == \
            ((3, 0) if mode == "replace" else (0, 3))
        built[mode] = store.root
    assert "\ufffd" in docs[10] and built["replace"] != built["skip"]       # one cache per setting
    keys = {mode: cache_key(_data(path, encoding_errors=mode), ByteTokenizer(), rows_per_shard=16)[1]
            for mode in ("strict", "replace", "skip")}
    assert len(set(keys.values())) == 3 and os.path.basename(built["skip"]) == keys["skip"]
    # strict: one line naming file:line and the fix; no cache left behind, the others untouched
    before = _cache_listing(root)
    with pytest.raises(DataError) as exc:
        build(_data(path), ByteTokenizer(), root=root, rows_per_shard=16, log=lambda m: None)
    assert "mixed.jsonl:11: byte 0xf6 at column 12 is not UTF-8" in str(exc.value)
    assert 'set seekspeed.data.encoding_errors to "replace"' in str(exc.value)
    assert _cache_listing(root) == before and not any(n.startswith(".") for n in os.listdir(root))
    # a mixture source has its own setting, or data's
    from ds_ext.config import MixtureSource
    data = DataSection(source="unused", pipeline="tiered", encoding_errors="skip",
                       mixture=[MixtureSource(source=str(path)), MixtureSource(source=str(path), encoding_errors="replace")])
    assert [s.encoding_errors for s, _ in data.sources()] == ["skip", "replace"]


def test_a_failed_rebuild_never_damages_the_cache_in_place(tmp_path):
    """A cache whose index disagrees is replaced only once its rebuild is complete: a
    rebuild that fails (here: the corpus gained an undecodable line, strict) leaves it."""
    store = _store(tmp_path)
    with open(os.path.join(store.root, "index.json")) as f:
        index = json.load(f)
    index["settings"]["stale"] = True
    with open(os.path.join(store.root, "index.json"), "w") as f:
        json.dump(index, f)
    before = _cache_listing(str(tmp_path / "cold"))

    class Failing(ByteTokenizer):
        def encode_documents(self, texts):
            raise DataError("the rebuild failed")
    with pytest.raises(DataError, match="the rebuild failed"):
        build(_data(_corpus(tmp_path), rows_per_shard=16), Failing(), root=str(tmp_path / "cold"),
              rows_per_shard=16, log=lambda m: None)
    assert _cache_listing(str(tmp_path / "cold")) == before
    assert not any(n.startswith(".") for n in os.listdir(tmp_path / "cold"))
    rebuilt = build(_data(_corpus(tmp_path), rows_per_shard=16), ByteTokenizer(), root=str(tmp_path / "cold"),
                    rows_per_shard=16, log=lambda m: None)
    assert rebuilt.root == store.root and "stale" not in rebuilt.index["settings"]


def test_prepare_data_reports_the_undecodable_documents(tmp_path, capsys):
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sys.path.insert(0, os.path.join(root, "launch"))
    try:
        import prepare_data
    finally:
        sys.path.pop(0)
    path, _, _ = _undecodable_corpus(tmp_path)
    with open(os.path.join(root, "ds_configs", "tiny_cpu.json")) as f:
        cfg = json.load(f)
    cfg["seekspeed"]["data"].update(source=str(path), seq_len=31, pipeline="tiered", encoding_errors="replace",
                                    cache_dir=str(tmp_path / "cold"), rows_per_shard=16)
    (tmp_path / "cfg.json").write_text(json.dumps(cfg))
    assert prepare_data.main(["--deepspeed", str(tmp_path / "cfg.json")]) == 0
    out = capsys.readouterr().out
    assert "(300 documents, 51,680 tokens; 3 documents with bytes that are not UTF-8 decoded with U+FFFD)" in out, out
    cfg["seekspeed"]["data"]["encoding_errors"] = "strict"
    (tmp_path / "cfg.json").write_text(json.dumps(cfg))
    assert prepare_data.main(["--deepspeed", str(tmp_path / "cfg.json")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    # one error line, last, and no traceback (datatrove's own progress lines may come before it)
    assert [l for l in err if l.startswith("error:")] == err[-1:] and "Traceback" not in "\n".join(err)
    assert err[-1].startswith("error: seekspeed.data.source ") and "mixed.jsonl:11:" in err[-1]


def test_read_ahead_takes_the_read_off_the_step_and_never_changes_the_batches(tmp_path):
    """With prefetch, the next ``prefetch_batches`` micro-batches are assembled while the
    consumer computes: a pull after a step's worth of time finds its batch ready (here
    direct reads of a cold tier that takes 100 ms a request, 3 or more per batch), and
    the batches, a set ``position`` and a ``seek`` are exactly those without read-ahead."""
    import time
    store = _store(tmp_path)
    order = lambda: SampleOrder([s["rows"] for s in store.shards], seed=7, window=2, dp_size=2, micro_batch=3)
    plain = TieredBatches(store, order(), dp_rank=1, cold=ColdTier(store.root), prefetch=False)
    ahead = TieredBatches(store, order(), dp_rank=1, cold=ColdTier(store.root, latency_ms=100), prefetch=True,
                          prefetch_batches=2)
    assert plain._assembler is None and ahead._assembler is not None
    want = [next(plain) for _ in range(6)]
    plain.position = 2
    want_at_2 = next(plain)
    plain.seek(9)
    want_after_seek = [next(plain) for _ in range(2)]
    got, pulls = [], []
    for _ in range(6):
        t = time.perf_counter()
        got.append(next(ahead))
        pulls.append(time.perf_counter() - t)
        time.sleep(1.0)                                       # the "step": two batches' reads fit in it
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(got, want))
    assert pulls[0] >= 0.1 and max(pulls[1:]) < 0.05, pulls  # only the first pull reads
    ahead.position = 2
    assert torch.equal(next(ahead)[0], want_at_2[0])
    ahead.seek(9)
    assert all(torch.equal(next(ahead)[0], w[0]) for w in want_after_seek)
    ahead.close()
    plain.close()


def test_a_read_ahead_failure_reaches_the_consumer(tmp_path):
    store = _store(tmp_path)
    order = SampleOrder([s["rows"] for s in store.shards], seed=7, window=2, dp_size=1, micro_batch=3)
    it = TieredBatches(store, order, dp_rank=0, cold=ColdTier(store.root, retries=0), prefetch=True)
    next(it)
    shutil.rmtree(store.root)                                 # the cold tier is gone while reading ahead
    with pytest.raises(DataError, match="cold"):
        for _ in range(order.steps_per_epoch):
            next(it)
    it.close()


def test_prefetch_batches_must_not_be_negative():
    from ds_ext.errors import ConfigError
    with pytest.raises(ConfigError, match="prefetch_batches must be >= 0"):
        _data("x.jsonl", prefetch_batches=-1).check("seekspeed.data")

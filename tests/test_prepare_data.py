"""Building the packed cache in parts on datatrove's executors (launch/prepare_data.py,
ds_ext/data/parts.py, prepare.py, store.py).

The parts depend only on the data and data.part_mb: every JSON line lands in exactly
one part (a big file cut in byte ranges, small files grouped), and the shards, and so
the training order, are identical with 1, 2 and 3 tasks on the local executor, with 3
tasks on a local Ray instance of 2 workers, and built in-process the way rank 0 does.
A task that died is rerun alone: the completed tasks are skipped and their parts left
untouched, a half-written part is discarded. A missing executor package or an absent
sbatch is named in one line with the fix; parquet and saved datasets stream into the
packer with the same rows as one pass over the documents. About 40 s (the Ray test
starts a local Ray instance, ~10 s).
"""

import json
import os
import sys

import numpy as np
import pytest

from ds_ext.config import DataSection
from ds_ext.data import ByteTokenizer
from ds_ext.data.order import SampleOrder
from ds_ext.data.build import build
from ds_ext.data.store import BuildPlan

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "launch"))
import prepare_data  # noqa: E402

sys.path.pop(0)

PART_MB = 0.02          # about 21 KB per part: the big file is cut in several, the small ones grouped


def _corpus(directory):
    """Three JSON Lines files (one of ~80 KB, two of ~8 KB) of numbered documents."""
    if directory.exists():
        return directory
    directory.mkdir()
    rng = np.random.default_rng(0)
    number = 0
    for name, n in (("a.jsonl", 400), ("b.jsonl", 40), ("c.jsonl", 40)):
        with open(directory / name, "w") as f:
            for _ in range(n):
                words = " ".join(f"w{int(x)}" for x in rng.integers(0, 50, size=int(rng.integers(5, 60))))
                f.write(json.dumps({"text": f"doc {number}: {words}"}) + "\n")
                number += 1
    return directory


def _config(tmp_path, cache, **data):
    with open(os.path.join(ROOT, "ds_configs", "tiny_cpu.json")) as f:
        cfg = json.load(f)
    cfg["seekspeed"]["data"].update(source=str(_corpus(tmp_path / "corpus")), seq_len=31, pipeline="tiered",
                                    cache_dir=str(cache), rows_per_shard=16, part_mb=PART_MB, **data)
    path = tmp_path / f"cfg-{cache.name}.json"
    path.write_text(json.dumps(cfg))
    return path


def _section(tmp_path, **kw):
    return DataSection(source=str(_corpus(tmp_path / "corpus")), seq_len=31, pipeline="tiered", rows_per_shard=16,
                       part_mb=PART_MB, **kw)


def _shards(root):
    (key,) = [d for d in os.listdir(root) if not d.startswith(".")]
    with open(os.path.join(root, key, "index.json")) as f:
        index = json.load(f)
    return key, index, [np.load(os.path.join(root, key, s["name"])) for s in index["shards"]]


def _same_build(a, b):
    ka, ia, sa = _shards(a)
    kb, ib, sb = _shards(b)
    assert ka == kb and ia["shards"] == ib["shards"] and ia["documents"] == ib["documents"]
    assert all(np.array_equal(x, y) for x, y in zip(sa, sb))
    order = lambda index: SampleOrder([s["rows"] for s in index["shards"]], seed=1, window=2, dp_size=2,
                                      micro_batch=3)
    assert np.array_equal(order(ia).epoch(0), order(ib).epoch(0))


def test_every_line_lands_in_one_part_and_the_parts_pack_its_documents(tmp_path):
    data = _section(tmp_path)
    plan = BuildPlan(data, ByteTokenizer(), root=str(tmp_path / "cold"), rows_per_shard=16)
    sizes = {f: os.path.getsize(tmp_path / "corpus" / f) for f in ("a.jsonl", "b.jsonl", "c.jsonl")}
    assert [[(os.path.basename(p), a, b) for p, a, b in part] for part in plan.parts][-1] == \
        [("b.jsonl", 0, sizes["b.jsonl"]), ("c.jsonl", 0, sizes["c.jsonl"])]           # small files grouped
    ranges = [seg for part in plan.parts[:-1] for seg in part]
    cut = -(-sizes["a.jsonl"] // int(PART_MB * 2**20))
    assert cut > 2 and [os.path.basename(p) for p, _, _ in ranges] == ["a.jsonl"] * cut  # the big one cut
    assert ranges[0][1] == 0 and ranges[-1][2] == sizes["a.jsonl"]
    assert all(x[2] == y[1] for x, y in zip(ranges, ranges[1:]))
    store = build(data, ByteTokenizer(), root=str(tmp_path / "cold"), rows_per_shard=16, log=lambda m: None)
    assert store.index["documents"] == 480 and store.index["parts"] == cut + 1
    # each part's rows are its own documents (the lines that begin in its byte ranges) with 256 after each
    raw = open(tmp_path / "corpus" / "a.jsonl", "rb").read()
    starts = np.concatenate([[0], np.flatnonzero(np.frombuffer(raw, np.uint8) == ord("\n"))[:-1] + 1])
    for i, (_, a, b) in enumerate(ranges):
        lines = [raw[s:raw.index(b"\n", s)] for s in starts if a <= s < b]
        stream = np.concatenate([list(json.loads(l)["text"].encode()) + [256] for l in lines])
        rows = np.concatenate([np.load(os.path.join(store.root, s["name"])) for s in store.shards
                               if s["name"].startswith(f"parts/part_{i:06d}/")]).reshape(-1)
        np.testing.assert_array_equal(rows, stream[:rows.size])
        assert stream.size - rows.size < 32                                                # only a tail dropped


def test_the_shards_and_the_order_do_not_depend_on_the_task_count(tmp_path):
    for tasks in (1, 2, 3):
        cache = tmp_path / f"cold{tasks}"
        assert prepare_data.main(["--deepspeed", str(_config(tmp_path, cache)), "--tasks", str(tasks),
                                  "--workers", "2"]) == 0
    build(_section(tmp_path), ByteTokenizer(), root=str(tmp_path / "inproc"), rows_per_shard=16, log=lambda m: None)
    for other in ("cold2", "cold3", "inproc"):
        _same_build(tmp_path / "cold1", tmp_path / other)


def test_a_local_ray_cluster_of_two_workers_builds_the_same_shards(tmp_path, monkeypatch):
    import tempfile
    short = tempfile.mkdtemp(prefix="ray-", dir="/tmp")          # ray's socket paths must stay under 107 bytes
    monkeypatch.setenv("RAY_TMPDIR", short)
    monkeypatch.setenv("RAY_USAGE_STATS_ENABLED", "0")
    assert prepare_data.main(["--deepspeed", str(_config(tmp_path, tmp_path / "ray1")), "--executor", "ray",
                              "--tasks", "3", "--workers", "2"]) == 0
    build(_section(tmp_path), ByteTokenizer(), root=str(tmp_path / "inproc"), rows_per_shard=16, log=lambda m: None)
    _same_build(tmp_path / "ray1", tmp_path / "inproc")
    import shutil
    shutil.rmtree(short, ignore_errors=True)


def test_a_task_that_died_is_rerun_alone(tmp_path, capfd):
    cfg = _config(tmp_path, tmp_path / "cold")
    # tasks 0 and 1 of 3 complete; task 2 "died": nothing of it is complete, a half part is on disk
    assert prepare_data.main(["--deepspeed", str(cfg), "--tasks", "3", "--local-tasks", "2"]) == 0
    (build_dir,) = [tmp_path / "cold" / d for d in os.listdir(tmp_path / "cold")]
    assert build_dir.name.startswith(".building-") and not (build_dir / "index.json").exists()
    done = {p: os.stat(build_dir / "parts" / p).st_ino for p in os.listdir(build_dir / "parts")}
    with open(build_dir / "plan.json") as f:
        count = len(json.load(f)["parts"])
    assert count > 3 and sorted(done) == [f"part_{i:06d}" for i in range(count) if i % 3 != 2]     # task r: r, r + 3
    half = build_dir / "parts" / ".part_000002-died"
    half.mkdir()
    (half / "shard_0000.npy").write_bytes(b"\x93NUMPY half")
    capfd.readouterr()
    assert prepare_data.main(["--deepspeed", str(cfg), "--tasks", "3"]) == 0
    out, _ = capfd.readouterr()
    # datatrove skipped the completed tasks 0 and 1 (their completion files); only task 2 ran
    assert "task 2/3: part 2 (1/1) packed" in out and "task 0/3" not in out and "task 1/3" not in out, out
    key, _, _ = _shards(tmp_path / "cold")
    parts = tmp_path / "cold" / key / "parts"
    assert all(os.stat(parts / p).st_ino == ino for p, ino in done.items())               # left untouched
    assert sorted(os.listdir(parts)) == [f"part_{i:06d}" for i in range(count)]           # the half part is gone
    build(_section(tmp_path), ByteTokenizer(), root=str(tmp_path / "inproc"), rows_per_shard=16, log=lambda m: None)
    _same_build(tmp_path / "cold", tmp_path / "inproc")


def test_an_executor_that_cannot_start_is_named_in_one_line(tmp_path, monkeypatch, capsys):
    cfg = str(_config(tmp_path, tmp_path / "cold"))
    monkeypatch.setitem(sys.modules, "ray", None)          # as if ray were not installed
    assert prepare_data.main(["--deepspeed", cfg, "--executor", "ray", "--tasks", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: --executor ray needs the ray package, which is not installed: pip install 'ray==2.60.0'"]
    monkeypatch.setenv("PATH", str(tmp_path))               # no sbatch here
    assert prepare_data.main(["--deepspeed", cfg, "--executor", "slurm", "--partition", "cpu"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "sbatch, which is not on PATH" in err[0]
    assert prepare_data.main(["--deepspeed", cfg, "--executor", "slurm"]) == 2
    assert "needs --partition" in capsys.readouterr().err
    assert not any(n for n in os.listdir(tmp_path / "cold") if not n.startswith(".building-"))


@pytest.mark.parametrize("fmt", ["parquet", "saved"])
def test_parquet_and_saved_datasets_stream_into_the_packer(tmp_path, fmt):
    import datasets
    texts = [json.loads(l)["text"] for f in ("a.jsonl", "b.jsonl", "c.jsonl")
             for l in open(_corpus(tmp_path / "corpus") / f)]
    ds = datasets.Dataset.from_dict({"text": texts})
    if fmt == "parquet":
        (tmp_path / "pq").mkdir()
        for i in range(3):
            ds.select(range(i * 160, (i + 1) * 160)).to_parquet(str(tmp_path / "pq" / f"{i}.parquet"))
        source = tmp_path / "pq"
    else:
        ds.save_to_disk(str(tmp_path / "saved"))
        source = tmp_path / "saved"
    data = DataSection(source=str(source), seq_len=31, pipeline="tiered", rows_per_shard=16, part_mb=1.0)
    store = build(data, ByteTokenizer(), root=str(tmp_path / "cold"), rows_per_shard=16, log=lambda m: None)
    rows = np.concatenate([np.load(os.path.join(store.root, s["name"])) for s in store.shards]).reshape(-1)
    stream = np.concatenate([list(t.encode()) + [256] for t in texts])
    assert store.index["documents"] == 480 and store.index["parts"] == 1
    np.testing.assert_array_equal(rows, stream[:rows.size])


def test_a_megatron_dataset_is_packed_without_tokenising_and_bad_pairs_are_named(tmp_path):
    """Token ids written by megatron-core's IndexedDatasetBuilder (the writer Megatron-LM's
    preprocess_data.py drives), half the documents ending with the end-of-document id
    (--append-eod) and half not: packed as stored, the id appended where missing; the
    same shards with 1 and 2 tasks; a pair whose .bin was cut short is refused before
    anything is written."""
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder
    from ds_ext.errors import DataError
    rng = np.random.default_rng(1)
    (tmp_path / "mg").mkdir()
    docs = []
    for name in ("p0", "p1"):
        builder = IndexedDatasetBuilder(str(tmp_path / "mg" / f"{name}.bin"), dtype=np.uint16)
        for i in range(150):
            doc = rng.integers(0, 256, size=int(rng.integers(1, 90))).tolist() + ([256] if i % 2 else [])
            builder.add_document(torch.tensor(doc), [len(doc)])
            docs.append(doc if doc[-1] == 256 else doc + [256])
        builder.finalize(str(tmp_path / "mg" / f"{name}.idx"))
    for tasks in (1, 2):
        cfg = _config(tmp_path, tmp_path / f"mg{tasks}", format="megatron")
        data = json.loads(cfg.read_text())
        data["seekspeed"]["data"]["source"] = str(tmp_path / "mg")
        cfg.write_text(json.dumps(data))
        assert prepare_data.main(["--deepspeed", str(cfg), "--tasks", str(tasks), "--workers", "2"]) == 0
    _same_build(tmp_path / "mg1", tmp_path / "mg2")
    _, index, shards = _shards(tmp_path / "mg1")
    assert index["documents"] == 300
    per_part = {}
    for s, rows in zip(index["shards"], shards):
        per_part.setdefault(s["name"].split("/")[1], []).append(rows.reshape(-1))
    packed = [np.concatenate(v) for _, v in sorted(per_part.items())]
    stream = np.concatenate([np.asarray(d) for d in docs])
    assert sum(p.size for p in packed) + index["dropped_tokens"] == stream.size
    np.testing.assert_array_equal(packed[0], stream[:packed[0].size])       # the first part: as stored, in order
    # a .bin cut short: named before anything is built
    with open(tmp_path / "mg" / "p1.bin", "r+b") as f:
        f.truncate(os.path.getsize(tmp_path / "mg" / "p1.bin") - 2)
    data = DataSection(source=str(tmp_path / "mg"), format="megatron", seq_len=31, pipeline="tiered",
                       rows_per_shard=16)
    with pytest.raises(DataError, match=r"p1\.bin holds .* but p1\.idx describes"):
        build(data, ByteTokenizer(), root=str(tmp_path / "bad"), rows_per_shard=16, log=lambda m: None)
    assert not os.path.exists(tmp_path / "bad") or os.listdir(tmp_path / "bad") == []


def test_an_offline_hub_source_is_read_from_the_cache_or_named(tmp_path, monkeypatch):
    """Offline, a hub source cannot stream: the build reads the HF cache's copy by rows,
    and a dataset absent from it is named in one line. Only that error is tested: this
    machine can neither stream from the hub nor put a hub dataset in its cache."""
    import datasets
    from ds_ext.data.parts import plan_parts
    from ds_ext.errors import DataError
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    with pytest.raises(DataError, match=r"^seekspeed.data.source hub:seekspeed-test/absent:en: cannot load it from "
                                        r"the Hugging Face hub .*OfflineModeIsEnabled"):
        plan_parts(DataSection(source="hub:seekspeed-test/absent:en", pipeline="tiered"))

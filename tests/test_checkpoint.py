"""Asynchronous zstd checkpoints (ds_ext/checkpoint).

Single process: the file format round trip (dtypes, byte grouping across runs,
shared tensors, parameters, views), a snapshot that training cannot change after it
is taken, byte grouping compressing better than plain zstd, a flipped byte and a
truncated file reported with the file's name, the catalog's choice of the newest
complete checkpoint among torn, corrupt and foreign ones.
Two gloo ranks: nothing is committed until every rank has written; ``when_busy``
skip; retention; DeepSpeed's own format read by the same engine; a full disk (a 3 MB tmpfs, needs root) fails the save
cleanly with the previous checkpoint intact, per ``on_error``.
SIGKILL at random moments over 16 trials of a 2-rank job saving every step: no trial
leaves a torn checkpoint that verifies, every committed one loads with the right
contents, and the job resumes from the newest complete one.
About 90 s on 2 cores."""

import os
import random
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

from ds_ext.checkpoint import catalog, format as fmt
from tests import checkpoint_worker
from tests.distributed import free_port, run_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _sample_state():
    torch.manual_seed(0)
    shared = torch.randn(7, 3)
    param = torch.nn.Parameter(torch.randn(4, 5))
    return {
        "big": torch.randn(fmt.GROUP_ELEMENTS + 12345),           # crosses a byte-grouping run
        "bf16": torch.randn(1000).to(torch.bfloat16),
        "fp16": torch.randn(33).half(),
        "fp64": torch.randn(5, dtype=torch.float64),
        "ints": torch.arange(10, dtype=torch.int64),
        "mask": torch.tensor([True, False, True]),
        "scalar": torch.tensor(3.5),
        "empty": torch.empty(0, 4),
        "view": torch.arange(12.).reshape(3, 4).t(),                 # not contiguous
        "shared_a": shared, "shared_b": shared,
        "param": param,
        "nested": {"lr": 1e-3, "betas": (0.9, 0.95), "name": "adamw", "steps": [1, 2, 3]},
    }


def _assert_same(a, b):
    assert a.keys() == b.keys()
    for k in a:
        if torch.is_tensor(a[k]):
            assert b[k].dtype == a[k].dtype and b[k].shape == a[k].shape, k
            assert torch.equal(b[k], a[k]), k
        else:
            assert b[k] == a[k], k


@pytest.mark.parametrize("codec,byte_group", [("zstd", True), ("zstd", False), ("none", True)])
def test_round_trip(tmp_path, codec, byte_group):
    state = _sample_state()
    path = tmp_path / "f.pt"
    size, sha = fmt.write(path, fmt.snapshot(state), codec=codec, byte_group=byte_group)
    assert size == os.path.getsize(path) and sha == fmt.file_sha256(path)
    fmt.verify(path, size=size, sha256=sha)
    back = fmt.read(path)
    _assert_same(state, back)
    assert back["shared_a"] is back["shared_b"]                      # identity survives, as with torch.save
    assert isinstance(back["param"], torch.nn.Parameter) and back["param"].requires_grad


def test_snapshot_is_not_changed_by_training_afterwards(tmp_path):
    weights = torch.ones(1000)
    opts = {"lr": 0.1}
    state = {"w": weights, "opts": opts}
    snap = fmt.snapshot(state)
    weights.add_(1.0)             # the optimizer step that runs while the file is written
    opts["lr"] = 0.2
    fmt.write(tmp_path / "f.pt", snap)
    back = fmt.read(tmp_path / "f.pt")
    assert torch.equal(back["w"], torch.ones(1000)) and back["opts"]["lr"] == 0.1


def test_buffer_pool_reuses_copies_and_keeps_snapshots_apart():
    pool = fmt.BufferPool()
    w = torch.randn(100)
    first = fmt.snapshot({"w": w}, pool=pool, key="a")
    second = fmt.snapshot({"w": w * 2}, pool=pool, key="a")
    assert second.tensors[0].data_ptr() == first.tensors[0].data_ptr()   # reused (one save in flight at a time)
    third = fmt.snapshot({"w": w}, pool=pool, key="b")
    assert third.tensors[0].data_ptr() != first.tensors[0].data_ptr()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_byte_grouping_compresses_weights_better(tmp_path, dtype):
    torch.manual_seed(0)
    w = {"w": (torch.randn(512, 1024) * 0.02).to(dtype)}
    plain, _ = fmt.write(tmp_path / "plain", fmt.snapshot(w), byte_group=False)
    grouped, _ = fmt.write(tmp_path / "grouped", fmt.snapshot(w), byte_group=True)
    raw = w["w"].numel() * w["w"].element_size()
    assert grouped < 0.96 * plain < 0.96 * raw, (raw, plain, grouped)


def test_flipped_byte_and_truncation_are_reported_with_the_file_name(tmp_path):
    path = tmp_path / "layer_03-model_states.pt"
    size, sha = fmt.write(path, fmt.snapshot(_sample_state()))
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x10
    path.write_bytes(bytes(data))
    with pytest.raises(fmt.CorruptCheckpointError, match="layer_03-model_states.pt: checksum mismatch"):
        fmt.verify(path, size=size, sha256=sha)
    path.write_bytes(bytes(data[:size // 3]))
    with pytest.raises(fmt.CorruptCheckpointError, match=r"layer_03-model_states.pt: .* bytes, the manifest says"):
        fmt.verify(path, size=size, sha256=sha)
    with pytest.raises(fmt.CorruptCheckpointError, match="layer_03-model_states.pt"):
        fmt.read(path)            # no manifest at hand: decoding fails, naming the file


def _commit(save_dir, step, value):
    tag = f"global_step{step}"
    staging = os.path.join(save_dir, catalog.STAGING + tag)
    os.makedirs(staging)
    size, sha = fmt.write(os.path.join(staging, "w.pt"), fmt.snapshot({"w": torch.full((64, ), value)}))
    manifest = {"format": catalog.FORMAT_NAME, "version": 1, "tag": tag, "global_step": step,
                "committed_at": time.time(), "files": {"w.pt": {"size": size, "sha256": sha}}}
    return catalog.publish(staging, save_dir=save_dir, tag=tag, manifest=manifest)


def test_catalog_picks_the_newest_complete_checkpoint(tmp_path):
    d = str(tmp_path)
    _commit(d, 2, 2.0)
    final4 = _commit(d, 4, 4.0)
    with open(os.path.join(final4, "w.pt"), "r+b") as f:        # bit rot in the newest
        f.seek(-20, os.SEEK_END)
        byte = f.read(1)
        f.seek(-20, os.SEEK_END)
        f.write(bytes([byte[0] ^ 1]))
    os.makedirs(os.path.join(d, catalog.STAGING + "global_step6"))     # a save torn by a crash
    os.makedirs(os.path.join(d, "global_step5"))
    (tmp_path / "global_step5" / catalog.MANIFEST).write_text("{not json")
    assert catalog.read_latest(d) == "global_step4"
    notes = []
    best = catalog.newest_complete(d, log=notes.append)
    assert best.tag == "global_step2" and torch.equal(fmt.read(os.path.join(best.path, "w.pt"))["w"],
                                                      torch.full((64, ), 2.0))
    assert any("global_step5" in n and "unreadable manifest" in n for n in notes), notes
    assert any("global_step4" in n and "w.pt: checksum mismatch" in n for n in notes), notes
    # size-only verification does not read the files: the flipped bit passes it
    assert catalog.newest_complete(d, full=False, log=notes.append).tag == "global_step4"
    # retention never names the newest
    assert [c.tag for c in catalog.expired(d, keep_last=1)] == ["global_step2"]
    assert catalog.expired(d, keep_last=0) == []
    # DeepSpeed's own format: the checkpoint 'latest' names counts (it has no manifest)
    os.makedirs(os.path.join(d, "global_step9"))
    catalog.write_atomic(os.path.join(d, "latest"), b"global_step9")
    found, _ = catalog.list_checkpoints(d)
    assert [(c.tag, c.kind) for c in found][-1] == ("global_step9", "deepspeed")
    assert catalog.clean_stale(d) == [catalog.STAGING + "global_step6"]


def test_publish_puts_the_old_copy_back_when_the_new_one_cannot_take_its_place(tmp_path, monkeypatch):
    d = str(tmp_path)
    _commit(d, 2, 2.0)
    staging = os.path.join(d, catalog.STAGING + "global_step2")
    os.makedirs(staging)
    real = os.rename

    def failing(src, dst):
        if src == staging:
            raise OSError("injected")
        return real(src, dst)
    monkeypatch.setattr(catalog.os, "rename", failing)
    with pytest.raises(OSError, match="injected"):
        catalog.publish(staging, save_dir=d, tag="global_step2",
                        manifest={"format": catalog.FORMAT_NAME, "global_step": 2, "files": {}})
    monkeypatch.undo()
    best = catalog.newest_complete(d, log=lambda m: None)
    assert best.tag == "global_step2" and torch.equal(fmt.read(os.path.join(best.path, "w.pt"))["w"],
                                                      torch.full((64, ), 2.0))


# -- two ranks ---------------------------------------------------------------------------------

def _engine(save_dir, **kw):
    from ds_ext.checkpoint.engine import AsyncCheckpointEngine
    from ds_ext.config import CheckpointSection
    return AsyncCheckpointEngine(CheckpointSection(dir=save_dir, engine="async-zstd", **kw), log=lambda m: None)


def _begin_and_save(ckpt, save_dir, step, state, *, seal=True):
    import torch.distributed as tdist
    if not ckpt.begin(save_dir=save_dir, tag=f"global_step{step}", step=step):
        return False
    final = os.path.join(save_dir, f"global_step{step}")
    ckpt.makedirs(final, exist_ok=True)
    ckpt.save(state, os.path.join(final, f"rank{tdist.get_rank()}.pt"))
    if seal:
        ckpt.seal()
    return True


def _commit_protocol_rank(save_dir):
    import torch.distributed as tdist
    rank = tdist.get_rank()
    ckpt = _engine(save_dir, keep_last=2, when_busy="skip")
    out = {}
    # rank 1 is slow to hand over its files: nothing may appear until it has
    _begin_and_save(ckpt, save_dir, 1, {"w": torch.full((1000, ), 1.0)}, seal=rank == 0)
    ckpt.poll()
    out["visible_before_rank1"] = os.path.exists(os.path.join(save_dir, "global_step1"))
    # ... and a save due now is skipped (when_busy = skip), on both ranks alike
    out["second_began"] = ckpt.begin(save_dir=save_dir, tag="global_step2", step=2)
    if rank == 1:
        ckpt.seal()
    ckpt.wait()
    out["visible_after"] = os.path.exists(os.path.join(save_dir, "global_step1"))
    for step in (3, 4, 5):
        _begin_and_save(ckpt, save_dir, step, {"w": torch.full((1000, ), float(step))})
        ckpt.wait()
    out["statuses"] = [(h["tag"], h["status"]) for h in ckpt.history]
    tdist.barrier()
    out["dirs"] = sorted(n for n in os.listdir(save_dir) if not n.startswith("zero"))
    out["latest"] = catalog.read_latest(save_dir)
    out["manifest_files"] = sorted(catalog.read_manifest(os.path.join(save_dir, "global_step5"))["files"])
    # a newer checkpoint in DeepSpeed's own format (torch.save, 'latest', no manifest) is read too
    if rank == 0:
        os.makedirs(os.path.join(save_dir, "global_step9"))
        torch.save({"w": torch.full((10, ), 9.0)}, os.path.join(save_dir, "global_step9", "rank0.pt"))
        catalog.write_atomic(os.path.join(save_dir, "latest"), b"global_step9")
    tdist.barrier()
    out["resolved"] = ckpt.resolve(save_dir)
    out["loaded"] = ckpt.load(os.path.join(save_dir, "global_step9", "rank0.pt"))["w"].tolist()
    return out


@pytest.mark.multirank
def test_commit_waits_for_every_rank_skip_and_retention(tmp_path):
    res = run_ranks(_commit_protocol_rank, world_size=2, args=(str(tmp_path / "ck"), ), timeout=120)
    for r in res:
        assert r["visible_before_rank1"] is False and r["second_began"] is False and r["visible_after"] is True
        assert r["statuses"] == [("global_step2", "skipped"), ("global_step1", "committed"),
                                 ("global_step3", "committed"), ("global_step4", "committed"),
                                 ("global_step5", "committed")]
    assert res[0]["dirs"] == ["global_step4", "global_step5", "latest"]        # keep_last = 2
    assert res[0]["latest"] == "global_step5"
    assert res[0]["manifest_files"] == ["rank0.pt", "rank1.pt"]
    assert all(r["resolved"] == "global_step9" and r["loaded"] == [9.0] * 10 for r in res)


def _disk_full_rank(save_dir, on_error):
    import torch.distributed as tdist
    from ds_ext.checkpoint.engine import CheckpointError
    ckpt = _engine(save_dir, on_error=on_error)
    torch.manual_seed(tdist.get_rank())
    _begin_and_save(ckpt, save_dir, 1, {"w": torch.rand(50_000)})      # 0.2 MB per rank: fits
    ckpt.wait()
    error = None
    try:
        _begin_and_save(ckpt, save_dir, 2, {"w": torch.rand(1_000_000)})   # 4 MB per rank: does not
        ckpt.wait()
    except CheckpointError as exc:
        error = str(exc)
    tdist.barrier()
    return {"error": error, "history": [(h["tag"], h["status"]) for h in ckpt.history],
            "left": sorted(os.listdir(save_dir)), "latest": catalog.read_latest(save_dir),
            "newest": catalog.newest_complete(save_dir, log=lambda m: None).tag}


@pytest.mark.multirank
@pytest.mark.parametrize("on_error", ["continue", "stop"])
def test_disk_full_fails_the_save_cleanly(tmp_path, on_error):
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    mnt = tmp_path / "small"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(mnt)], check=True)
    try:
        res = run_ranks(_disk_full_rank, world_size=2, args=(str(mnt / "ck"), on_error), timeout=120)
    finally:
        subprocess.run(["umount", str(mnt)], check=True)
    for r in res:
        assert r["history"] == [("global_step1", "committed"), ("global_step2", "failed")]
        assert r["left"] == ["global_step1", "latest"]          # staging removed, previous kept
        assert r["latest"] == "global_step1" and r["newest"] == "global_step1"
        if on_error == "stop":
            assert "No space left on device" in r["error"] and "global_step1) is intact" in r["error"], r["error"]
        else:
            assert r["error"] is None


# -- SIGKILL at random moments ------------------------------------------------------------------

def _start_job(save_dir, steps, log_dir, tag):
    port = free_port()
    procs = []
    for rank in range(2):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
        log = open(os.path.join(log_dir, f"{tag}-rank{rank}.log"), "w")
        procs.append(subprocess.Popen([sys.executable, "-m", "tests.checkpoint_worker", save_dir, str(steps), "4"],
                                      cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT))
    return procs


def _check_committed(save_dir):
    """Every committed checkpoint verifies and holds its own step's data; the newest
    complete one is the newest committed one. Returns its step (0: none)."""
    found, problems = catalog.list_checkpoints(save_dir)
    assert problems == [], problems
    for ckpt in found:
        catalog.verify_checkpoint(ckpt)
        for rank in range(2):
            state = fmt.read(os.path.join(ckpt.path, f"rank{rank}.pt"))
            expected = checkpoint_worker.state_at(ckpt.step, rank=rank, numel=4 * (1 << 20) // 4)
            assert state["meta"] == expected["meta"]
            assert torch.equal(state["weights"], expected["weights"]) and torch.equal(state["half"], expected["half"])
    newest = catalog.newest_complete(save_dir, log=lambda m: None)
    assert (newest is None) == (not found)
    if found:
        assert newest.tag == found[-1].tag
        assert catalog.read_latest(save_dir) in {c.tag for c in found}
    return newest.step if newest else 0


@pytest.mark.multirank
def test_sigkill_at_random_moments_never_leaves_a_torn_checkpoint(tmp_path):
    rng = random.Random(20261130)
    trials, torn_writes, resumed = 16, 0, 0
    for trial in range(trials):
        save_dir = str(tmp_path / f"trial{trial}")
        procs = _start_job(save_dir, 10_000, str(tmp_path), f"t{trial}")
        log0 = tmp_path / f"t{trial}-rank0.log"
        deadline = time.monotonic() + 120           # start-up: about 2 s here, more on a cold machine
        while "saving from now on" not in log0.read_text() and time.monotonic() < deadline:
            assert all(p.poll() is None for p in procs), log0.read_text()
            time.sleep(0.05)
        time.sleep(rng.uniform(0.0, 2.0))            # then a save per 20 ms step
        victims = [0, 1] if rng.random() < 0.5 else [1, 0]
        procs[victims[0]].send_signal(signal.SIGKILL)
        time.sleep(rng.uniform(0.0, 0.2))            # the launcher takes the other one down soon after
        procs[victims[1]].send_signal(signal.SIGKILL)
        for p in procs:
            p.wait()
        if os.path.isdir(save_dir) and any(n.startswith(catalog.STAGING) for n in os.listdir(save_dir)):
            torn_writes += 1
        newest = _check_committed(save_dir)
        if trial % 4 == 3:                           # and the job comes back from the newest complete one
            procs = _start_job(save_dir, newest + 3, str(tmp_path), f"t{trial}-resume")
            assert [p.wait(timeout=60) for p in procs] == [0, 0]
            log = open(tmp_path / f"t{trial}-resume-rank0.log").read()
            assert (f"resumed from global_step{newest}" in log) == (newest > 0) and "finished" in log, log
            assert _check_committed(save_dir) == newest + 3
            resumed += 1
        shutil.rmtree(save_dir, ignore_errors=True)
    # the kills must have hit saves in flight, or the test proved nothing
    assert torn_writes >= trials // 2, f"only {torn_writes} of {trials} kills hit a save in flight"
    assert resumed == trials // 4

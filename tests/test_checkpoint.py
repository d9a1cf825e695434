"""Asynchronous zstd checkpoints (ds_ext/checkpoint).

Single process: the file format round trip (dtypes, byte grouping across runs,
shared tensors, parameters, views), a snapshot that training cannot change after it
is taken, byte grouping compressing better than plain zstd, a flipped byte and a
truncated file reported with the file's name, the catalog's choice of the newest
complete checkpoint among torn, corrupt and foreign ones.
Two gloo ranks: nothing is committed until every rank has written; ``when_busy``
skip; retention; DeepSpeed's own format read by the same engine; a full disk (a 3 MB tmpfs, needs root) fails the save
cleanly with the previous checkpoint intact, per ``on_error``.
SIGKILL over 104 trials of a 2-rank job saving every step (tests/checkpoint_worker.py,
ranks forked from a forkserver that has imported torch and DeepSpeed once): 8 kills
on entering or leaving each step of the save path (snapshot, write, the writer's
fsync, the commit's all-reduce, and on rank 0 manifest, rename into place, `latest`,
retention's remove), the worker killing itself there, each checked for the exact
state that point must leave; 40 at random moments. In every trial each committed
checkpoint verifies and loads with its own step's data, the newest complete one is
the newest committed, `latest` names it or the one before, no staging directory is
taken for a checkpoint; one trial in four resumes and runs on from the newest
complete one.
About 80 s on 2 cores, 45 s of it the SIGKILL test."""

import collections
import functools
import json
import multiprocessing.connection as mp_connection
import multiprocessing.forkserver as mp_forkserver
import os
import random
import shutil
import signal
import time

import pytest
import torch

from ds_ext.checkpoint import catalog, format as fmt
from tests import checkpoint_worker
from tests.mounts import small_tmpfs
from tests.distributed import free_port, rank_context, run_ranks


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
    with small_tmpfs(tmp_path / "small") as mnt:
        res = run_ranks(_disk_full_rank, world_size=2, args=(str(mnt / "ck"), on_error), timeout=120)
    for r in res:
        assert r["history"] == [("global_step1", "committed"), ("global_step2", "failed")]
        assert r["left"] == ["global_step1", "latest"]          # staging removed, previous kept
        assert r["latest"] == "global_step1" and r["newest"] == "global_step1"
        if on_error == "stop":
            assert "No space left on device" in r["error"] and "global_step1) is intact" in r["error"], r["error"]
        else:
            assert r["error"] is None


# -- SIGKILL along the whole save path -----------------------------------------------------------
#
# Ranks start from a forkserver that has imported torch, DeepSpeed and the engine once,
# so a trial costs a fork and a gloo rendezvous, not two interpreter start-ups.

_MB_PER_RANK = 1
_N_PER_PHASE = 8
_N_RANDOM = 40
_OCCURRENCES = {"snapshot": 6, "write": 6, "fsync": 12, "agree": 25, "manifest": 6, "rename": 6, "latest": 6,
                "remove": 3}       # the n-th occurrence is drawn from 1..this (remove: from the 4th save, keep_last 3)


def _tail(path, lines=30):
    try:
        return "".join(open(path, errors="replace").readlines()[-lines:])
    except FileNotFoundError:
        return "(no log)"


class _Job:
    """The two ranks of one run of tests/checkpoint_worker.py, from the forkserver."""

    def __init__(self, ctx, *, port, save_dir, steps, log_dir, env=({}, {})):
        self.logs = [os.path.join(log_dir, f"rank{rank}.log") for rank in range(2)]
        self.procs = [ctx.Process(target=checkpoint_worker.run_rank, daemon=True,
                                  args=(rank, 2, port, save_dir, steps, _MB_PER_RANK, self.logs[rank], env[rank]))
                      for rank in range(2)]
        for p in self.procs:
            p.start()

    def describe(self):
        return "\n".join(f"--- rank {r} (exit code {p.exitcode}):\n{_tail(self.logs[r])}"
                         for r, p in enumerate(self.procs))

    def kill(self, rank):
        p = self.procs[rank]
        if p.exitcode is None:
            try:
                os.kill(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def wait_for_exit(self, timeout):
        """Block until a rank has exited (or ``timeout``); the ranks that have."""
        ready = mp_connection.wait([p.sentinel for p in self.procs], timeout)
        for p in self.procs:
            if p.sentinel in ready:
                p.join()
        return {r for r, p in enumerate(self.procs) if p.exitcode is not None}

    def join(self, timeout):
        """Wait for both ranks to exit by themselves; False on timeout."""
        deadline = time.monotonic() + timeout
        for p in self.procs:
            p.join(max(0.0, deadline - time.monotonic()))
        return all(p.exitcode is not None for p in self.procs)

    def finish(self):
        for rank in range(2):
            self.kill(rank)
        for p in self.procs:
            p.join()


@functools.cache
def _bases(numel):
    return [checkpoint_worker.base_tensors(rank, numel) for rank in range(2)]


def _check_committed(save_dir):
    """Every committed checkpoint verifies and holds its own step's data; the newest
    complete one is the newest committed one; ``latest`` names the newest or, when
    killed between the rename and its update, the one before (missing before the
    first); no staging directory is taken for a checkpoint. Returns the committed
    checkpoints, oldest first."""
    found, problems = catalog.list_checkpoints(save_dir)
    assert problems == [], problems
    numel = _MB_PER_RANK * (1 << 20) // 4
    bases = _bases(numel)
    for ckpt in found:
        assert ckpt.manifest is not None and not ckpt.tag.startswith("."), ckpt
        catalog.verify_checkpoint(ckpt)
        assert sorted(ckpt.manifest["files"]) == ["rank0.pt", "rank1.pt"] and ckpt.manifest["global_step"] == ckpt.step
        for rank in range(2):
            state = fmt.read(os.path.join(ckpt.path, f"rank{rank}.pt"))
            expected = checkpoint_worker.state_at(ckpt.step, rank=rank, numel=numel, base=bases[rank])
            assert state["meta"] == expected["meta"], (ckpt.tag, state["meta"])
            assert torch.equal(state["weights"], expected["weights"]) and torch.equal(state["half"], expected["half"])
    newest = catalog.newest_complete(save_dir, log=lambda m: None)
    assert (newest is None) == (not found)
    latest = catalog.read_latest(save_dir)
    if found:
        assert newest.tag == found[-1].tag
        assert latest in [c.tag for c in found[-2:]] or (latest is None and len(found) == 1), (latest, found)
    else:
        assert latest is None
    staged = [n.removeprefix(catalog.STAGING) for n in os.listdir(save_dir) if n.startswith(catalog.STAGING)] \
        if os.path.isdir(save_dir) else []
    assert not {c.tag for c in found} & set(staged), (found, staged)
    return found


def _check_killed_at(save_dir, rec, found):
    """The state a kill at this exact point of the save path must leave."""
    phase, when, tag, rank = rec["phase"], rec["when"], rec["tag"], rec["rank"]
    committed = [c.tag for c in found]
    staging = os.path.join(save_dir, catalog.STAGING + tag)
    latest = catalog.read_latest(save_dir)
    where = f"killed on {when} of {phase} #{rec['n']} of {tag} on rank {rank}: committed {committed}, " \
            f"latest {latest}, {sorted(os.listdir(save_dir))}"
    if phase in ("snapshot", "write", "fsync", "agree", "manifest") or (phase == "rename" and when == "entry"):
        # not committed: the previous checkpoints are all there is, the save stays in staging
        assert tag not in committed and os.path.isdir(staging), where
        assert all(c.step < catalog.step_of(tag) for c in found), where
        mine = os.path.join(staging, f"rank{rank}.pt")
        if phase == "snapshot" or (phase == "write" and when == "entry"):
            assert not os.path.exists(mine), where
        if phase == "write" and when == "exit":
            assert fmt.read(mine)["meta"] == {"step": catalog.step_of(tag), "rank": rank}, where
        has_manifest = os.path.exists(os.path.join(staging, catalog.MANIFEST))
        assert has_manifest == (phase == "rename" or (phase == "manifest" and when == "exit")), where
    elif phase in ("rename", "latest"):
        # committed; 'latest' is replaced last
        assert committed[-1] == tag and not os.path.exists(staging), where
        assert (latest == tag) == (phase == "latest" and when == "exit"), where
    else:
        assert phase == "remove" and tag != committed[-1], where
        assert (tag in committed) == (when == "entry"), where
        if when == "exit":
            assert not any(n == tag or n.startswith(catalog.TRASH + tag + ".") for n in os.listdir(save_dir)), where


def _children_cpu_s(pid):
    """CPU seconds of the processes ``pid`` has reaped (Linux), or None."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[13]) + int(fields[14])) / os.sysconf("SC_CLK_TCK")   # cutime, cstime
    except (OSError, ValueError, IndexError, TypeError):
        return None


def _trials(rng):
    """Every phase ``_N_PER_PHASE`` times (entry and exit, either rank where both take
    part), and ``_N_RANDOM`` kills at a random moment; shuffled. One in four of each
    kind is resumed afterwards."""
    trials = []
    for phase in checkpoint_worker.PHASES:
        for i in range(_N_PER_PHASE):
            victim = 0 if phase in checkpoint_worker.RANK0_ONLY else (i // 2) % 2
            trials.append({"phase": phase, "n": rng.randint(1, _OCCURRENCES[phase]),
                           "when": ("entry", "exit")[i % 2], "victim": victim, "resume": i % 4 == 3})
    for i in range(_N_RANDOM):
        trials.append({"phase": None, "delay": rng.uniform(0.0, 0.5), "victim": rng.randrange(2),
                       "resume": i % 4 == 3})
    rng.shuffle(trials)
    return trials


def _kill(job, trial, rng):
    """Kill the job as ``trial`` says: its victim at its phase (the victim does it) or
    at a random moment after saving began, the other rank 0-200 ms later, as a
    launcher would."""
    victim = trial["victim"]
    if trial["phase"]:
        # the victim goes first, by its own SIGKILL (the other may fail on the lost peer right after)
        exited = job.wait_for_exit(timeout=60)
        assert victim in exited and job.procs[victim].exitcode == -signal.SIGKILL, \
            f"{trial}: rank {victim} did not kill itself\n{job.describe()}"
    else:
        deadline = time.monotonic() + 60
        while "saving from now on" not in _tail(job.logs[0]):
            assert time.monotonic() < deadline and not job.wait_for_exit(0.005), \
                f"{trial}: the job did not start\n{job.describe()}"
        assert not job.wait_for_exit(trial["delay"]), f"{trial}\n{job.describe()}"
        job.kill(victim)
    time.sleep(rng.uniform(0.0, 0.2))
    job.finish()


def _check_resume(job, save_dir, newest):
    """The job came back from the newest complete checkpoint and ran to its end."""
    assert job.join(60), f"the resumed job hangs\n{job.describe()}"
    assert [p.exitcode for p in job.procs] == [0, 0], job.describe()
    log = _tail(job.logs[0], 1000)
    assert (f"resumed from global_step{newest}" in log) == (newest > 0) and "finished" in log, log
    found = _check_committed(save_dir)
    assert found[-1].step == newest + 3 and catalog.read_latest(save_dir) == found[-1].tag
    assert not any(n.startswith((catalog.STAGING, catalog.TRASH)) for n in os.listdir(save_dir))


@pytest.mark.multirank
def test_sigkill_along_the_save_path_never_leaves_a_torn_checkpoint(tmp_path):
    rng = random.Random(20261130)
    ctx = rank_context()
    trials, ports, jobs = _trials(rng), set(), []

    def start(save_dir, steps, log_dir, env=({}, {})):
        while (port := free_port()) in ports:      # a fresh port for every job
            pass
        ports.add(port)
        os.makedirs(log_dir, exist_ok=True)
        jobs.append(_Job(ctx, port=port, save_dir=save_dir, steps=steps, log_dir=log_dir, env=env))
        return jobs[-1]

    killed_in = collections.Counter()      # (phase, when, victim) of the directed kills
    random_hits = collections.Counter()    # what the rank killed at a random moment was doing, per thread
    in_flight = {"directed": 0, "random": 0}
    began, own_cpu_began, cpu_began, server = time.monotonic(), time.process_time(), None, None
    try:
        for t, trial in enumerate(trials):
            trial_began = time.monotonic()
            save_dir, phase_dir = str(tmp_path / f"t{t}" / "ckpt"), str(tmp_path / f"t{t}" / "phases")
            env = [{"SEEKSPEED_PHASE_DIR": phase_dir} for _ in range(2)]
            if trial["phase"]:
                env[trial["victim"]]["SEEKSPEED_KILL_AT"] = f"{trial['phase']}:{trial['n']}:{trial['when']}"
            os.makedirs(phase_dir)
            job = start(save_dir, 10_000, str(tmp_path / f"t{t}"), env)
            if server is None:
                server = getattr(mp_forkserver._forkserver, "_forkserver_pid", None)
                cpu_began = _children_cpu_s(server)
            _kill(job, trial, rng)
            found = _check_committed(save_dir)
            in_flight["directed" if trial["phase"] else "random"] += any(
                n.startswith(catalog.STAGING) for n in os.listdir(save_dir)) if os.path.isdir(save_dir) else 0
            if trial["phase"]:
                with open(os.path.join(phase_dir, f"rank{trial['victim']}.killed")) as f:
                    rec = json.load(f)
                assert (rec["phase"], rec["n"], rec["when"], rec["rank"]) == \
                    (trial["phase"], trial["n"], trial["when"], trial["victim"]), (rec, trial)
                _check_killed_at(save_dir, rec, found)
                killed_in[rec["phase"], rec["when"], rec["rank"]] += 1
            else:
                with open(os.path.join(phase_dir, f"rank{trial['victim']}.phase"), "rb") as f:
                    slots = f.read().decode()
                random_hits[f"{slots[:32].strip() or 'starting'} | {slots[32:].strip() or 'starting'}"] += 1
            if trial["resume"]:
                newest = found[-1].step if found else 0
                _check_resume(start(save_dir, newest + 3, str(tmp_path / f"t{t}" / "resume")), save_dir, newest)
            shutil.rmtree(save_dir, ignore_errors=True)
            print(f"trial {t}: {trial} {time.monotonic() - trial_began:.2f} s", flush=True)
    finally:
        for job in jobs:                           # no rank outlives the test
            job.finish()
    cpu = _children_cpu_s(server)
    cpu = f"{cpu - cpu_began:.0f}" if cpu is not None and cpu_began is not None else "?"
    print(f"{len(trials)} trials in {time.monotonic() - began:.0f} s (CPU: {cpu} s in the ranks, "
          f"{time.process_time() - own_cpu_began:.0f} s in the test); a save in flight at "
          f"{in_flight['directed']} directed and {in_flight['random']} random kills; "
          f"{sum(t['resume'] for t in trials)} resumed")
    for (phase, when, rank), count in sorted(killed_in.items()):
        print(f"  killed on {when:5} of {phase:8} on rank {rank}: {count}")
    for where, count in random_hits.most_common():
        print(f"  random kill, the victim's training | writer thread in {where}: {count}")
    assert len(trials) >= 100
    for phase in checkpoint_worker.PHASES:          # every phase reached and killed in, at both ends
        victims = (0, ) if phase in checkpoint_worker.RANK0_ONLY else (0, 1)
        assert {(w, v) for (p, w, v) in killed_in if p == phase} == {(w, v) for w in ("entry", "exit")
                                                                     for v in victims}, killed_in
    assert sum(killed_in.values()) == len(checkpoint_worker.PHASES) * _N_PER_PHASE
    # the random kills must have hit saves in flight too, or they proved nothing
    assert in_flight["random"] >= _N_RANDOM // 2, f"only {in_flight['random']} of {_N_RANDOM} random kills hit a " \
                                                   f"save in flight"

"""One rank of a job that saves a checkpoint after every simulated training step with
seekspeed's asynchronous engine, driven the way DeepSpeed drives it (begin, makedirs,
save, seal; a poll after each step). Used by tests/test_checkpoint.py, which kills
these ranks with SIGKILL, at random moments and on purpose at each step of a save.

    python -m tests.checkpoint_worker SAVE_DIR STEPS MB_PER_RANK    (RANK, WORLD_SIZE, MASTER_* set)

Each rank's file at step s holds random tensors (fp32 and bf16, the same on every
save) plus s, and the step itself (``state_at``), so a loaded checkpoint says which step
it came from. With a complete
checkpoint present it resumes after it, as ``--resume auto`` does.

With ``SEEKSPEED_PHASE_DIR`` set the rank follows its own save path (functions of the
real engine wrapped in this process only, the library is unchanged) through the
phases in ``PHASES`` and keeps the phase each of its threads is in, in
``rank<r>.phase`` there (64 bytes, memory-mapped, so it survives a SIGKILL from
outside). ``SEEKSPEED_KILL_AT=PHASE:N[:exit]`` makes it SIGKILL itself on entering
(or on leaving) the N-th occurrence of PHASE on this rank, after writing what it was
doing to ``rank<r>.killed`` (JSON: phase, n, when, tag, rank).
"""

import json
import mmap
import os
import re
import signal
import sys
import threading
import time

# The save path in order. Per save: snapshot (training thread), write and fsync (the
# engine's writer thread: the file's fsync, then the staging directory's), agree (the
# poll's all-reduce, every step while the save is in flight), and on rank 0 only:
# manifest, rename (staging into place), latest, remove (retention's deletion, writer).
PHASES = ("snapshot", "write", "fsync", "agree", "manifest", "rename", "latest", "remove")
RANK0_ONLY = ("manifest", "rename", "latest", "remove")

_STAGED = re.compile(r"\.staging-(global_step\d+)")


class PhaseTracer:
    """Wraps the engine's steps in this process, records the phase each thread is in,
    and kills this process where ``kill_at`` says."""

    def __init__(self, phase_dir, rank, kill_at):
        self.rank = rank
        self.counts = dict.fromkeys(PHASES, 0)
        self.in_flight = None             # tag of the save this rank began last (set by the loop)
        self.kill = None
        if kill_at:
            phase, n, *when = kill_at.split(":")
            if phase not in PHASES or when not in ([], ["entry"], ["exit"]):
                raise ValueError(f"SEEKSPEED_KILL_AT={kill_at!r}: expected PHASE:N[:exit] with PHASE one of "
                                 f"{', '.join(PHASES)}")
            self.kill = (phase, int(n), when[0] if when else "entry")
        self.killed_path = os.path.join(phase_dir, f"rank{rank}.killed")
        with open(os.path.join(phase_dir, f"rank{rank}.phase"), "w+b") as f:
            f.write(b"-".ljust(32) * 2)
            f.flush()
            self._map = mmap.mmap(f.fileno(), 64)
        self._stacks = {}

    # -- what the test reads back -------------------------------------------------------------

    def _show(self):
        main = threading.current_thread() is threading.main_thread()
        text = ">".join(self._stacks.get(threading.get_ident(), [])) or "-"
        offset = 0 if main else 32
        self._map[offset:offset + 32] = text[:32].ljust(32).encode()

    def _maybe_kill(self, phase, n, when, tag):
        if self.kill == (phase, n, when):
            with open(self.killed_path, "w") as f:
                json.dump({"phase": phase, "n": n, "when": when, "tag": tag, "rank": self.rank}, f)
            os.kill(os.getpid(), signal.SIGKILL)

    def phase(self, name, fn, tag_of):
        """``fn`` wrapped as phase ``name``; ``tag_of(*args)`` names the checkpoint it acts on."""

        def wrapped(*args, **kwargs):
            self.counts[name] += 1
            n, tag = self.counts[name], tag_of(*args)
            stack = self._stacks.setdefault(threading.get_ident(), [])
            stack.append(name)
            self._show()
            self._maybe_kill(name, n, "entry", tag)
            try:
                out = fn(*args, **kwargs)
            finally:
                stack.pop()
                self._show()
            self._maybe_kill(name, n, "exit", tag)
            return out

        return wrapped

    def install(self):
        import torch.distributed as tdist
        from ds_ext.checkpoint import catalog, format as fmt

        def staged_tag(path):
            m = _STAGED.search(str(path))
            return m.group(1) if m else None

        def fd_tag(fd):
            return staged_tag(os.readlink(f"/proc/self/fd/{fd}"))

        fmt.snapshot = self.phase("snapshot", fmt.snapshot, lambda *a: self.in_flight)
        fmt.write = self.phase("write", fmt.write, lambda path, *a: staged_tag(path))
        # the writer's fsyncs (the file's in fmt.write, the directory's in _finish); the
        # training thread's, inside write_atomic, belong to the manifest and latest phases
        plain_fsync, traced_fsync = os.fsync, self.phase("fsync", os.fsync, fd_tag)
        os.fsync = lambda fd: (plain_fsync if threading.current_thread() is threading.main_thread()
                               else traced_fsync)(fd)
        tdist.all_reduce = self.phase("agree", tdist.all_reduce, lambda *a: self.in_flight)
        plain_write_atomic = catalog.write_atomic
        traced = {name: self.phase(phase, plain_write_atomic, tag_of)
                  for name, phase, tag_of in ((catalog.MANIFEST, "manifest", lambda path, data: staged_tag(path)),
                                              (catalog.LATEST, "latest", lambda path, data: data.decode()))}
        catalog.write_atomic = lambda path, data: traced.get(os.path.basename(path), plain_write_atomic)(path, data)
        plain_rename, traced_rename = os.rename, self.phase("rename", os.rename, lambda src, dst: staged_tag(src))
        os.rename = lambda src, dst: (traced_rename if os.path.basename(src).startswith(catalog.STAGING)
                                      else plain_rename)(src, dst)
        catalog.remove = self.phase("remove", catalog.remove, lambda path: os.path.basename(path.rstrip("/")))


def base_tensors(rank, numel):
    import torch
    g = torch.Generator().manual_seed(1000 + rank)
    return torch.randn(numel, generator=g), torch.randn(numel // 4, generator=g).to(torch.bfloat16)


def state_at(step, *, rank, numel, base=None):
    """Random values (which zstd cannot shrink, so a file takes time to write and can
    be torn) plus ``step``: the same arithmetic here and in the test's check, bitwise."""
    weights, half = base if base is not None else base_tensors(rank, numel)
    return {"weights": weights + float(step), "half": half + float(step), "meta": {"step": step, "rank": rank}}


def save(ckpt, save_dir, step, state, rank, tracer=None):
    tag = f"global_step{step}"
    if not ckpt.begin(save_dir=save_dir, tag=tag, step=step):
        return
    if tracer is not None:
        tracer.in_flight = tag
    final = os.path.join(save_dir, tag)
    ckpt.makedirs(final, exist_ok=True)
    ckpt.save(state, os.path.join(final, f"rank{rank}.pt"))
    ckpt.seal()


def main(save_dir, steps, mb):
    import torch
    from ds_ext.checkpoint.engine import AsyncCheckpointEngine
    from ds_ext.config import CheckpointSection
    import torch.distributed as tdist
    torch.set_num_threads(1)
    tdist.init_process_group("gloo")
    rank = tdist.get_rank()
    tracer = None
    if os.environ.get("SEEKSPEED_PHASE_DIR"):
        tracer = PhaseTracer(os.environ["SEEKSPEED_PHASE_DIR"], rank, os.environ.get("SEEKSPEED_KILL_AT"))
        tracer.install()
    ckpt = AsyncCheckpointEngine(CheckpointSection(dir=save_dir, engine="async-zstd", keep_last=3),
                                 log=lambda msg: print(msg, flush=True))
    numel = mb * (1 << 20) // 4
    base = base_tensors(rank, numel)
    tag = ckpt.resolve(save_dir)
    start = int(tag.removeprefix("global_step")) if tag else 0
    if tag:
        loaded = ckpt.load(os.path.join(save_dir, tag, f"rank{rank}.pt"))
        expected = state_at(start, rank=rank, numel=numel, base=base)
        assert loaded["meta"] == expected["meta"], loaded["meta"]
        assert torch.equal(loaded["weights"], expected["weights"]) and torch.equal(loaded["half"], expected["half"])
        print(f"resumed from {tag}", flush=True)
    print("saving from now on", flush=True)
    for step in range(start + 1, steps + 1):
        time.sleep(0.02)                      # the step's compute
        ckpt.poll()
        save(ckpt, save_dir, step, state_at(step, rank=rank, numel=numel, base=base), rank, tracer)
    ckpt.wait()
    tdist.barrier()
    tdist.destroy_process_group()
    print("finished", flush=True)


def run_rank(rank, world_size, port, save_dir, steps, mb, log_path, extra_env):
    """Entry point of a rank started from a multiprocessing context (the test's
    forkserver): environment, output to ``log_path``, then ``main``."""
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1", **extra_env})
    main(save_dir, steps, mb)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))

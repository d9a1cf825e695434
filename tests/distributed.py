"""Multi-rank test harness in the manner of DeepSpeed's tests/unit DistributedTest:
spawn ``world_size`` gloo ranks on CPU with a free port, run one function on each,
fail loudly on a hang (per-call timeout) and show every failing rank's traceback
and the tail of its output.

    results = run_ranks(my_module_level_fn, world_size=2, args=(...,), timeout=120)

``fn`` must be importable (a module-level function). It runs after
``deepspeed.init_distributed('gloo')`` unless ``init_dist=False``; what it returns
(tensors become numpy arrays) comes back as ``results[rank]``.

Ranks are forked from a forkserver that has imported torch and DeepSpeed once (as
tests/test_checkpoint.py's kill trials do), so a call costs a fork and a gloo
rendezvous rather than an interpreter start-up and those imports per rank; each rank
then takes the caller's environment as it is at the call, as a spawned one would.

Each rank computes on ``SEEKSPEED_TEST_THREADS`` threads (default 1), as do the
single-process references that call ``compute_threads()``: running the suite again with 2
(and ``ATEN_CPU_CAPABILITY=avx2``) changes the kernels' blocking and reduction order,
which a comparison that holds only by the luck of one CPU's kernels does not survive.
"""

import multiprocessing as mp
import os
import queue as queue_mod
import shutil
import tempfile
import time
import traceback

from ds_ext.distributed import free_port


class RankFailure(AssertionError):
    pass


def compute_threads():
    """The thread count tests compute with (``SEEKSPEED_TEST_THREADS``, default 1)."""
    return int(os.environ.get("SEEKSPEED_TEST_THREADS", "1"))


def _plain(value):
    import torch
    if torch.is_tensor(value):
        return value.detach().cpu().numpy()
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_plain(v) for v in value)
    return value


# what the forkserver imports once; one server serves the whole pytest process, so every
# user of the "forkserver" context (test_checkpoint.py too) asks for this same list. The
# trainer and what it imports on its first step (torch._dynamo through the optimizer,
# datasets for the data; DeepSpeed's Muon module, which ZeRO's optimizer check imports
# and whose torch.compile decorators import the inductor) cost a forked trainer rank
# about 2.7 s, and 2.5 s more under ZeRO, otherwise.
PRELOAD = ["torch", "torch.distributed", "numpy", "zstandard", "deepspeed", "deepspeed.runtime.pipe",
           "ds_ext.config", "ds_ext.checkpoint.engine", "tests.checkpoint_worker", "tests.rank_preload",
           "torch._dynamo", "datasets", "ds_ext.trainer", "tests.kill_worker",
           "deepspeed.runtime.zero.muon.muon_optimizer"]


def rank_context():
    """The multiprocessing context ranks start from: the preloaded forkserver."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def _worker(fn, rank, world_size, port, args, results, log_path, extra_env, init_dist, parent_env, cwd):
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.environ.clear()                       # the caller's environment now, not the server's at its start
    os.environ.update(parent_env)
    os.chdir(cwd)
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank),
                       "LOCAL_WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                       "OMP_NUM_THREADS": str(compute_threads()), "DS_ACCELERATOR": "cpu", **(extra_env or {})})
    try:
        import torch
        torch.set_num_threads(compute_threads())
        if init_dist:
            from ds_ext.distributed import init_distributed
            init_distributed("gloo")
        results.put(("ok", rank, _plain(fn(*args))))
    except BaseException:
        results.put(("error", rank, traceback.format_exc()))
    finally:
        try:
            import torch.distributed as tdist
            if tdist.is_initialized():
                tdist.destroy_process_group()
        except Exception:
            pass


def _tail(path, lines=25):
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-lines:])
    except OSError:
        return "<no output>"


def run_ranks(fn, *, world_size, args=(), timeout=180, env=None, init_dist=True):
    ctx = rank_context()
    results = ctx.Queue()
    port = free_port()
    logdir = tempfile.mkdtemp(prefix="seekspeed-ranks-")
    logs = [os.path.join(logdir, f"rank{r}.log") for r in range(world_size)]
    procs = [ctx.Process(target=_worker, args=(fn, r, world_size, port, args, results, logs[r], env, init_dist,
                                                         dict(os.environ), os.getcwd()),
                         daemon=True) for r in range(world_size)]
    for p in procs:
        p.start()
    done, errors = {}, {}
    deadline = time.monotonic() + timeout
    try:
        while len(done) + len(errors) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            if errors and remaining > 10:
                deadline = time.monotonic() + 10   # peers of a failed rank usually hang in a collective
            try:
                status, rank, payload = results.get(timeout=min(remaining, 1.0))
            except queue_mod.Empty:
                if any(not p.is_alive() and p.exitcode not in (0, None) for p in procs) and not errors:
                    dead = [r for r, p in enumerate(procs) if not p.is_alive() and p.exitcode not in (0, None)]
                    for r in dead:
                        errors.setdefault(r, f"rank {r} died with exit code {procs[r].exitcode}")
                continue
            (done if status == "ok" else errors)[rank] = payload
    finally:
        for p in procs:
            p.join(timeout=5 if not errors else 0.5)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    failure = None
    if errors or len(done) < world_size:
        missing = [r for r in range(world_size) if r not in done and r not in errors]
        parts = []
        if missing:
            parts.append(f"ranks {missing} did not finish within {timeout}s (hang?)")
        for r in sorted(errors):
            parts.append(f"--- rank {r} failed:\n{errors[r]}")
        for r in sorted(set(errors) | set(missing)):
            parts.append(f"--- rank {r} output (tail):\n{_tail(logs[r])}")
        failure = "\n".join(parts)
    shutil.rmtree(logdir, ignore_errors=True)     # the ranks are gone; their tails are in the message
    if failure is not None:
        raise RankFailure(failure)
    return [done[r] for r in range(world_size)]

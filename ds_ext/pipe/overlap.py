"""Layer-level forward/backward overlap for F&B chunks (``seekspeed.overlap: "layer"``).

DeepSeek-V3's DualPipe puts the forward of one micro-batch and the backward of another
into one chunk so that the expert-parallel all-to-alls of one run while the other
computes. Here the two halves run on two threads that take turns (a baton; never both
at once): the forward on the calling thread, the backward (autograd included) on a
worker thread. A half hands the baton over right after it has issued an asynchronous
collective (``switch``, called by ds_ext.comm.alltoall), and waits for that
collective's result only where it is used, by which time the other half has computed.
So each dispatch and combine of one micro-batch is in flight while the other
micro-batch runs its attention, router, experts and their backward.

Both halves issue their collectives in one order fixed by the code (every replica of a
stage switches at the same points), so the ranks of an expert-parallel group always
agree on the order of their all-to-alls. The same path serves gloo (its own threads move
the bytes while the baton holder computes) and NCCL (collectives on NCCL's stream, work
objects waited for on the compute stream).

State that the two halves must not share (the pipeline phase of DualPipeV's engine and
module) is declared ``PerThread``: while an interleave runs, each half reads and writes
its own copy, falling back to the value set before the chunk began.
"""

import queue
import threading

from ds_ext.comm.turns import PerThread, _local, interleaving, switch  # noqa: F401 (importers use them from here)


def check_splittable(module):
    """Refuse, naming the class, an expert-parallel MoE layer whose all-to-alls do not go
    through ds_ext.comm.alltoall (so they would block without letting the other half run)."""
    from deepspeed.moe.layer import MoE
    from ds_ext.errors import ConfigError
    for name, m in module.named_modules():
        if isinstance(m, MoE) and not getattr(m, "async_all_to_all", False):
            raise ConfigError(f"seekspeed.overlap 'layer': {type(m).__name__} ({name}) runs its all-to-alls "
                              f"synchronously, so an F&B chunk cannot switch halves at them; issue them through "
                              f"ds_ext.comm.alltoall (dispatch/arrive, as the recipes' DeepSeekMoE layer does) "
                              f"and set async_all_to_all = True on the class, or set overlap 'none'")


class _Worker:
    """One long-lived thread per process for the backward halves (an OpenMP team and
    autograd's thread state set up once, not per chunk)."""

    _instance = None

    def __init__(self):
        self.tasks = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._loop, name="seekspeed-fb-backward", daemon=True)
        self.thread.start()

    @classmethod
    def get(cls):
        if cls._instance is None:
            cls._instance = cls()
        return cls._instance

    def _loop(self):
        import torch
        while True:
            fn, num_threads = self.tasks.get()
            if torch.get_num_threads() != num_threads:
                torch.set_num_threads(num_threads)
            fn()


class Interleaver:
    """Runs F&B chunks as two halves that take turns at ``switch()`` points.

    ``run(first, second)``: ``first`` on this thread (it starts), ``second`` on the
    worker. Exceptions of either half are raised here once both have stopped."""

    def __init__(self):
        self._cond = threading.Condition()
        self._turn = 0
        self._done = [True, True]

    def _wait_turn(self, role):
        while self._turn != role:
            self._cond.wait()

    def _yield(self, role):
        with self._cond:
            if self._done[1 - role]:
                return
            self._turn = 1 - role
            self._cond.notify_all()
            self._wait_turn(role)

    def _finish(self, role):
        with self._cond:
            self._done[role] = True
            self._turn = 1 - role
            self._cond.notify_all()

    def _half(self, role, fn, errors):
        _local.ctx, _local.values = (self, role), {}
        try:
            fn()
        except BaseException as exc:      # surfaced by run(); the other half still finishes
            errors[role] = exc
        finally:
            del _local.ctx, _local.values
            self._finish(role)

    def run(self, first, second):
        import torch
        if interleaving():
            raise RuntimeError("an F&B chunk started inside another interleaved chunk")
        errors = [None, None]
        with self._cond:
            self._turn, self._done = 0, [False, False]

        def backward_half():
            with self._cond:
                self._wait_turn(1)
            self._half(1, second, errors)

        _Worker.get().tasks.put((backward_half, torch.get_num_threads()))
        self._half(0, first, errors)
        with self._cond:
            while not self._done[1]:
                self._cond.wait()
        for exc in errors:
            if exc is not None:
                raise exc

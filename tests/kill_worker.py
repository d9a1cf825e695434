"""One rank of launch/train.py (ds_ext.trainer.main) whose save path is traced, for
tests/kill_resume.py. The functions of the real checkpoint engines are wrapped in
this process only (the library is unchanged), as tests/checkpoint_worker.py does for
the asynchronous engine on its own:

- both engines: ``save`` (the engine's save_checkpoint, on the training thread);
- DeepSpeed's engine: ``file`` (each torch.save of a file), ``latest`` (the pointer);
- async-zstd: ``snapshot`` (training thread), ``write`` (each file, writer thread),
  ``poll`` (the agreement after a step while a save is in flight), ``atomic`` (manifest
  and ``latest``, rank 0), ``publish`` (manifest, rename into place, ``latest``; rank 0),
  ``remove`` (retention, rank 0).

Each event (entry or exit of one call) belongs to the save this rank began last (1 =
the first save of this process). With ``record`` the rank appends every event to a
JSON Lines file (save, phase, when, seconds since the save's entry); with ``kill`` it
SIGKILLs itself at one of them, ``{"save": j, "phase": p, "n": n, "when": "entry" |
"exit"}``, or ``delay`` seconds after entering save j (``"when": "timed"``), after
writing what it did to ``killed``.
"""

import collections
import json
import os
import signal
import sys
import threading
import time


class SaveTracer:
    def __init__(self, *, engine, record=None, kill=None, killed=None):
        self.engine = engine
        self.record_path, self.kill, self.killed_path = record, kill, killed
        self.save = 0                      # the save this rank began last
        self.save_began = time.monotonic()
        self.counts = collections.Counter()
        self.lock = threading.Lock()

    def _die(self, what):
        with open(self.killed_path, "w") as f:
            json.dump(what, f)
        os.kill(os.getpid(), signal.SIGKILL)

    def _event(self, phase, when):
        with self.lock:
            if phase == "save" and when == "entry":
                self.save += 1
                self.save_began = time.monotonic()
                if self.kill and self.kill["when"] == "timed" and self.kill["save"] == self.save:
                    timer = threading.Timer(self.kill["delay"], self._die, args=(dict(self.kill),))
                    timer.daemon = True
                    timer.start()
            self.counts[self.save, phase, when] += 1
            n = self.counts[self.save, phase, when]
            if self.record_path:
                with open(self.record_path, "a") as f:
                    f.write(json.dumps({"save": self.save, "phase": phase, "when": when, "n": n,
                                        "t": time.monotonic() - self.save_began}) + "\n")
            kill = self.kill
            if kill and kill["when"] == when and (kill["save"], kill["phase"], kill["n"]) == (self.save, phase, n):
                self._die(dict(kill))

    def wrap(self, phase, fn):
        def traced(*args, **kwargs):
            self._event(phase, "entry")
            out = fn(*args, **kwargs)
            self._event(phase, "exit")
            return out
        return traced

    def install(self):
        from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine
        from ds_ext.checkpoint import catalog, engine, format as fmt
        engine.AsyncCheckpointing.save_checkpoint = self.wrap("save", engine.AsyncCheckpointing.save_checkpoint)
        TorchCheckpointEngine.save = self.wrap("file", TorchCheckpointEngine.save)
        fmt.snapshot = self.wrap("snapshot", fmt.snapshot)
        fmt.write = self.wrap("write", fmt.write)
        engine.AsyncCheckpointEngine.poll = self.wrap("poll", engine.AsyncCheckpointEngine.poll)
        catalog.publish = self.wrap("publish", catalog.publish)
        catalog.remove = self.wrap("remove", catalog.remove)
        # DeepSpeed's engine: its one atomic write is 'latest'; the async engine's are the manifest and latest
        catalog.write_atomic = self.wrap("latest" if self.engine == "deepspeed" else "atomic", catalog.write_atomic)


def run_rank(rank, world_size, port, argv, log_path, tracer_args, extra_env):
    """Entry point of a rank forked from the test's forkserver: environment, output to
    ``log_path``, the tracer, then the trainer; exits with its code."""
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank),
                       "LOCAL_WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                       "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", **extra_env})
    import torch
    torch.set_num_threads(1)
    SaveTracer(**tracer_args).install()
    from ds_ext import trainer
    rc = trainer.main(argv)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)

"""Running launch/train.py from a test: a config from ds_configs/ with a test's edits,
the trainer's main() on one harness rank, and the environment a launcher subprocess
(deepspeed, torchrun, plain python) runs in.

    cfg = write_config(tmp_path, "tiny_cpu.json", lambda c: c["seekspeed"].update(schedule="1f1b"))
    res = run_ranks(trainer_rank, world_size=2, init_dist=False, args=(["--deepspeed", cfg],))
    rc, stdout, stderr = res[0]
"""

import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN = os.path.join(ROOT, "launch", "train.py")
BIN = os.path.dirname(sys.executable)


def launcher_env():
    """The environment for a launcher subprocess: this checkout on the import path, one
    compute thread per rank, the CPU accelerator, and this environment's ``deepspeed``
    and ``torchrun`` first on PATH."""
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu")
    env["PATH"] = BIN + os.pathsep + env.get("PATH", "")
    return env


def write_config(tmp_path, name, mutate=None):
    """ds_configs/<name>, changed in place by ``mutate(cfg)`` if given, written to
    ``tmp_path/<name>``; returns that path."""
    with open(os.path.join(ROOT, "ds_configs", name)) as f:
        cfg = json.load(f)
    if mutate:
        mutate(cfg)
    path = tmp_path / name
    path.write_text(json.dumps(cfg))
    return str(path)


def trainer_rank(argv):
    """launch/train.py's main() on one harness rank: (exit code, stdout, stderr)."""
    from ds_ext import trainer
    import io
    import contextlib
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = trainer.main(argv)
    return rc, out.getvalue(), err.getvalue()

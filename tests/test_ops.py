"""Compiled ops (ds_ext/ops.py): no launch waits in silence on a build.

Single process: the flock of a live build is waited for with a progress line and
taken when its holder lets go; torch's lock left by a killed build (no process holds
it) is removed in one line; one that a live process holds open is waited for. A fresh
interpreter: the config check of every shipped config (and their analogues) and the
planner on 128node.json load and build no op (torch's cpp_extension.load refuses
there), and the check reports which op builders the optimizer needs. End to end, on a
fresh home directory and build directory: launch/train.py SIGKILLed with its whole
process group while it builds DeepSpeed's shared-memory all-reduce, then the same
command, which says it removed the dead build's lock, builds and trains (about 45 s,
most of it the build; FusedAdam's finished build is copied in first, so that only the
faster of the two ops is built).
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import pytest

from ds_ext import ops

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _hold(path, flock, seconds, ready):
    """In a child process: hold ``path`` open (and flocked) for ``seconds``."""
    import fcntl
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    if flock:
        fcntl.flock(fd, fcntl.LOCK_EX)
    ready.set()
    time.sleep(seconds)
    os.close(fd)


def _holder(path, *, flock, seconds):
    import multiprocessing as mp
    ctx = mp.get_context("fork")
    ready = ctx.Event()
    p = ctx.Process(target=_hold, args=(path, flock, seconds, ready), daemon=True)
    p.start()
    assert ready.wait(30)
    return p


def test_a_live_build_is_waited_for_with_a_progress_line(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setattr(ops, "WAIT_LINE_S", 0.3)
    monkeypatch.setattr(ops, "FIRST_LINE_S", 0.1)
    directory = ops.build_directory("some_op")
    holder = _holder(directory + ops.LOCK_SUFFIX, flock=True, seconds=1.2)
    lines, began = [], time.monotonic()
    with ops.build_guard("some_op", log=lines.append):
        waited = time.monotonic() - began
    holder.join()
    assert waited >= 0.8, waited
    assert lines and all(line.startswith("ops: waiting for the build of some_op by another process")
                         for line in lines), lines
    assert len(lines) >= 3 and all("s so far" in line for line in lines), lines    # a line every WAIT_LINE_S


def test_a_killed_builds_lock_is_removed_in_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    baton = os.path.join(ops.build_directory("some_op"), "lock")
    open(baton, "w").close()                  # what torch's FileBaton leaves when its process is killed
    lines = []
    with ops.build_guard("some_op", log=lines.append):
        assert not os.path.exists(baton)
    assert len(lines) == 1 and lines[0].startswith(f"ops: removed {baton}, left by a build of some_op that was "
                                                   f"killed"), lines


def test_a_lock_a_live_process_holds_open_is_waited_for(tmp_path, monkeypatch):
    """A build outside seekspeed (torch's FileBaton keeps its lock open while it builds)."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setattr(ops, "WAIT_LINE_S", 0.3)
    monkeypatch.setattr(ops, "FIRST_LINE_S", 0.1)
    baton = os.path.join(ops.build_directory("some_op"), "lock")
    holder = _holder(baton, flock=False, seconds=1.0)
    lines = []

    def finish_then_release():               # the live build removes its lock when done, as torch's does
        holder.join()
        os.remove(baton)
    threading.Thread(target=finish_then_release, daemon=True).start()
    with ops.build_guard("some_op", log=lines.append):
        pass
    assert lines and lines[0].startswith(f"ops: waiting for the build of some_op by process {holder.pid}"), lines
    assert not any("removed" in line for line in lines), lines


_NO_OPS = r"""
import json, os, sys
import torch.utils.cpp_extension as cpp
def refuse(*args, **kwargs):
    raise AssertionError("a compiled op was built or loaded")
cpp.load = cpp._jit_compile = cpp._import_module_from_library = refuse
from deepspeed.ops.op_builder.builder import OpBuilder
from ds_ext.config import load_config
from ds_ext.planner import make_plan
from tests import config_analogues
out = {}
for name in config_analogues.config_names():
    cfg, world = config_analogues.analogue(name)
    path = os.path.join(sys.argv[1], name)
    with open(path, "w") as f:
        json.dump(cfg, f)
    out[name] = load_config(path, world_size=world).compiled_ops
torch_adam = dict(cfg, optimizer={"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}})
path = os.path.join(sys.argv[1], "torch_adam.json")
with open(path, "w") as f:
    json.dump(torch_adam, f)
out["torch_adam"] = load_config(path, world_size=world).compiled_ops
make_plan(os.path.join(config_analogues.CONFIGS, "128node.json"), nodes=128, ranks_per_node=8)
out["loaded"] = sorted(OpBuilder._loaded_ops)
print(json.dumps(out))
"""


def test_config_checks_and_the_planner_build_and_load_no_op(tmp_path):
    ext = tmp_path / "ext"
    ext.mkdir()
    env = dict(os.environ, PYTHONPATH=ROOT, TORCH_EXTENSIONS_DIR=str(ext), DS_ACCELERATOR="cpu")
    proc = subprocess.run([sys.executable, "-c", _NO_OPS, str(tmp_path)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out.pop("loaded") == []
    assert out.pop("torch_adam") == []
    assert {tuple(v) for v in out.values()} == {("FusedAdamBuilder",)}, out   # every shipped config: FusedAdam
    assert os.listdir(ext) == []                                      # not even a build directory


def _kill_group(proc):
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


@pytest.mark.e2e
def test_a_launch_after_one_killed_during_the_first_build_trains(tmp_path):
    home, ext = tmp_path / "home", tmp_path / "ext"
    home.mkdir()
    ext.mkdir()
    # FusedAdam's finished build, as a node that built it before would have: the launch builds
    # the shared-memory all-reduce first (about 30 s, against 50 s for FusedAdam) and is killed in it
    built = os.path.join(os.environ.get("TORCH_EXTENSIONS_DIR") or ops.environment_root(), "fused_adam")
    assert os.path.exists(os.path.join(built, "fused_adam.so")), built
    shutil.copytree(built, ext / "fused_adam", ignore=shutil.ignore_patterns("lock"))
    cfg = json.load(open(os.path.join(ROOT, "ds_configs", "tiny_1rank.json")))
    cfg["seekspeed"]["data"]["max_documents"] = 100
    cfg["seekspeed"]["report"] = {"plots": False}
    config = tmp_path / "tiny_1rank.json"
    config.write_text(json.dumps(cfg))
    env = dict(os.environ, HOME=str(home), TORCH_EXTENSIONS_DIR=str(ext), PYTHONPATH=ROOT, DS_ACCELERATOR="cpu",
               OMP_NUM_THREADS="1")
    cmd = [sys.executable, os.path.join(ROOT, "launch", "train.py"), "--deepspeed", str(config), "--steps", "1",
           "--checkpoint-dir", str(tmp_path / "ckpt")]
    baton = ext / "deepspeed_shm_comm" / "lock"
    first = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not baton.exists():
            assert first.poll() is None and time.monotonic() < deadline, first.communicate()[0][-3000:]
            time.sleep(0.05)
        time.sleep(2.0)                       # into the compile
        assert first.poll() is None
    finally:
        _kill_group(first)                    # the job, ninja and the compilers, as a preemption does
    assert baton.exists() and not (ext / "deepspeed_shm_comm" / "deepspeed_shm_comm.so").exists()

    second = subprocess.Popen(cmd + ["--resume", "auto"], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = second.communicate(timeout=400)
    finally:
        _kill_group(second)
    assert second.returncode == 0, out[-2000:] + err[-3000:]
    removed = [line for line in err.splitlines() if line.startswith("ops: removed")]
    assert len(removed) == 1 and "left by a build of deepspeed_shm_comm that was killed" in removed[0], err[-3000:]
    assert "ops: building DeepSpeed's deepspeed_shm_comm op" in err and "done: 1 steps" in out, err[-3000:]
    assert "ops: building DeepSpeed's fused_adam" not in err                  # built before: loaded as it is
    assert not baton.exists()

"""Elastic restarts end to end: a rank of a 2-rank tiny run (async-zstd checkpoints every
2 steps, ``--resume auto``) is killed with SIGKILL after a checkpoint has been
committed, and the job comes back from the newest complete checkpoint and finishes
without a person: under ``torchrun --max_restarts 1``, and under DeepSpeed's launcher
wrapped by launch/elastic.py. About 100 s on 2 cores."""

import json
import os
import re
import signal
import subprocess
import sys
import time

import psutil
import pytest

from tests.distributed import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.path.dirname(sys.executable)


def _config(tmp_path):
    with open(os.path.join(ROOT, "ds_configs", "tiny_cpu.json")) as f:
        cfg = json.load(f)
    cfg["seekspeed"]["checkpoint"] = {"dir": str(tmp_path / "ckpt"), "interval_steps": 2, "engine": "async-zstd",
                                      "keep_last": 2}
    cfg["seekspeed"]["train"]["log_interval"] = 1
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps(cfg))
    return str(path)


def _workers(launcher):
    """The launcher's training processes (python -u launch/train.py ...)."""
    found = []
    for proc in psutil.Process(launcher.pid).children(recursive=True):
        try:
            cmd = proc.cmdline()
        except psutil.NoSuchProcess:
            continue
        if len(cmd) > 2 and cmd[2].endswith(os.path.join("launch", "train.py")):
            found.append(proc)
    return found


def _kill_a_rank_after(launcher, log_path, pattern, timeout=240):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert launcher.poll() is None, open(log_path).read()[-3000:]
        if re.search(pattern, open(log_path).read()):
            victims = _workers(launcher)
            assert len(victims) == 2, victims
            victims[-1].send_signal(signal.SIGKILL)
            return victims[-1].pid
        time.sleep(0.1)
    launcher.kill()
    raise AssertionError(f"no {pattern!r} within {timeout} s:\n" + open(log_path).read()[-3000:])


def _run_and_kill(tmp_path, cmd):
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu")
    env["PATH"] = BIN + os.pathsep + env.get("PATH", "")
    log_path = tmp_path / "out.log"
    with open(log_path, "w") as log:
        launcher = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            _kill_a_rank_after(launcher, log_path, r"checkpoint global_step4 committed")
            rc = launcher.wait(timeout=300)
        finally:
            if launcher.poll() is None:
                launcher.kill()
    out = open(log_path).read()
    assert rc == 0, out[-4000:]
    resumed = re.findall(r"resumed from \S*global_step(\d+)\S* at step (\d+)", out)
    assert len(resumed) == 1 and int(resumed[0][0]) >= 4, out[-4000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["final_step"] == 12 and summary["start_step"] == int(resumed[0][0])
    assert (tmp_path / "ckpt" / "latest").read_text() == "global_step12"
    return out


@pytest.mark.e2e
def test_torchrun_restarts_a_killed_rank_from_the_newest_checkpoint(tmp_path):
    cfg = _config(tmp_path)
    out = _run_and_kill(tmp_path, [os.path.join(BIN, "torchrun"), "--nproc_per_node", "2", "--max_restarts", "1",
                                   "--rdzv_backend", "c10d", "--rdzv_endpoint", f"127.0.0.1:{free_port()}", os.path.join("launch", "train.py"),
                                   "--deepspeed", cfg, "--steps", "12", "--resume", "auto",
                                   "--summary-json", str(tmp_path / "summary.json")])
    assert "starting fresh" in out


@pytest.mark.e2e
def test_elastic_wrapper_restarts_the_deepspeed_launcher(tmp_path):
    cfg = _config(tmp_path)
    out = _run_and_kill(tmp_path, [sys.executable, os.path.join("launch", "elastic.py"), "--max-restarts", "1",
                                   "--delay", "1", "--",
                                   os.path.join(BIN, "deepspeed"), "--num_gpus", "2", "--master_port",
                                   str(free_port()), os.path.join("launch", "train.py"), "--deepspeed", cfg,
                                   "--steps", "12", "--resume", "auto",
                                   "--summary-json", str(tmp_path / "summary.json")])
    assert "elastic: attempt 1 exited with code" in out and "elastic: the job finished (attempt 2)" in out


def test_elastic_wrapper_refuses_a_command_that_would_not_resume():
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "launch", "elastic.py"), "--", "deepspeed",
                           "launch/train.py", "--deepspeed", "x.json"], capture_output=True, text=True)
    assert proc.returncode == 2 and "add --resume auto" in proc.stderr.strip().splitlines()[-1]

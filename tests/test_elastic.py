"""Elastic restarts end to end: a rank of a 2-rank tiny run (async-zstd checkpoints every
2 steps, ``--resume auto``) is killed with SIGKILL after a checkpoint has been
committed, and the job comes back from the newest complete checkpoint and finishes
without a person: under ``torchrun --max_restarts 1``, and under DeepSpeed's launcher
wrapped by launch/elastic.py. With ``--live-hosts`` the wrapper launches each attempt on
the hostfile's hosts that answer its probe (a launcher stand-in records what it got; the
resumed run on fewer replicas itself is tested in test_reshard.py). About 100 s on 2 cores."""

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


_FAKE_LAUNCHER = """
import sys, os, json
hostfile = sys.argv[sys.argv.index("--hostfile") + 1]
log, alive = sys.argv[-2], sys.argv[-1]
with open(log, "a") as f:
    f.write(json.dumps(open(hostfile).read().split()) + "\\n")
attempts = sum(1 for _ in open(log))
if attempts == 1:
    os.remove(os.path.join(alive, "nodeB"))       # a node dies during the first attempt
    sys.exit(1)
sys.exit(0)
"""


def test_live_hosts_relaunches_on_the_hosts_that_answer(tmp_path):
    alive = tmp_path / "alive"
    alive.mkdir()
    for host in ("nodeA", "nodeB"):
        (alive / host).touch()
    hosts = tmp_path / "hosts"
    hosts.write_text("# two nodes\nnodeA slots=8\nnodeB slots=8\n")
    fake = tmp_path / "launcher.py"
    fake.write_text(_FAKE_LAUNCHER)
    log = tmp_path / "attempts.log"
    cmd = [sys.executable, os.path.join(ROOT, "launch", "elastic.py"), "--live-hosts", "--probe",
           f"test -e {alive}/{{host}}", "--delay", "0", "--max-restarts", "2", "--",
           sys.executable, str(fake), "--hostfile", str(hosts), "launch/train.py", "--resume", "auto", str(log),
           str(alive)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    seen = [json.loads(line) for line in log.read_text().splitlines()]
    assert seen == [["nodeA", "slots=8", "nodeB", "slots=8"], ["nodeA", "slots=8"]]
    assert "1 of 2 hosts answer (lost: nodeB)" in proc.stdout and "the job finished (attempt 2)" in proc.stdout
    assert hosts.read_text().count("slots") == 2                  # the user's hostfile is left alone
    # fewer hosts than --min-hosts: no launch, and no restarts left
    proc = subprocess.run(cmd[:2] + ["--min-hosts", "2"] + cmd[2:], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and "fewer than --min-hosts 2; not launching" in proc.stdout
    assert len(log.read_text().splitlines()) == 2


def test_live_hosts_needs_a_hostfile():
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "launch", "elastic.py"), "--live-hosts", "--",
                           "deepspeed", "launch/train.py", "--resume", "auto"], capture_output=True, text=True)
    assert proc.returncode == 2 and "give the launcher --hostfile FILE" in proc.stderr.strip().splitlines()[-1]

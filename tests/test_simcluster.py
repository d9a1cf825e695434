"""The simulated cluster: 2 network-namespace nodes x 2 ranks joined by tc-shaped
links run launch/train.py through one DeepSpeed launcher per node; everything is
torn down after success and after failure. Needs root and ip netns (skipped with the
reason where the sandbox forbids them; CI here permits them). About 60 s."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SIM = os.path.join(ROOT, "launch", "simcluster.py")


def _netns_allowed():
    if os.geteuid() != 0:
        return "not root"
    name = f"sscheck{os.getpid()}"
    add = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True)
    if add.returncode != 0:
        return f"ip netns add failed: {add.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", name], capture_output=True)
    return None


REASON = _netns_allowed()
pytestmark = [pytest.mark.e2e, pytest.mark.skipif(REASON is not None, reason=f"network namespaces unavailable: {REASON}")]


def _namespaces():
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout


def _sim(args, timeout=600):
    env = dict(os.environ, PYTHONPATH=ROOT)
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    return subprocess.run([sys.executable, SIM, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


def test_training_the_v3_layout_in_miniature_on_simulated_nodes(tmp_path):
    """ds_configs/128node_v3_tiny.json, the 128node_v3.json layout at tiny scale: the
    same schedule, MTP, bf16 with fp32 accumulation, ZeRO 1 and the balanced cut, on 4
    simulated nodes of 1 rank, so that as in production each expert-parallel group
    (data-parallel ranks 0 and 1 of a stage) spans two nodes and so does the pipeline."""
    before = _namespaces()
    summary = tmp_path / "s.json"
    proc = _sim(["--nodes", "4", "--ranks-per-node", "1", "--rate", "1gbit", "--master-port", "29633", "--tail", "400", "--",
                 "launch/train.py", "--deepspeed", "ds_configs/128node_v3_tiny.json", "--steps", "3",
                 "--checkpoint-dir", str(tmp_path / "ckpt"), "--summary-json", str(summary)])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    s = json.loads(summary.read_text())
    assert s["layout"]["world_size"] == 4 and s["steps"] == 3
    assert s["layout"]["schedule"] == "dualpipev-zb" and set(s["loss_parts"][-1]) == {"lm", "mtp"}
    assert len(s["moe"]["expert_load"]) == 4          # 3 MoE decoder layers + the MTP layer's
    assert "simcluster: 4 nodes x 1 ranks" in proc.stdout
    from ds_ext.planner import make_plan
    plan = make_plan("ds_configs/128node_v3_tiny.json", nodes=4, ranks_per_node=1)
    cut = ", ".join(f"stage {p}: layers [{plan.bounds[p]},{plan.bounds[p + 1]})" for p in range(4))
    assert f"balanced partition (planner costs): {cut}" in proc.stdout
    prefix = proc.stdout.split("namespaces ", 1)[1].split("-*", 1)[0]
    assert prefix not in _namespaces() and prefix not in before          # torn down (others' may come and go)


def test_failure_tears_everything_down(tmp_path):
    before = _namespaces()
    proc = _sim(["--nodes", "2", "--ranks-per-node", "1", "--master-port", "29634", "--", "launch/train.py",
                 "--deepspeed", str(tmp_path / "missing.json")])
    assert proc.returncode != 0
    assert "does not exist" in proc.stdout
    assert _namespaces() == before

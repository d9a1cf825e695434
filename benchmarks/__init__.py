"""One script per measured claim; each prints a table and writes its figures with --json."""

import json
import os
import socket
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def write_figures(path, figures):
    """Write ``figures`` (plus the command that made them) as JSON to ``path``; None: nothing."""
    if not path:
        return
    figures = {"command": " ".join([os.path.basename(sys.argv[0])] + sys.argv[1:]), **figures}
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(figures, f, indent=2)
    print(f"figures: {path}")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(script_args, *, world, summary_json, what):
    """``deepspeed --num_gpus WORLD SCRIPT_ARGS --summary-json SUMMARY_JSON`` from the
    repository root, one CPU thread per rank; the summary it wrote, or exit with the
    run's output tail naming ``what`` failed."""
    cmd = [os.path.join(os.path.dirname(sys.executable), "deepspeed"), "--num_gpus", str(world), "--master_port",
           str(free_port()), *script_args, "--summary-json", summary_json]
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"{what} failed (exit {proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    with open(summary_json) as f:
        return json.load(f)

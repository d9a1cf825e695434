"""Kill and resume as a user meets it: `python launch/train.py` on a shipped config,
a checkpoint every step, SIGKILLed from outside (its whole process group) at a random
moment once training has begun, then the same command with `--resume auto`; repeated
--trials times per checkpoint engine. Counts the restarts that resumed (and from
which step), that started fresh, and that failed; a failed one's last error line is
kept. The in-suite matrix (tests/test_kill_resume.py) kills at chosen points of the
save path and compares bitwise; this is the outside view, with real interpreters.

    python benchmarks/kill_resume_cli.py --config ds_configs/tiny_1rank.json --trials 10 \\
        --json benchmarks/results/kill_resume_cli.json

Each trial starts from an empty checkpoint directory and runs --steps steps; the kill
lands uniformly in [first step printed, + --window s]. About 20 s a trial on 2 cores.
"""

import argparse
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks import machine_line, write_figures


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="ds_configs/tiny_1rank.json")
    p.add_argument("--engines", nargs="+", default=["deepspeed", "async-zstd"])
    p.add_argument("--trials", type=int, default=20, help="per engine")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--window", type=float, default=2.5, help="seconds after the first step in which the kill lands")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="PATH")
    return p.parse_args(argv)


def _config(path, engine, directory):
    with open(os.path.join(ROOT, path)) as f:
        cfg = json.load(f)
    ckpt = cfg["seekspeed"].setdefault("checkpoint", {})
    ckpt.update(engine=engine, interval_steps=1)
    ckpt.pop("interval_seconds", None)
    if engine != "async-zstd":
        ckpt.pop("keep_last", None)
    cfg["seekspeed"].setdefault("report", {})["plots"] = False
    out = os.path.join(directory, f"{engine}.json")
    with open(out, "w") as f:
        json.dump(cfg, f)
    return out


def _command(cfg, ckpt, steps, resume):
    cmd = [sys.executable, os.path.join(ROOT, "launch", "train.py"), "--deepspeed", cfg, "--steps", str(steps),
           "--checkpoint-dir", ckpt]
    return cmd + (["--resume", "auto"] if resume else [])


def _env():
    return dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1", DS_ACCELERATOR=os.environ.get("DS_ACCELERATOR",
                                                                                              "cpu"))


def _kill_at_random(cmd, rng, window):
    """Start ``cmd``; SIGKILL its process group at a random moment after its first step
    line. Returns (seconds after the first step, whether it was still running)."""
    proc = subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        for line in proc.stdout:
            if line.startswith("step "):
                break
        delay = rng.uniform(0.0, window)
        time.sleep(delay)
        running = proc.poll() is None
        os.killpg(proc.pid, signal.SIGKILL)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
    return delay, running


def _restart(cmd):
    proc = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=600,
                          start_new_session=True)
    out = proc.stdout + proc.stderr
    resumed = re.search(r"resumed from \S*global_step(\d+)\S* at step (\d+)", out)
    if proc.returncode == 0:
        outcome = "resumed" if resumed else "fresh"
    else:
        outcome = "failed"
    error = next((line for line in reversed(out.splitlines()) if "Error" in line or line.startswith("error")), "")
    return {"outcome": outcome, "rc": proc.returncode, "resumed_from": int(resumed.group(2)) if resumed else None,
            "error": error if outcome == "failed" else ""}


def main(argv=None):
    args = parse_args(argv)
    rng = random.Random(args.seed)
    rows = []
    print(machine_line())
    with tempfile.TemporaryDirectory(prefix="kill-resume-") as tmp:
        for engine in args.engines:
            cfg = _config(args.config, engine, tmp)
            for trial in range(args.trials):
                ckpt = os.path.join(tmp, f"{engine}-{trial}")
                delay, running = _kill_at_random(_command(cfg, ckpt, args.steps, False), rng, args.window)
                row = {"engine": engine, "trial": trial, "kill_after_first_step_s": round(delay, 3),
                       "killed_while_running": running, **_restart(_command(cfg, ckpt, args.steps, True))}
                rows.append(row)
                print(f"{engine:10} trial {trial:3}: killed {delay:5.2f} s after step 1 -> {row['outcome']}"
                      f"{'' if row['resumed_from'] is None else ' from step ' + str(row['resumed_from'])}"
                      f"{' ' + row['error'] if row['error'] else ''}", flush=True)
    print(f"\n{'engine':10} {'trials':>6} {'resumed':>8} {'fresh':>6} {'failed':>7}")
    summary = {}
    for engine in args.engines:
        mine = [r for r in rows if r["engine"] == engine]
        counts = {k: sum(r["outcome"] == k for r in mine) for k in ("resumed", "fresh", "failed")}
        summary[engine] = {"trials": len(mine), **counts}
        print(f"{engine:10} {len(mine):6} {counts['resumed']:8} {counts['fresh']:6} {counts['failed']:7}")
    write_figures(args.json, {"config": args.config, "steps": args.steps, "summary": summary, "rows": rows})
    return 1 if any(r["outcome"] == "failed" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())

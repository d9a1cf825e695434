"""Does a long run leak? The tiny recipe for --steps steps on --world ranks under
DeepSpeed's launcher, async-zstd checkpoints every --interval steps, the tiered data
pipeline with a hot tier, while a sampler watches every training process.

    python benchmarks/soak.py --json benchmarks/results/soak.json

Every --sample-s seconds the sampler reads each rank's resident memory and open file
descriptors (psutil) and the entries of /dev/shm; the step comes from rank 0's progress
lines (log interval 10). Reported per rank at the --early step (200) and at the end (20
steps before the last, so that the final save and the shutdown are not in it):
peak RSS so far, open descriptors (least and most over the last 10 s: a save in flight
holds a few for a moment), and the shared-memory entries. The goal: under 5 % peak-RSS
growth from step 200 to the end; no rank's resting descriptor count (the least over the
window) above its count at step 200; nothing in /dev/shm at the end or after exit that
was not there before the run (other programs' transient entries come and go). A
benchmark, not a test: about 40 minutes on 2 cores for 2,000 steps.
"""

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks import machine_line, write_figures
from ds_ext.distributed import free_port


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--early", type=int, default=200, help="the step the end is compared with")
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--interval", type=int, default=20, help="checkpoint every N steps")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--sample-s", type=float, default=0.5)
    p.add_argument("--json", metavar="PATH")
    return p.parse_args(argv)


def _config(work, args):
    with open(os.path.join(ROOT, "ds_configs", "tiny_cpu.json")) as f:
        cfg = json.load(f)
    s = cfg["seekspeed"]
    s["data"].update(seq_len=args.seq_len, pipeline="tiered", cache_dir=os.path.join(work, "cold"),
                     hot_dir=os.path.join(work, "hot"), hot_budget_mb=16, rows_per_shard=512)
    s["checkpoint"] = {"dir": os.path.join(work, "ckpt"), "interval_steps": args.interval, "engine": "async-zstd",
                       "keep_last": 2}
    s["train"].update(steps=args.steps, log_interval=10)
    s["report"] = {"plots": False}
    path = os.path.join(work, "soak.json")
    with open(path, "w") as f:
        json.dump(cfg, f)
    return path


def _shm():
    try:
        return sorted(os.listdir("/dev/shm"))
    except OSError:
        return []


class Sampler(threading.Thread):
    """Per training process: the peak RSS seen so far, and the open descriptors over the
    last --window-s seconds (their minimum: a checkpoint being written holds a few more
    for a moment), snapshotted when rank 0 logs a given step."""

    def __init__(self, launcher, interval):
        super().__init__(daemon=True)
        self.launcher, self.interval = launcher, interval
        self.peak, self.fds, self.step = {}, {}, 0
        self.window_s = 10.0
        self.marks = {}
        self.stop = False

    def workers(self):
        import psutil
        out = {}
        try:
            children = psutil.Process(self.launcher.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return out
        for proc in children:
            try:
                cmd = proc.cmdline()
                rank = next((c.split("=", 1)[1] for c in cmd if c.startswith("--local_rank=")), None)
                if rank is not None and any(c.endswith(os.path.join("launch", "train.py")) for c in cmd):
                    out[int(rank)] = proc
            except psutil.Error:
                continue
        return out

    def run(self):
        import psutil
        while not self.stop:
            for rank, proc in self.workers().items():
                try:
                    rss = proc.memory_info().rss / 2**20
                    fds = proc.num_fds()
                except psutil.Error:
                    continue
                self.peak[rank] = max(self.peak.get(rank, 0.0), rss)
                now = time.monotonic()
                recent = [(t, n) for t, n in self.fds.get(rank, []) if now - t <= self.window_s]
                self.fds[rank] = recent + [(now, fds)]
            time.sleep(self.interval)

    def mark(self, step):
        self.marks[step] = {"peak_rss_mib": dict(sorted(self.peak.items())),
                            "open_fds": {r: min(n for _, n in v) for r, v in sorted(self.fds.items())},
                            "open_fds_max": {r: max(n for _, n in v) for r, v in sorted(self.fds.items())},
                            "dev_shm": _shm()}


def main(argv=None):
    args = parse_args(argv)
    work = tempfile.mkdtemp(prefix="seekspeed-soak-")
    cfg = _config(work, args)
    shm_before = _shm()
    cmd = [os.path.join(os.path.dirname(sys.executable), "deepspeed"), "--num_gpus", str(args.world), "--master_port",
           str(free_port()), "launch/train.py", "--deepspeed", cfg, "--summary-json", os.path.join(work, "s.json")]
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    log_path = os.path.join(work, "out.log")
    start = time.monotonic()
    with open(log_path, "w") as log:
        launcher = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        sampler = Sampler(launcher, args.sample_s)
        sampler.start()
        seen, pattern = 0, re.compile(r"step\s+(\d+)/(\d+) \| loss")
        try:
            while launcher.poll() is None:
                time.sleep(1.0)
                with open(log_path) as f:
                    steps = [int(m.group(1)) for m in pattern.finditer(f.read())]
                step = max(steps, default=0)
                if step >= args.early and args.early not in sampler.marks:
                    time.sleep(2 * args.sample_s)
                    sampler.mark(args.early)
                if step >= args.steps - 20 and "end" not in sampler.marks:
                    time.sleep(2 * args.sample_s)       # 20 steps before the last: before the final save and exit
                    sampler.mark("end")
                if step != seen and step % 200 == 0:
                    print(f"soak: step {step}/{args.steps} ({time.monotonic() - start:.0f} s)", flush=True)
                seen = step
        finally:
            sampler.stop = True
            if launcher.poll() is None:
                launcher.kill()
    rc = launcher.wait()
    wall = time.monotonic() - start
    if rc != 0 or args.early not in sampler.marks or "end" not in sampler.marks:
        sys.exit(f"soak run failed (exit {rc}):\n" + open(log_path).read()[-3000:])
    time.sleep(1.0)
    shm_after = _shm()
    early, end = sampler.marks[args.early], sampler.marks["end"]
    rows = []
    for rank in sorted(end["peak_rss_mib"]):
        a, b = early["peak_rss_mib"][rank], end["peak_rss_mib"][rank]
        rows.append({"rank": rank, "peak_rss_mib_early": round(a, 1), "peak_rss_mib_end": round(b, 1),
                     "growth": (b - a) / a, "open_fds_early": early["open_fds"][rank],
                     "open_fds_end": end["open_fds"][rank], "open_fds_max_early": early["open_fds_max"][rank],
                     "open_fds_max_end": end["open_fds_max"][rank]})
    with open(os.path.join(work, "s.json")) as f:
        summary = json.load(f)
    committed = [h for h in summary.get("checkpoint_history", []) if h.get("status") == "committed"]
    print(machine_line())
    print(f"\n{args.steps} steps on {args.world} ranks in {wall / 60:.1f} min; {len(committed)} checkpoints committed; "
          f"the end compared with step {args.early}")
    print(f"{'rank':>4}  {'peak RSS @' + str(args.early):>14}  {'peak RSS end':>12}  {'growth':>7}  "
          f"{'fds @' + str(args.early) + ' (min-max)':>18}  {'fds end (min-max)':>18}")
    for r in rows:
        print(f"{r['rank']:>4}  {r['peak_rss_mib_early']:>10.1f} MiB  {r['peak_rss_mib_end']:>8.1f} MiB  "
              f"{r['growth']:>+7.2%}  {str(r['open_fds_early']) + '-' + str(r['open_fds_max_early']):>18}  "
              f"{str(r['open_fds_end']) + '-' + str(r['open_fds_max_end']):>18}")
    print(f"/dev/shm: {len(shm_before)} entries before, {len(early['dev_shm'])} at step {args.early}, "
          f"{len(end['dev_shm'])} at the end, {len(shm_after)} after exit")
    worst = max(r["growth"] for r in rows)
    fds_held = all(r["open_fds_end"] <= r["open_fds_early"] for r in rows)
    shm_left = sorted((set(end["dev_shm"]) | set(shm_after)) - set(shm_before))
    print(f"goal (peak RSS growth under 5 %, no more resting descriptors, nothing new left in /dev/shm): "
          f"{'met' if worst < 0.05 and fds_held and not shm_left else 'NOT met'} (worst growth {worst:+.2%}; "
          f"descriptors {'held' if fds_held else 'grew'}; /dev/shm left: {shm_left or 'nothing'})")
    write_figures(args.json, {"steps": args.steps, "early_step": args.early, "world": args.world,
                              "interval": args.interval, "wall_s": wall, "committed_checkpoints": len(committed),
                              "ranks": rows, "dev_shm_before": shm_before, "dev_shm_early": early["dev_shm"],
                              "dev_shm_end": end["dev_shm"], "dev_shm_after": shm_after,
                              "worst_growth": worst, "final_loss": summary.get("loss_last")})
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()

"""How fast is a packed cache built, and what does the engine cost? launch/prepare_data.py's
path on datatrove's local executor and on a local Ray instance, with 1 and 2 workers.

    python benchmarks/prepare_data.py --json benchmarks/results/prepare_data.json

A synthetic JSON Lines corpus of --corpus-mb (in --files files) is cut into parts of
--part-mb and packed into rows of --seq-len + 1 byte-level tokens, from scratch each
time, by each engine and worker count: tokens/s of tokenise-and-pack (wall time of the
whole build, index included). The engine's own overhead per task: the same command with
--overhead-tasks tasks over a build whose parts are all packed already (each task finds
nothing to do), wall time per task. Peak resident memory of a packing worker, at
--corpus-mb and at three times that (the corpus streams through a task: it should not
grow). Then a projection, stated as one: what --project-workers workers would take for
--project-tokens tokens at the measured per-worker rate plus the per-task overhead of
--project-tasks tasks (assumes the cold store gives every worker its read rate and
tasks scale linearly; a real tokenizer is slower than bytes, see the note in the table).
About 3 minutes on 2 cores.
"""

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks import machine_line, write_figures


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--corpus-mb", type=float, default=32.0)
    p.add_argument("--files", type=int, default=4)
    p.add_argument("--part-mb", type=float, default=2.0)
    p.add_argument("--seq-len", type=int, default=2047)
    p.add_argument("--engines", nargs="+", default=["local", "ray"], choices=["local", "ray"])
    p.add_argument("--workers", nargs="+", type=int, default=[1, 2])
    p.add_argument("--overhead-tasks", type=int, default=8)
    p.add_argument("--project-tokens", type=float, default=1e12)
    p.add_argument("--project-workers", type=int, default=128)
    p.add_argument("--project-tasks", type=int, default=4096)
    p.add_argument("--json", metavar="PATH")
    return p.parse_args(argv)


def make_corpus(directory, mb, files):
    import numpy as np
    os.makedirs(directory, exist_ok=True)
    rng = np.random.default_rng(0)
    words = [f"w{i}" for i in range(5000)]
    for k in range(files):
        written = 0
        with open(os.path.join(directory, f"c{k:03d}.jsonl"), "w") as f:
            while written < mb * 1e6 / files:
                text = " ".join(words[i] for i in rng.integers(0, len(words), size=int(rng.integers(50, 3000))))
                f.write(json.dumps({"text": text}) + "\n")
                written += len(text)


def config(tmp, corpus, cache, args):
    with open(os.path.join(ROOT, "ds_configs", "tiny_cpu.json")) as f:
        cfg = json.load(f)
    cfg["seekspeed"]["data"].update(source=corpus, seq_len=args.seq_len, pipeline="tiered", cache_dir=cache,
                                    rows_per_shard=256, part_mb=args.part_mb)
    path = os.path.join(tmp, f"cfg-{os.path.basename(cache)}.json")
    with open(path, "w") as f:
        json.dump(cfg, f)
    return path


def prepare(cfg, engine, *, tasks, workers):
    """Run launch/prepare_data.py in a fresh process; (wall s, its stdout)."""
    env = dict(os.environ, PYTHONPATH=ROOT, RAY_TMPDIR=tempfile.mkdtemp(prefix="ray-", dir="/tmp"),
               RAY_USAGE_STATS_ENABLED="0")
    cmd = [sys.executable, os.path.join(ROOT, "launch", "prepare_data.py"), "--deepspeed", cfg, "--executor", engine,
           "--tasks", str(tasks), "--workers", str(workers)]
    t = time.perf_counter()
    run = subprocess.run(cmd, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - t
    shutil.rmtree(env["RAY_TMPDIR"], ignore_errors=True)
    if run.returncode != 0:
        raise SystemExit(f"prepare_data failed ({engine}, {tasks} tasks):\n{run.stdout[-2000:]}\n{run.stderr[-3000:]}")
    return wall, run.stdout


def index_of(cache):
    (key,) = [d for d in os.listdir(cache) if not d.startswith(".")]
    with open(os.path.join(cache, key, "index.json")) as f:
        return os.path.join(cache, key), json.load(f)


def main(argv=None):
    args = parse_args(argv)
    tmp = tempfile.mkdtemp(prefix="seekspeed-prepare-")
    rows, overhead = [], {}
    try:
        corpus = os.path.join(tmp, "corpus")
        make_corpus(corpus, args.corpus_mb, args.files)
        reference = None
        for engine in args.engines:
            for workers in args.workers:
                cache = os.path.join(tmp, f"cache-{engine}-{workers}")
                cfg = config(tmp, corpus, cache, args)
                wall, _ = prepare(cfg, engine, tasks=workers, workers=workers)
                store, index = index_of(cache)
                digest = hashlib.sha256()
                for s in index["shards"]:
                    with open(os.path.join(store, s["name"]), "rb") as f:
                        digest.update(f.read())
                shards = digest.hexdigest()
                reference = reference or shards
                same = shards == reference
                rows.append({"engine": engine, "workers": workers, "tasks": workers, "wall_s": wall,
                             "tokens": index["tokens"], "parts": index["parts"], "tokens_per_s": index["tokens"] / wall,
                             "same_shards": same})
                print(f"  {engine:5s} {workers} worker(s): {index['tokens'] / wall:>12,.0f} tokens/s "
                      f"({wall:.1f} s for {index['tokens']:,} tokens in {index['parts']} parts; same shards: {same})",
                      flush=True)
                # the engine alone: every part is packed, the tasks find nothing to do
                os.rename(store, store + ".done")
                build = os.path.join(cache, f".building-{os.path.basename(store)}")
                shutil.copytree(store + ".done", build, ignore=shutil.ignore_patterns("logs", "index.json"))
                t_wall, _ = prepare(cfg, engine, tasks=args.overhead_tasks, workers=workers)
                idle, _ = prepare(cfg, engine, tasks=args.overhead_tasks, workers=workers)   # found
                overhead[(engine, workers)] = (t_wall - idle) * workers / args.overhead_tasks
                print(f"        engine overhead {overhead[(engine, workers)]:.2f} s per task "
                      f"({args.overhead_tasks} idle tasks: {t_wall:.1f} s, the same command finding the cache: "
                      f"{idle:.1f} s)", flush=True)
                shutil.rmtree(cache, ignore_errors=True)
        # streaming: a packing worker's peak memory does not grow with the corpus
        rss = {}
        for scale in (1, 3):
            directory = os.path.join(tmp, f"corpus-x{scale}")
            make_corpus(directory, args.corpus_mb * scale, args.files * scale)
            cache = os.path.join(tmp, f"cache-rss-{scale}")
            probe = f"""
import resource, runpy, sys
sys.argv = ["prepare_data.py", "--deepspeed", {config(tmp, directory, cache, args)!r}, "--tasks", "1"]
try:
    runpy.run_path({os.path.join(ROOT, "launch", "prepare_data.py")!r}, run_name="__main__")
except SystemExit:
    pass
print("RSS", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
"""
            out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                                 env=dict(os.environ, PYTHONPATH=ROOT)).stdout
            rss[scale] = float(out.rsplit("RSS", 1)[1])
            shutil.rmtree(directory, ignore_errors=True)
            shutil.rmtree(cache, ignore_errors=True)
            print(f"  peak memory of one packing process, corpus {args.corpus_mb * scale:g} MB: {rss[scale]:.0f} MB",
                  flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    one = {r["engine"]: r["tokens_per_s"] for r in rows if r["workers"] == 1}
    best = max(one.values())
    engine_best = max(one, key=one.get)
    per_task = overhead[(engine_best, 1)]
    hours = (args.project_tokens / (best * args.project_workers)
             + per_task * args.project_tasks / args.project_workers) / 3600
    print(machine_line())
    print()
    print(f"{'engine':>6} {'workers':>8} {'tokens/s':>12} {'vs 1 worker':>12} {'overhead s/task':>16} {'same shards':>12}")
    for r in rows:
        base = one[r["engine"]]
        print(f"{r['engine']:>6} {r['workers']:>8} {r['tokens_per_s']:>12,.0f} {r['tokens_per_s'] / base:>11.2f}x "
              f"{overhead[(r['engine'], r['workers'])]:>16.2f} {str(r['same_shards']):>12}")
    print(f"peak memory of a packing process: {rss[1]:.0f} MB at {args.corpus_mb:g} MB of corpus, {rss[3]:.0f} MB at "
          f"{3 * args.corpus_mb:g} MB")
    print(f"projection (not a measurement): {args.project_tokens:.0e} tokens on {args.project_workers} workers at "
          f"{best:,.0f} tokens/s each ({engine_best}, 1 worker, byte tokenizer) + {per_task:.2f} s x "
          f"{args.project_tasks} tasks: {hours:.1f} hours")
    write_figures(args.json, {
        "args": vars(args), "runs": rows,
        "overhead_s_per_task": {f"{e}-{w}": v for (e, w), v in overhead.items()},
        "peak_rss_mb": {"corpus_mb": [args.corpus_mb, 3 * args.corpus_mb], "rss_mb": [rss[1], rss[3]]},
        "projection": {"tokens": args.project_tokens, "workers": args.project_workers, "tasks": args.project_tasks,
                       "tokens_per_s_per_worker": best, "engine": engine_best, "hours": hours}})


if __name__ == "__main__":
    main()

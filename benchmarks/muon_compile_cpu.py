"""DeepSpeed's Muon update on the CPU accelerator, compiled (DeepSpeed's own
``torch.compile``) against eager (what ``seekspeed.muon_update: "auto"`` runs there,
ds_ext/muon.py ``set_update``): the first optimizer step (tracing and compiling included),
the frames Dynamo compiled, and the steady step, over the Newton-Schulz matrices of a
recipe preset (every stage's, one process, one thread as a rank has).

    python benchmarks/muon_compile_cpu.py --repeats 3 --json benchmarks/results/muon_compile_cpu.json

Each run is a fresh interpreter (Dynamo's caches start empty, as in a launched rank);
``compiled-cold`` also starts with an empty Inductor cache directory, ``compiled-warm``
reuses the one its repetition's cold run filled (a node's second launch). Repetitions
interleave the modes. A step: ``muon_update`` on every matrix with a fresh gradient.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks import machine_line, write_figures

MODES = ("eager", "compiled-cold", "compiled-warm")


def _child(mode, recipe, preset, steps):
    import time
    import torch
    torch.set_num_threads(1)
    import torch._dynamo.utils
    from deepspeed.runtime.zero.muon import original_muon
    from ds_ext.muon import muon_matrices, set_update
    from recipes import get_recipe
    from recipes.layers.reference import SequentialReference
    spec = get_recipe(recipe)
    model = SequentialReference(spec.layer_specs(spec.make_config(preset), seed=0))
    found = muon_matrices(model, prefix="model.", expert_ids=spec.expert_parameter_ids(model))
    shapes = found[False] + found[True]
    set_update("eager" if mode == "eager" else "compiled")
    update = original_muon.muon_update
    g = torch.Generator().manual_seed(0)
    grads = [torch.randn(s, generator=g) for s in shapes]
    momenta = [torch.zeros(s) for s in shapes]

    def step():
        t0 = time.perf_counter()
        for grad, m in zip(grads, momenta):
            update(grad.clone(), m, 0.95, ns_method="gram")
        return time.perf_counter() - t0
    first = step()
    step()                                    # a second shape history settles Dynamo's dynamic recompiles
    runs = [step() for _ in range(steps)]
    frames = torch._dynamo.utils.counters["frames"]
    return {"first_step_s": first, "step_ms": 1e3 * statistics.median(runs), "frames_compiled": frames["ok"],
            "matrices": len(shapes), "elements": sum(a * b for a, b in shapes)}


def _run(mode, recipe, preset, steps, cache_dir):
    env = dict(os.environ, PYTHONPATH=ROOT, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1",
               TORCHINDUCTOR_CACHE_DIR=cache_dir)
    proc = subprocess.run([sys.executable, __file__, "--child", mode, "--recipe", recipe, "--preset", preset,
                           "--steps", str(steps)], cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"muon_compile_cpu: the {mode} run failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--recipe", default="deepseek_v4")
    p.add_argument("--preset", default="tiny")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=10, help="timed steps per run, after the first two")
    p.add_argument("--json", help="write the figures here")
    p.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(_child(args.child, args.recipe, args.preset, args.steps)))
        return
    runs = {m: [] for m in MODES}
    for rep in range(args.repeats):
        with tempfile.TemporaryDirectory(prefix="seekspeed-inductor-") as cache:
            for mode in MODES:
                print(f"[{rep + 1}/{args.repeats}] {mode} ...", file=sys.stderr, flush=True)
                runs[mode].append(_run(mode, args.recipe, args.preset, args.steps, cache))
    rows = []
    for mode in MODES:
        r = runs[mode]
        rows.append({"mode": mode, "first_step_s": statistics.median(x["first_step_s"] for x in r),
                     "step_ms": statistics.median(x["step_ms"] for x in r),
                     "frames_compiled": max(x["frames_compiled"] for x in r), "runs": r})
    eager = rows[0]
    for row in rows:
        row["step_over_eager"] = row["step_ms"] / eager["step_ms"]
    first = runs["eager"][0]
    print(machine_line())
    print(f"\n{args.recipe} {args.preset}: {first['matrices']} Newton-Schulz matrices, {first['elements']:,} elements; "
          f"1 thread; medians of {args.repeats} interleaved runs")
    print(f"{'mode':<14} {'first step (s)':>15} {'frames compiled':>16} {'step (ms)':>10} {'step / eager':>13}")
    for row in rows:
        print(f"{row['mode']:<14} {row['first_step_s']:>15.2f} {row['frames_compiled']:>16} {row['step_ms']:>10.1f} "
              f"{row['step_over_eager']:>13.2f}")
    write_figures(args.json, {"recipe": args.recipe, "preset": args.preset, "repeats": args.repeats,
                              "steps": args.steps, "rows": rows})


if __name__ == "__main__":
    main()

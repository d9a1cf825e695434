"""The MoE layer's forward + backward (all gradients, fp32, CPU, one process, 2 threads):
the recipe's DeepSeekMoE with its routed experts as a per-expert loop
(``seekspeed-loop``) and as grouped matrix multiplies (``seekspeed-grouped``), against
transformers' DeepseekV3MoE on the same weights with ``experts_implementation``
"eager" and "grouped_mm". Medians (and fastest runs) after one warm-up, repetitions
interleaved (each repetition runs every implementation once, in turn) so that the
machine's noise hits them alike; ratios are taken between figures of the same run.
Other jobs on the cores slow the per-expert loop most (about 600 small elementwise
ops a step, each a parallel region waiting on both threads, against 60 for the grouped
path; both run the same 396 mm calls): the load average is recorded.

    python benchmarks/grouped_experts.py --repeats 5 --json benchmarks/results/grouped_experts.json

``experts_rows(shapes=..., repeats=...)`` returns the rows for other benchmarks.
"""

import argparse
import os
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks import machine_line, write_figures
from recipes import deepseek_v3
from recipes.layers.hf import moe_layer_to_hf
from recipes.layers.moe import DeepSeekMoE

# name -> (preset, overrides, tokens). DeepSeek-V2-Lite's MoE layer (64 routed experts,
# top-6, 2 shared experts of moe_intermediate 1408) at hidden 512 (the shape users
# measured, V2-Lite's moe_intermediate kept) and 1024; and the tiny-moe recipe's layer.
SHAPES = {
    "v2-lite-h512": ("deepseek-v2-lite", {"hidden_size": 512}, 2048),
    "v2-lite-h1024": ("deepseek-v2-lite", {"hidden_size": 1024}, 2048),
    "tiny-moe": ("tiny-moe", {}, 2048),
}
IMPLS = ("seekspeed-loop", "seekspeed-grouped", "transformers-eager", "transformers-grouped_mm")
THREADS = 2
LOAD = [None]       # the 1-minute load average when main() started: other jobs slow the loop most


def _layers(name):
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE
    preset, overrides, tokens = SHAPES[name]
    config = deepseek_v3.make_config(preset, overrides)
    torch.manual_seed(0)
    loop = DeepSeekMoE(config, experts_impl="loop")
    with torch.no_grad():
        for p in loop.parameters():
            p.normal_(std=config.initializer_range)
    grouped = DeepSeekMoE(config, experts_impl="grouped")
    grouped.load_state_dict(loop.state_dict())
    layers = {"seekspeed-loop": loop, "seekspeed-grouped": grouped}
    for impl in ("eager", "grouped_mm"):
        hf_config = config.to_hf_config()
        hf_config._experts_implementation = impl
        hf = DeepseekV3MoE(hf_config)
        hf.load_state_dict(moe_layer_to_hf(loop.state_dict()), strict=True)
        layers[f"transformers-{impl}"] = hf
    x = torch.randn(1, tokens, config.hidden_size, generator=torch.Generator().manual_seed(1))
    grad = torch.randn(x.shape, generator=torch.Generator().manual_seed(2))
    shape = {"hidden": config.hidden_size, "moe_intermediate": config.moe_intermediate_size,
             "experts": config.n_routed_experts, "top_k": config.num_experts_per_tok,
             "shared_experts": config.n_shared_experts, "tokens": tokens}
    return {k: m.train() for k, m in layers.items()}, x, grad, shape


def _step_ms(layer, x, grad):
    for p in layer.parameters():
        p.grad = None
    x = x.detach().requires_grad_(True)
    t0 = time.perf_counter()
    layer(x).backward(grad)
    return (time.perf_counter() - t0) * 1e3


def experts_rows(*, shapes, repeats):
    """[{"impl", "shape", "ms", "min_ms", "runs_ms", **shape fields}] for each shape
    name of SHAPES and each implementation: the median (and fastest) forward +
    backward time over ``repeats`` interleaved repetitions after one warm-up, at 2
    threads."""
    threads = torch.get_num_threads()
    torch.set_num_threads(THREADS)
    rows = []
    try:
        for name in shapes:
            layers, x, grad, shape = _layers(name)
            runs = {impl: [] for impl in IMPLS}
            for rep in range(repeats + 1):
                for impl in IMPLS:
                    print(f"{name} {impl} {rep}/{repeats} ...", file=sys.stderr, flush=True)
                    ms = _step_ms(layers[impl], x, grad)
                    if rep:
                        runs[impl].append(ms)
            rows += [{"impl": impl, "shape": name, "ms": statistics.median(runs[impl]), "min_ms": min(runs[impl]),
                      "runs_ms": runs[impl], **shape} for impl in IMPLS]
            del layers
    finally:
        torch.set_num_threads(threads)
    return rows


def ratios(rows, *, key="ms"):
    """Per shape: loop / grouped, and the fastest transformers implementation / grouped
    (above 1: grouped is faster), from the medians (``key`` "ms") or the fastest runs
    ("min_ms")."""
    out = {}
    for shape in dict.fromkeys(r["shape"] for r in rows):
        ms = {r["impl"]: r[key] for r in rows if r["shape"] == shape}
        fastest = min((k for k in ms if k.startswith("transformers")), key=ms.get)
        out[shape] = {"loop_over_grouped": ms["seekspeed-loop"] / ms["seekspeed-grouped"],
                      "fastest_transformers": fastest,
                      "fastest_transformers_over_grouped": ms[fastest] / ms["seekspeed-grouped"]}
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", help="write the figures here")
    args = p.parse_args()
    LOAD[0] = round(os.getloadavg()[0], 2)
    rows = experts_rows(shapes=args.shapes, repeats=args.repeats)
    summary, fastest = ratios(rows), ratios(rows, key="min_ms")
    print(machine_line())
    print(f"load average before / after: {LOAD[0]} / {os.getloadavg()[0]:.2f}")
    for title, key, table in (("median", "ms", summary), ("fastest", "min_ms", fastest)):
        print(f"\nMoE layer forward + backward, fp32, {THREADS} threads, {title} of {args.repeats} interleaved "
              f"repetitions (ms)")
        print(f"{'shape':<14} {'H':>5} {'I':>5} {'E':>3} {'k':>2} {'tokens':>6} " + " ".join(f"{i:>23}" for i in IMPLS)
              + f" {'loop/grouped':>13} {'best hf/grouped':>16}")
        for shape, r in table.items():
            ms = {row["impl"]: row for row in rows if row["shape"] == shape}
            s = ms[IMPLS[0]]
            print(f"{shape:<14} {s['hidden']:>5} {s['moe_intermediate']:>5} {s['experts']:>3} {s['top_k']:>2} "
                  f"{s['tokens']:>6} " + " ".join(f"{ms[i][key]:>23.1f}" for i in IMPLS)
                  + f" {r['loop_over_grouped']:>12.2f}x {r['fastest_transformers_over_grouped']:>15.2f}x")
    write_figures(args.json, {"threads": THREADS, "repeats": args.repeats,
                              "load_average": [LOAD[0], os.getloadavg()[0]], "experts": rows,
                              "ratios": summary, "ratios_fastest_runs": fastest})


if __name__ == "__main__":
    main()

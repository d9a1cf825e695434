"""The full matrix behind tests/test_grad_overlap.py (which runs a few cases within CI's
budget): schedule x ZeRO stage x precision x compressor, each trained 3 steps with
``seekspeed.overlap_grad_reduce`` off and on (4 gloo ranks on this machine: 2 stages x
2 data-parallel, the tiny recipe). Per case: whether the weights are bitwise equal,
else the largest weight difference relative to the largest weight change of the run,
and whether the losses stayed finite.

Expected: bitwise for the dense path and for compressors that work element- or
tensor-wise (fp32, bf16 on the wire, top-k with exact selection). The block codecs
(int8, sign, momentum-sign: one scale per block of the flat chunk) are bitwise here only
because every tensor of the tiny recipe is a whole number of blocks, so a chunk starts
on a block boundary; in general their blocks fall elsewhere. Sampled top-k draws its
samples in the order the chunks come, and PowerSGD's random start Q is drawn per chunk
key (chunk 0 keeps the key of the unsplit reduction, so 1F1B's one chunk is bitwise):
with two chunks per rank they differ from one reduction of everything by about what the
compressor drops, as their own chunking of a larger model would.

    python benchmarks/grad_overlap_matrix.py --json benchmarks/results/grad_overlap_matrix.json
"""

import argparse
import itertools
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks import write_figures

COMPRESSORS = {
    "none": None,
    "fp32": {"compressor": "fp32", "min_numel": 256},
    "bf16": {"compressor": "bf16", "min_numel": 256},
    "topk-exact": {"compressor": "topk", "ratio": 0.1, "selection": "exact", "min_numel": 256, "chunk_mb": 64},
    "topk-sampled": {"compressor": "topk", "ratio": 0.1, "min_numel": 256},
    "int8": {"compressor": "int8", "min_numel": 256},
    "sign": {"compressor": "sign", "min_numel": 256},
    "powersgd": {"compressor": "powersgd", "rank": 2, "min_numel": 256},
    "momentum-sign": {"compressor": "sign", "target": "momentum", "warmup_steps": 1, "min_numel": 256},
}
SCHEDULES = ("1f1b", "dualpipev", "dualpipev-zb", "dualpipe")
PRECISIONS = {0: ("fp32", "bf16"), 1: ("fp32", "bf16-fp32-accum")}


def _cases(schedules, compressors):
    for schedule, zero, comp in itertools.product(schedules, (0, 1), compressors):
        for precision in PRECISIONS[zero]:
            if comp != "none" and precision != "fp32" and comp not in ("fp32", "topk-exact"):
                continue        # the lossy compressors once per ZeRO stage, in fp32
            yield {"schedule": schedule, "zero": zero, "precision": precision, "compressor": comp,
                   "comm": COMPRESSORS[comp]}


def _rank(cases, steps):
    import numpy as np

    from tests.test_grad_overlap import train
    out = []
    for c in cases:
        t0 = time.perf_counter()
        off, on = train(c, False, steps=steps), train(c, True, steps=steps)
        bitwise = off["losses"] == on["losses"] and all(np.array_equal(on["state"][k].numpy(), v.numpy())
                                                        for k, v in off["state"].items())
        diff = max(float((on["state"][k] - v).abs().max()) for k, v in off["state"].items())
        finite = bool(np.isfinite(on["losses"]).all())
        out.append({**{k: v for k, v in c.items() if k != "comm"}, "bitwise": bitwise, "max_abs_weight_diff": diff,
                    "losses_off": off["losses"], "losses_on": on["losses"], "finite": finite,
                    "seconds": time.perf_counter() - t0})
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--schedules", nargs="+", default=list(SCHEDULES), choices=SCHEDULES)
    p.add_argument("--compressors", nargs="+", default=list(COMPRESSORS), choices=list(COMPRESSORS))
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--json")
    args = p.parse_args()
    from tests.distributed import run_ranks
    rows = []
    for schedule in args.schedules:
        cases = list(_cases([schedule], args.compressors))
        print(f"{schedule}: {len(cases)} cases ...", file=sys.stderr, flush=True)
        per_rank = run_ranks(_rank, world_size=4, args=(cases, args.steps), timeout=3000)
        for i, row in enumerate(per_rank[0]):
            row["bitwise"] = all(r[i]["bitwise"] for r in per_rank)
            row["finite"] = all(r[i]["finite"] for r in per_rank)
            row["max_abs_weight_diff"] = max(r[i]["max_abs_weight_diff"] for r in per_rank)
            rows.append(row)
    print(f"{'schedule':<13} {'ZeRO':>4} {'precision':<16} {'compressor':<14} {'on vs off':<12} {'max |dw|':>9} "
          f"{'last loss off/on':>18}")
    for r in rows:
        print(f"{r['schedule']:<13} {r['zero']:>4} {r['precision']:<16} {r['compressor']:<14} "
              f"{'bitwise' if r['bitwise'] else 'differs':<12} {r['max_abs_weight_diff']:9.2e} "
              f"{r['losses_off'][-1]:8.4f}/{r['losses_on'][-1]:.4f}" + ("" if r["finite"] else "  NON-FINITE"))
    write_figures(args.json, {"steps": args.steps, "rows": rows})


if __name__ == "__main__":
    main()

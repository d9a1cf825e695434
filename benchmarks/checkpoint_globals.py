"""Which pickle globals real checkpoints hold: the evidence for safe_pickle.ALLOWED.

    python benchmarks/checkpoint_globals.py --json benchmarks/results/checkpoint_globals.json

Trains one step of each case with the deepspeed launcher: tiny (2 ranks, 2 stages)
and tiny-moe (4 ranks, 2 stages x 2 replicas, expert-parallel degree 2), ZeRO 0 and 1,
fp32 and bf16 (ZeRO 1 with fp32 gradient accumulation, as the production configs; ZeRO
0 with bf16 accumulation, the only bf16 mix DeepSpeed takes there), each with both
checkpoint engines: 16 runs, about 6 minutes on 2 cores. Then lists, statically
(nothing of a file runs), every global each checkpoint's files name, and which of
them torch.load(weights_only=True) refuses (torch.serialization.
get_unsafe_globals_in_checkpoint; DeepSpeed's files only, the function reads torch's
zip format). fp16 is left out: DeepSpeed refuses it on CPU ("Type fp16 is not
supported on your device"). Since both engines train the same steps with the same
arithmetic, each case's async-zstd checkpoint, converted by launch/convert_checkpoint.py,
must equal the deepspeed engine's file by file (types, dtypes, requires_grad, values):
the table shows where it does not. Exits 1 if a checkpoint names a global outside
ALLOWED or a conversion differs.
"""

import argparse
import collections
import json
import os
import shutil
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks import launch, write_figures

LAYOUTS = {"dense": ("tiny_cpu.json", 2, 1), "moe": ("tiny_moe_cpu.json", 4, 2)}


def _config(path, *, layout, zero, precision, engine, ckpt):
    base, _, ep = LAYOUTS[layout]
    with open(os.path.join(ROOT, "ds_configs", base)) as f:
        cfg = json.load(f)
    cfg.update(train_micro_batch_size_per_gpu=1, gradient_accumulation_steps=2, zero_optimization={"stage": zero},
               bf16={"enabled": precision == "bf16"})
    if precision == "bf16" and zero == 1:
        cfg["data_types"] = {"grad_accum_dtype": "fp32"}
    s = cfg["seekspeed"]
    s["data"]["seq_len"] = 32
    s["checkpoint"] = {"dir": ckpt, "engine": engine}
    if ep > 1:
        s["moe"]["expert_parallel_size"] = ep
    with open(path, "w") as f:
        json.dump(cfg, f)


def _globals(tag):
    """{global: [file names]} of checkpoint ``tag`` and the weights_only refusals."""
    from torch.serialization import get_unsafe_globals_in_checkpoint
    from ds_ext.checkpoint.load import file_globals
    named, refused = collections.defaultdict(list), collections.defaultdict(list)
    for name in tag.files():
        for g in file_globals(tag.file(name)):
            named[g].append(name)
        if tag.kind == "deepspeed":
            for g in get_unsafe_globals_in_checkpoint(tag.file(name)):
                refused[g].append(name)
    return named, refused


def _differences(a, b, where, out):
    import torch
    if type(a) is not type(b):
        out.append(f"{where}: {type(a).__name__} vs {type(b).__name__}")
    elif isinstance(a, torch.Tensor):
        if (a.dtype, a.shape, a.requires_grad) != (b.dtype, b.shape, b.requires_grad) or not torch.equal(a, b):
            out.append(f"{where}: tensors differ")
    elif isinstance(a, dict):
        if list(a) != list(b):
            out.append(f"{where}: keys differ")
        for k in a.keys() & b.keys():
            _differences(a[k], b[k], f"{where}.{k}", out)
    elif isinstance(a, (list, tuple)):
        if len(a) != len(b):
            out.append(f"{where}: lengths differ")
        for i, (x, y) in enumerate(zip(a, b)):
            _differences(x, y, f"{where}[{i}]", out)
    elif hasattr(a, "__dict__") and not isinstance(a, type):
        _differences(vars(a), vars(b), where, out)
    elif a != b:
        out.append(f"{where}: {a!r} vs {b!r}"[:200])
    return out


def _conversion_differences(root, name):
    """Where launch/convert_checkpoint.py's result of case ``name``'s async-zstd checkpoint
    differs from the deepspeed engine's checkpoint of the same case."""
    import torch
    from ds_ext.checkpoint.convert import to_deepspeed
    from ds_ext.checkpoint.load import open_tag
    converted = os.path.join(root, f"{name}-converted")
    to_deepspeed(os.path.join(root, f"{name}-async-zstd"), converted, log=lambda m: None)
    ours, theirs = open_tag(converted), open_tag(os.path.join(root, f"{name}-deepspeed"))
    out = [] if ours.files() == theirs.files() else ["file names differ"]
    for f in set(ours.files()) & set(theirs.files()):
        _differences(torch.load(ours.file(f), weights_only=False), torch.load(theirs.file(f), weights_only=False), f,
                     out)
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", help="where the runs go (default: a temporary directory, removed at the end)")
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args(argv)
    from ds_ext.checkpoint import safe_pickle
    from ds_ext.checkpoint.load import open_tag
    root = args.dir or tempfile.mkdtemp(prefix="seekspeed-globals-")
    cases, by_global = [], collections.defaultdict(lambda: {"cases": [], "refused_by_weights_only": []})
    conversions = {}
    try:
        for layout in LAYOUTS:
            for zero in (0, 1):
                for precision in ("fp32", "bf16"):
                    for engine in ("deepspeed", "async-zstd"):
                        name = f"{layout}-zero{zero}-{precision}-{engine}"
                        ckpt = os.path.join(root, name)
                        cfg = os.path.join(root, f"{name}.json")
                        _config(cfg, layout=layout, zero=zero, precision=precision, engine=engine, ckpt=ckpt)
                        launch(["launch/train.py", "--deepspeed", cfg, "--steps", "1"], world=LAYOUTS[layout][1],
                               summary_json=os.path.join(root, f"{name}.summary.json"), what=name)
                        tag = open_tag(ckpt)
                        named, refused = _globals(tag)
                        cases.append({"case": name, "files": len(tag.files()), "globals": sorted(named),
                                      "refused_by_weights_only": sorted(refused)})
                        for g in named:
                            by_global[g]["cases"].append(name)
                        for g in refused:
                            by_global[g]["refused_by_weights_only"].append(name)
                        print(f"{name}: {len(tag.files())} files, {len(named)} globals", flush=True)
                    case = f"{layout}-zero{zero}-{precision}"
                    diffs = _conversion_differences(root, case)
                    conversions[case] = diffs
                    print(f"{case}: converted async-zstd checkpoint "
                          f"{'equals' if not diffs else 'DIFFERS from'} the deepspeed engine's"
                          + "".join(f"\n  {d}" for d in diffs[:5]), flush=True)
    finally:
        if not args.dir:
            shutil.rmtree(root, ignore_errors=True)
    print(f"\n{'global':52s} {'cases':>5s} {'weights_only refuses':>21s} {'allowed':>8s}")
    outside = []
    for g in sorted(by_global):
        entry = by_global[g]
        allowed = g in safe_pickle.ALLOWED
        outside += [] if allowed else [g]
        print(f"{g:52s} {len(entry['cases']):5d} {'yes' if entry['refused_by_weights_only'] else 'no':>21s} "
              f"{'yes' if allowed else 'NO':>8s}")
    unseen = sorted(set(safe_pickle.ALLOWED) - set(by_global))
    print(f"allowed but in no checkpoint here: {', '.join(unseen) or 'none'}")
    differing = sorted(c for c, d in conversions.items() if d)
    print(f"conversions equal to the deepspeed engine's checkpoint: {len(conversions) - len(differing)} of "
          f"{len(conversions)}")
    write_figures(args.json, {"cases": cases, "globals": {g: dict(v) for g, v in sorted(by_global.items())},
                              "allowed_unseen": unseen, "outside_allowed": outside, "conversion_differences":
                              conversions})
    if outside:
        print(f"outside ALLOWED: {', '.join(outside)}")
    return 1 if outside or differing else 0


if __name__ == "__main__":
    sys.exit(main())

"""Parameter counts of a recipe's layers built on the meta device: the parameters one
token passes through, and ``python -m recipes.<name>``'s table of parameters per
pipeline rank."""

import torch

from .moe import routed_experts
from .pipe import EmbeddingPipe


def activated_parameters(specs, *, routed_experts=routed_experts):
    """Parameters one token passes through: everything but the routed experts it is
    not sent to and the input embedding table (a lookup, not a matmul; the convention
    behind DeepSeek-V3's "37B activated"). Built on the meta device."""
    total = 0
    for spec in specs:
        with torch.device("meta"):
            module = spec.build()
        if isinstance(module, EmbeddingPipe) and getattr(spec, "forward_fn", None) is None:
            continue
        for group in routed_experts(module):
            routed = sum(p.numel() for p in group.parameters)
            total -= routed - routed * group.top_k // group.num_experts
        total += sum(p.numel() for p in module.parameters())
    return total


def print_stage_parameters(spec, *, default_preset, argv=None):
    """``python -m recipes.<name>``: the parameters each pipeline rank holds and the
    parameters one token passes through, built on the meta device."""
    import argparse

    from ds_ext.pipe import SCHEDULES
    from ds_ext.pipe.partition import stage_parameter_counts
    parser = argparse.ArgumentParser(description="Parameters per pipeline rank, built on the meta device.")
    parser.add_argument("--preset", default=default_preset, choices=sorted(spec.presets))
    parser.add_argument("--stages", type=int, default=16)
    parser.add_argument("--schedule", default="1f1b", choices=SCHEDULES)
    parser.add_argument("--partition", default=spec.default_partition)
    args = parser.parse_args(argv)
    config = spec.make_config(args.preset)
    spec.check_stages(config, stages=args.stages, schedule=args.schedule)
    specs = spec.layer_specs(config, seed=0)
    rows = stage_parameter_counts(specs, stages=args.stages, schedule=args.schedule, partition_method=args.partition)
    print(f"{'rank':>4}  {'layers':<24} {'params':>16}  {'bf16 weights':>12}")
    for row in rows:
        ranges = ", ".join(f"[{a},{b})" for a, b in row["layer_ranges"])
        print(f"{row['rank']:>4}  {ranges:<24} {row['params']:>16,}  {row['params'] * 2 / 2**30:>9.2f} GiB")
    unique, activated = rows[0]["unique_total"], spec.activated_parameters(specs)
    print(f"total (unique): {unique:,} parameters ({unique / 1e9:.2f} B); activated per token: {activated:,} "
          f"({activated / 1e9:.2f} B)")

"""Bytes each node sends to other nodes per optimizer step for one data-parallel
group's gradient, by compressor and arrangement (flat, hierarchical), at 2 to 128 nodes
of 8 ranks of the group, and what each compressor keeps per rank between steps: counted
by ds_ext/comm/traffic.py from the algorithms, not measured (the counts match the
measured bytes of benchmarks/compressed_sync.py within 8 %, docs/compression.md).

The gradient: by default the largest pipeline stage of ds_configs/128node.json as the
planner builds it on the meta device (all its parameters, routed experts included, as if
reduced in one group; PowerSGD's matrices from the same layers), or ``--params N``
entries (PowerSGD then assumes square matrices of side ``--matrix-side``). Figures are for
the steps after the dense warm-up (``warmup_steps``, either target): those steps send
the fp32 row's bytes. ``target: "momentum"`` sends the same bytes as ``"gradient"``.

    python benchmarks/traffic_per_node.py --json benchmarks/results/traffic_per_node.json
    python benchmarks/traffic_per_node.py --params 7e9 --per-node 8 --json bench_out/traffic_7b.json
"""

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks import write_figures


def _stage_gradient(config, *, nodes, per_node):
    """(label, numel, matrices) of the planner's largest stage (min_numel as the config's)."""
    from ds_ext.config import load_config
    from ds_ext.planner import make_plan
    plan = make_plan(config, nodes=nodes, ranks_per_node=per_node)
    st = max(plan.stages, key=lambda s: s.params)
    min_numel = load_config(config, world_size=nodes * per_node).section.comm.min_numel
    matrices = [m for flag in (False, True) for m in plan.matrices[st.rank][flag] if m[0] * m[1] >= min_numel]
    label = (f"{config}: pipeline rank {st.rank} of {len(plan.stages)}, {st.params / 1e9:.2f} B parameters "
             f"({st.expert_params / 1e9:.2f} B in routed experts)")
    return label, st.params, matrices, st.expert_params / st.params


def main(argv=None):
    from ds_ext.comm.traffic import chunk_numel, per_node_table, state_bytes
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--deepspeed", default=os.path.join("ds_configs", "128node.json"), metavar="JSON",
                   help="the config whose largest stage's gradient is counted")
    p.add_argument("--plan-nodes", type=int, default=128, help="nodes the config is planned on (its layout)")
    p.add_argument("--params", type=float, help="count a gradient of this many entries instead")
    p.add_argument("--matrix-side", type=int, default=2048, help="with --params: PowerSGD's square matrices")
    p.add_argument("--nodes", type=int, nargs="+", default=[2, 4, 8, 16, 32, 64, 128])
    p.add_argument("--per-node", type=int, default=8, help="ranks of the data-parallel group per node")
    p.add_argument("--ratio", type=float, default=0.01, help="top-k")
    p.add_argument("--rank", type=int, default=4, help="PowerSGD")
    p.add_argument("--block-size", type=int, help="entries per scale, int8/int4/sign (default: each one's, int4 64, 256)")
    p.add_argument("--chunk-mb", type=float, default=16.0, help="seekspeed.comm.chunk_mb")
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args(argv)

    if args.params:
        numel = int(args.params)
        side = args.matrix_side
        matrices = [(side, side)] * (numel // (side * side))
        label = f"--params {numel:,}: {numel / 1e9:.2f} B entries, PowerSGD over {len(matrices)} {side}x{side} matrices"
        experts = 0.0
    else:
        label, numel, matrices, experts = _stage_gradient(args.deepspeed, nodes=args.plan_nodes,
                                                          per_node=args.per_node)
    chunk = chunk_numel(args.chunk_mb)
    rows = per_node_table(numel=numel, matrices=matrices, nodes=args.nodes, per_node=args.per_node,
                          block_size=args.block_size, ratio=args.ratio, rank=args.rank, chunk=chunk)
    dense = {n: next(r for r in rows if r["compressor"] == "fp32" and not r["hierarchical"])["bytes"][n]
             for n in args.nodes}
    print(f"gradient: {label}")
    if experts:
        print(f"(the hier. rows and columns count all of it hierarchical; the trainer reduces routed experts' gradients flat "
              f"whatever seekspeed.comm.hierarchical says, ds_ext/comm/install.py, and launch/plan.py charges that: "
              f"for this stage {experts:.0%} of the gradient goes flat)")
    print(f"GB sent out of each node per step (after the dense warm-up), N nodes x {args.per_node} ranks of the "
          f"group; last column: share of flat dense at N={args.nodes[-1]}")
    print(f"{'method':<20} {'collective':<11}" + "".join(f"{'N=' + str(n):>9}" for n in args.nodes)
          + f"{'vs dense':>10}")
    for r in rows:
        last = r["bytes"][args.nodes[-1]] / dense[args.nodes[-1]]
        print(f"{r['method']:<20} {r['collective']:<11}" + "".join(f"{r['bytes'][n] / 1e9:9.2f}" for n in args.nodes)
              + f"{last:10.4f}")

    big = args.nodes[-1]
    state = []
    print(f"\ncomm state per rank (GB, fp32; {big} nodes x {args.per_node}): what the compression keeps between steps")
    print(f"{'compressor':<12} {'flat':>8} {'hier.':>8} {'flat, momentum':>15} {'hier., momentum':>16}")
    for name in ("fp32", "bf16", "int8", "int4", "sign", "topk", "powersgd"):
        cells = {}
        for target in ("gradient", "momentum"):
            for hier in (False, True):
                cells[(target, hier)] = state_bytes(name, numel=numel, nodes=big, per_node=args.per_node,
                                                    hierarchical=hier, target=target, matrices=matrices,
                                                    rank=args.rank, chunk=chunk)
        state.append({"compressor": name, **{f"{t}{'_hierarchical' if h else ''}": v for (t, h), v in cells.items()}})
        print(f"{name:<12}" + "".join(f"{sum(cells[k].values()) / 1e9:{w}.2f}" for k, w in
                                      ((("gradient", False), 9), (("gradient", True), 9), (("momentum", False), 16),
                                       (("momentum", True), 17))))
    print("(a reduction buffer of 4 bytes per entry in every row; momentum adds a full local momentum: 4 more; "
          "hierarchical keeps each chunk's residual on the one local rank that exchanges it)")
    write_figures(args.json, {"gradient": label, "numel": numel, "routed_expert_share": experts,
                              "per_node": args.per_node, "chunk_numel": chunk, "units": "bytes per node per step out of the node, after the dense warm-up",
                              "rows": rows, "comm_state_per_rank": state})


if __name__ == "__main__":
    main()

"""All-reduce time of flat gloo all-reduce vs seekspeed's hierarchical all-reduce,
run on every rank of a (simulated) multi-node cluster, next to the bound: with two
nodes each byte must cross the inter-node link once per direction, so S / B, where B
is the link's measured payload rate.

    python launch/simcluster.py --nodes 2 --ranks-per-node 2 --rate 1gbit -- \\
        benchmarks/hierarchical_allreduce.py --sizes 16 64 256 --json bench_out/hier.json
"""

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _timed(fn, repeats):
    import torch.distributed as tdist
    times = []
    for _ in range(repeats):
        tdist.barrier()
        t0 = time.perf_counter()
        fn()
        tdist.barrier()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), times


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", type=int, nargs="+", default=[16, 64, 256], help="MiB")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--segments", type=int, default=4)
    p.add_argument("--json")
    p.add_argument("--local_rank", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    import torch
    import torch.distributed as tdist
    from ds_ext.topology.groups import NodeGroups, hierarchical_all_reduce
    from ds_ext.topology.setup import local_world_size
    from ds_ext.distributed import init_distributed
    init_distributed("gloo")
    torch.set_num_threads(1)
    rank, world = tdist.get_rank(), tdist.get_world_size()
    per_node = local_world_size(world)
    groups = NodeGroups.contiguous(world, per_node)

    # the inter-node link's payload rate: 64 MiB from node 0 to node 1, one way
    from benchmarks import oneway_bytes_per_s
    link_bps = oneway_bytes_per_s(tdist, per_node, 64 * 2**20)

    rows = []
    for mib in args.sizes:
        x = torch.ones(mib * 2**20 // 4)
        flat, flat_runs = _timed(lambda: tdist.all_reduce(x), args.repeats)  # noqa: B023
        hier, hier_runs = _timed(lambda: hierarchical_all_reduce(x, groups, segments=args.segments), args.repeats)  # noqa: B023
        size = mib * 2**20
        bound = size / link_bps if groups.num_nodes == 2 else float("nan")
        rows.append({"mib": mib, "flat_s": flat, "hierarchical_s": hier, "speedup": flat / hier, "bound_s": bound,
                     "over_bound": hier / bound, "flat_runs": flat_runs, "hierarchical_runs": hier_runs})
    if rank == 0:
        print(f"\n{groups.num_nodes} nodes x {per_node} ranks, float32, median of {args.repeats}; inter-node payload "
              f"{link_bps * 8 / 1e9:.2f} Gbit/s")
        print(f"{'MiB':>5} {'flat s':>8} {'hier. s':>8} {'speedup':>8} {'bound s':>8} {'hier/bound':>10}")
        for r in rows:
            print(f"{r['mib']:>5} {r['flat_s']:8.3f} {r['hierarchical_s']:8.3f} {r['speedup']:7.2f}x "
                  f"{r['bound_s']:8.3f} {r['over_bound']:9.2f}x")
        if args.json:
            os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
            with open(args.json, "w") as f:
                json.dump({"nodes": groups.num_nodes, "ranks_per_node": per_node, "link_bps": link_bps,
                           "segments": args.segments, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()

"""The MoE layer's token dispatchers side by side on a simulated cluster: what crosses
the node links per token, and how long the dispatch, the combine and the whole layer
take.

One DeepSeekMoE layer per rank, expert parallelism over all ranks (so the group spans
the nodes of launch/simcluster.py, each node's link shaped to ``--rate``), each rank
its own tokens (``--tokens`` per rank). Two routings: the tiny-moe shape (top-2 of 8
experts, 4 groups of which 2 chosen) and a V3-like one (top-8 of 32 experts, 4 groups,
2 chosen); dispatchers every-copy and deduplicated (recipes/layers/dispatch.py; with
several ranks per node it forwards inside the node, a token crossing once per node), payload
fp32 and bf16 (the activation dtype; the layer runs in it) and fp8 (bf16 activations, the
dispatched rows as e4m3 with a scale per 128 channels; "vs every" compares it with
every-copy in bf16, today's dispatch of that run). All layers live in the
same processes and are timed in turn, step after step, so noise hits them alike.

Per row (medians over --steps after --warmup; the slowest rank's layer time, the ranks'
mean exchange times):
- cross_node_bytes_per_token: the bytes a rank sends to ranks on other nodes for one
  forward dispatch and its combine, counted from the routing (``wire_bytes``), per token;
- dispatch_ms, combine_ms: a forward's dispatch exchanges and its combine from issue to
  arrival, in a pass whose shared expert is skipped (so nothing hides them);
- moe_layer_ms: the layer's forward and backward (shared expert included).

    sudo python benchmarks/expert_dispatch.py --json benchmarks/results/expert_dispatch.json
    sudo python benchmarks/expert_dispatch.py --nodes 2 --ranks-per-node 2 --json bench_out/expert_dispatch_2x2.json

Needs root (network namespaces). One launch of nodes x ranks-per-node processes.
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks import machine_line, ranks_in_namespaces, write_figures

ROUTINGS = {"tiny-moe": dict(n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2),
            "v3-like": dict(n_routed_experts=32, num_experts_per_tok=8, n_group=4, topk_group=2)}
DISPATCHERS = ("every-copy", "deduplicated")
PAYLOADS = ("fp32", "bf16", "fp8")      # fp8: bf16 activations, the dispatched rows in e4m3


class _Lanes:
    """Collects ds_ext.comm.alltoall's records: (what, issued, arrived) of each exchange."""

    def __init__(self):
        self.events = []

    def record(self, name, kwargs, start, end):
        if name == "AllToAll":
            self.events.append((kwargs["what"], start, end))


def _span(events, prefix):
    hits = [(s, e) for what, s, e in events if what.startswith(prefix)]
    return (max(e for _, e in hits) - min(s for s, _ in hits)) if hits else 0.0


def _ranks(args):
    """One rank: every (routing, dispatcher, payload) layer timed in turn."""
    import warnings
    warnings.filterwarnings("ignore")
    import torch
    import deepspeed
    from deepspeed import comm as dist
    from ds_ext.comm import alltoall
    from recipes import deepseek_v3
    from recipes.layers.dispatch import Dispatch, make_node_hops, wire_bytes
    from recipes.layers.moe import DeepSeekMoE
    torch.set_num_threads(1)
    deepspeed.init_distributed("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.new_group(list(range(world)))
    node_of = [r // args.ranks_per_node for r in range(world)]
    # several ranks per node: deduplicated forwards inside the node (recipes/layers/dispatch.py)
    hops = make_node_hops([list(range(world))], node_of, new_group=dist.new_group).get(tuple(range(world)))
    layers, inputs = {}, {}
    for routing, fields in ROUTINGS.items():
        config = deepseek_v3.make_config("tiny-moe", {"hidden_size": args.hidden, "moe_intermediate_size": args.moe_inter,
                                                      **fields})
        for payload in PAYLOADS:
            dtype = torch.float32 if payload == "fp32" else torch.bfloat16
            sends = "fp8" if payload == "fp8" else None
            g = torch.Generator().manual_seed(1000 + rank)
            inputs[(routing, payload)] = (torch.randn(1, args.tokens, args.hidden, generator=g).to(dtype),
                                          torch.randn(1, args.tokens, args.hidden, generator=g).to(dtype))
            for name in DISPATCHERS:
                layer = DeepSeekMoE(config, ep_size=world, ep_rank=rank, dispatch=Dispatch(name, sends))
                g = torch.Generator().manual_seed(7)
                with torch.no_grad():
                    for pname, p in layer.named_parameters():
                        if "deepspeed_moe" not in pname:
                            p.copy_(torch.randn(p.shape, generator=g) * 0.05)
                layer.init_experts(seed=7, std=0.05)
                layer.ep_group = group
                if name == "deduplicated" and hops is not None:
                    layer.node_hops = hops[rank]
                layers[(routing, name, payload)] = layer.to(dtype).train()
    per = {key: {"layer": [], "dispatch": [], "combine": []} for key in layers}
    for i in range(args.warmup + args.steps):
        for key, layer in layers.items():
            x, grad = inputs[(key[0], key[2])]
            dist.barrier()
            t0 = time.perf_counter()
            x = x.detach().requires_grad_(True)
            layer(x).backward(grad)
            elapsed = time.perf_counter() - t0
            # the exchanges alone: a forward whose shared expert is skipped
            shared = layer.shared_mlp.forward
            layer.shared_mlp.forward = torch.zeros_like
            lanes = _Lanes()
            dist.barrier()
            with torch.no_grad(), alltoall.recording(lanes):
                layer(x.detach())
            layer.shared_mlp.forward = shared
            if i >= args.warmup:
                per[key]["layer"].append(elapsed)
                per[key]["dispatch"].append(_span(lanes.events, "F dispatch"))
                per[key]["combine"].append(_span(lanes.events, "F combine"))
    # bytes to other nodes, counted on this rank's routing of its tokens
    sent = {}
    for key, layer in layers.items():
        x, _ = inputs[(key[0], key[2])]
        with torch.no_grad():
            _, indices = layer.gate(x.reshape(-1, args.hidden).float())
        far = [node_of[r] != node_of[rank] for r in range(world)]
        b = wire_bytes(layer.dispatch, indices, hidden=args.hidden, element_size=x.element_size(),
                       num_experts=layer.num_experts, ep_size=world, counted=far,
                       node_of=node_of if layer.node_hops is not None else None)
        sent[key] = (b["dispatch"] + b["combine"]) / args.tokens
    keys = list(layers)
    mine = torch.tensor([[statistics.median(per[k]["layer"]), statistics.median(per[k]["dispatch"]),
                          statistics.median(per[k]["combine"]), sent[k]] for k in keys], dtype=torch.float64)
    everyone = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(everyone, mine)
    if rank == 0:
        stack = torch.stack(everyone)          # [rank, key, field]
        rows = []
        for j, (routing, name, payload) in enumerate(keys):
            fields = ROUTINGS[routing]
            rows.append({"routing": routing, "dispatcher": name, "payload": payload, "ep": world,
                         "nodes": world // args.ranks_per_node, "top_k": fields["num_experts_per_tok"],
                         "experts": fields["n_routed_experts"], "topk_group": fields["topk_group"],
                         "cross_node_bytes_per_token": float(stack[:, j, 3].mean()),
                         "dispatch_ms": float(stack[:, j, 1].mean()) * 1e3,
                         "combine_ms": float(stack[:, j, 2].mean()) * 1e3,
                         "moe_layer_ms": float(stack[:, j, 0].max()) * 1e3})
        with open(args.rows_json, "w") as f:
            json.dump(rows, f)
    dist.barrier()
    sys.stdout.flush()
    os._exit(0)


def _launch(args, rows_json):
    """nodes x ranks-per-node ranks in the simulated cluster, rank r on node r // ranks-per-node."""
    world = args.nodes * args.ranks_per_node
    script = [sys.executable, os.path.abspath(__file__), "--rows-json", rows_json]
    for name in ("nodes", "ranks_per_node", "steps", "warmup", "tokens", "hidden", "moe_inter"):
        script += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    return ranks_in_namespaces(script, node_of=[r // args.ranks_per_node for r in range(world)], rate=args.rate,
                               master_port=args.master_port, timeout=args.timeout, rows_json=rows_json,
                               name="expert_dispatch")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nodes", type=int, default=4)
    p.add_argument("--ranks-per-node", type=int, default=1)
    p.add_argument("--rate", default="200mbit", help="the simulated node link (tc rate, each direction)")
    p.add_argument("--tokens", type=int, default=256, help="tokens per rank (tiny-moe: micro-batch 2 x 128)")
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--moe-inter", type=int, default=96)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--master-port", type=int, default=29751)
    p.add_argument("--timeout", type=int, default=900)
    p.add_argument("--json")
    p.add_argument("--rows-json", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.rows_json and "RANK" in os.environ:
        return _ranks(args)
    if os.geteuid() != 0:
        sys.exit("expert_dispatch: needs root for the simulated cluster's network namespaces (ip netns, tc)")
    world = args.nodes * args.ranks_per_node
    print(f"[expert_dispatch] {len(ROUTINGS) * len(DISPATCHERS) * len(PAYLOADS)} layers on {args.nodes} simulated "
          f"nodes x {args.ranks_per_node} ranks (EP {world}), {args.rate} per node link; {args.warmup} + {args.steps} "
          f"steps each ...", file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory(prefix="dispatch-rows-") as tmp:
        rows = _launch(args, os.path.join(tmp, "rows.json"))
    by = {(r["routing"], r["dispatcher"], r["payload"]): r for r in rows}
    print(machine_line())
    print(f"\nhidden {args.hidden}, moe_intermediate {args.moe_inter}, {args.tokens} tokens per rank; EP {world} over "
          f"{args.nodes} nodes x {args.ranks_per_node} ranks, {args.rate} per node link")
    print(f"{'routing':<9} {'dispatcher':<13} {'payload':<7} {'B/token off-node':>16} {'vs every':>8} "
          f"{'dispatch ms':>11} {'combine ms':>10} {'d+c vs every':>12} {'layer ms':>9} {'vs every':>8}")
    for r in rows:
        base = by[(r["routing"], "every-copy", "bf16" if r["payload"] == "fp8" else r["payload"])]
        r["bytes_vs_every_copy"] = r["cross_node_bytes_per_token"] / base["cross_node_bytes_per_token"]
        r["dispatch_combine_speedup"] = ((base["dispatch_ms"] + base["combine_ms"])
                                         / (r["dispatch_ms"] + r["combine_ms"]))
        r["layer_speedup"] = base["moe_layer_ms"] / r["moe_layer_ms"]
        print(f"{r['routing']:<9} {r['dispatcher']:<13} {r['payload']:<7} {r['cross_node_bytes_per_token']:16,.0f} "
              f"{r['bytes_vs_every_copy']:7.2f}x {r['dispatch_ms']:11.1f} {r['combine_ms']:10.1f} "
              f"{r['dispatch_combine_speedup']:11.2f}x {r['moe_layer_ms']:9.1f} {r['layer_speedup']:7.2f}x")
    write_figures(args.json, {"rate": args.rate, "nodes": args.nodes, "ranks_per_node": args.ranks_per_node,
                              "tokens_per_rank": args.tokens, "hidden": args.hidden, "moe_inter": args.moe_inter,
                              "routings": ROUTINGS, "rows": rows})


if __name__ == "__main__":
    main()

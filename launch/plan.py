"""Check a configuration before holding the cluster: memory per pipeline rank, bytes per
link class, the pipeline bubble and a predicted step time, on a laptop (no GPU; the
model is built on the meta device).

    python launch/plan.py --deepspeed ds_configs/128node.json --hostfile hosts
    python launch/plan.py --deepspeed ds_configs/single_node.json --hostfile hosts --include node-007
    python launch/plan.py --deepspeed ds_configs/single_node.json --nodes 1 --gpus-per-node 8 --json plan.json

Exits 2, with the numbers, when a rank does not fit GPU memory. The cost model is
described in ds_ext/planner/, its collectives in ds_ext/planner/collectives.py;
hardware defaults are DeepSeek-V3's H800 nodes: 8 GPUs on NVLink (200 GB/s one way
each), 8 InfiniBand NICs of 400 Gb/s (override with --memory-gb, --peak-tflops,
--efficiency, --intra-gbps, --nics-per-node, --nic-gbps).
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def parse_args(argv=None):
    from ds_ext.planner import Hardware
    hw = Hardware()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--deepspeed", "--deepspeed_config", dest="config", required=True, metavar="JSON")
    p.add_argument("--hostfile", help="DeepSpeed hostfile ('host slots=N'); or --nodes and --gpus-per-node")
    p.add_argument("-i", "--include", default="", metavar="NODE_SPEC[@NODE_SPEC...]",
                   help="with --hostfile: the hosts/slots deepspeed --include would use (NAME[:SLOT[,SLOT...]])")
    p.add_argument("-e", "--exclude", default="", metavar="NODE_SPEC[@NODE_SPEC...]",
                   help="with --hostfile: the hosts/slots deepspeed --exclude would leave out")
    p.add_argument("--num_nodes", type=int, help="with --hostfile: the first N hosts, as deepspeed --num_nodes")
    p.add_argument("--num_gpus", "--num_accelerators", type=int,
                   help="with --hostfile: slots [0, N) of each host, as deepspeed --num_gpus")
    p.add_argument("--nodes", type=int)
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--memory-gb", type=float, default=hw.memory_gb, help="GPU memory (GB, 1e9 bytes)")
    p.add_argument("--reserve-gb", type=float, default=hw.reserve_gb,
                   help="memory set aside for the CUDA context, NCCL and fragmentation")
    p.add_argument("--peak-tflops", type=float, default=hw.peak_tflops)
    p.add_argument("--fp8-tflops", type=float, default=None,
                   help="dense FP8 GEMM TFLOP/s (H800: 1979) when the weight matmuls run in FP8 (compute only; "
                        "memory is counted as the config's precision)")
    p.add_argument("--efficiency", type=float, default=hw.efficiency, help="achieved / peak FLOP/s (MFU)")
    p.add_argument("--intra-gbps", type=float, default=hw.intra_gbps, help="NVLink GB/s one way per GPU")
    p.add_argument("--nics-per-node", type=int, default=hw.nics_per_node,
                   help="inter-node NICs per node, one rail each")
    p.add_argument("--nic-gbps", "--inter-gbps", dest="inter_gbps", type=float, default=hw.inter_gbps,
                   help="GB/s one way per NIC (400 Gb/s = 50; --inter-gbps, its old name, is the same: per NIC)")
    p.add_argument("--gpu", default=hw.name, help="name shown in the report")
    p.add_argument("--json", metavar="PATH", help="write the plan's figures (with --sweep: the ranked layouts) to PATH")
    p.add_argument("--sweep", action="store_true",
                   help="plan every layout (pipeline degree, schedule, expert parallelism, micro-batch, activation "
                        "checkpointing; balanced partition) at the config's global batch and print those that fit, "
                        "fastest first")
    p.add_argument("--top", type=int, default=10, help="with --sweep: how many layouts to print")
    return p.parse_args(argv)


def _gb(x):
    return f"{x / 1e9:8.1f}"


def _bytes(x):
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6)):
        if x >= scale:
            return f"{x / scale:.1f} {unit}"
    return f"{x:.0f} B"


def report(plan):
    lay, hw = plan.layout, plan.hardware
    lines = [f"plan: {plan.config} on {plan.nodes} node(s) x {plan.ranks_per_node} {hw.name} "
             f"({hw.memory_gb:g} GB, {hw.peak_tflops:g} TFLOP/s peak x {hw.efficiency:g}; NVLink {hw.intra_gbps:g} GB/s "
             f"per GPU, {hw.nics_per_node} NICs x {hw.inter_gbps:g} GB/s per node of {hw.gpus_per_node} GPUs, one way)",
             f"layout: {lay['pipe_stages']} pipeline stages x {lay['data_parallel']} data-parallel, micro-batch "
             f"{lay['micro_batch']} x {lay['grad_accum']} accumulation, seq {lay['seq_len']}; schedule {plan.schedule}; "
             f"placement {plan.placement}; {plan.total_params / 1e9:.2f} B parameters",
             "",
             "memory per pipeline rank (GB)        weights  grads  optim  act(none)  act(ckpt)  buffers  comm state"
             "  total",
             ]
    for st in plan.stages:
        ranges = ",".join(f"[{a},{b})" for a, b in st.layers)
        mark = "" if st.total <= hw.memory_gb * 1e9 else "  DOES NOT FIT"
        lines.append(f"  rank {st.rank} layers {ranges:<18} {st.params / 1e9:5.2f} B  {_gb(st.weights)}{_gb(st.gradients)}"
                     f"{_gb(st.optimizer)} {_gb(st.activations)}  {_gb(st.activations_checkpointed)} {_gb(st.buffers)}"
                     f"   {_gb(st.comm_state)}{_gb(st.total)}{mark}")
    ckpt = "on" if plan.stages[0].checkpointing else "off"
    lines += [f"  (total counts activations with checkpointing {ckpt}, as configured; peak (chunk, micro-batch) "
              f"activations held per rank: {', '.join(str(st.in_flight) for st in plan.stages)}; comm state: what "
              f"the compressed reduction keeps between steps, see the notes)", "",
              f"traffic per step (all links of one group; compressor: {plan.compressor}"
              + (f", target {plan.comm_target}" if plan.comm_target != "gradient" else "")
              + (f"; compressed columns: after the {plan.warmup_steps} dense warm-up steps" if plan.warmup_steps
                 else "")
              + ")",
              f"  {'group':<18} {'ranks':>5} {'intra-node':>11} {'inter-node':>11} {'compressed intra':>17} "
              f"{'inter':>9} {'wait':>9}"]
    for t in plan.traffic:
        lines.append(f"  {t.group:<18} {t.members:>5} {_bytes(t.intra_bytes):>11} {_bytes(t.inter_bytes):>11} "
                     f"{_bytes(t.intra_bytes_compressed):>17} {_bytes(t.inter_bytes_compressed):>9} "
                     f"{t.seconds_compressed * 1e3:7.1f}ms")
    c = plan.chunk_costs

    def ms(values):
        return "/".join(f"{v * 1e3:.1f}" for v in values)
    lines += ["", f"per micro-batch, per layer chunk: F {ms(c['F'])} ms, B {ms(c['B'])} ms"
                  + (f", W {ms(c['W'])} ms" if c["W"] else "") + f"; p2p {c['p2p'] * 1e3:.3f} ms",
              f"step: pipeline {plan.makespan * 1e3:.1f} ms (idle: {(plan.makespan - plan.busy) * 1e3:.1f} ms = "
              f"{(plan.makespan - plan.busy) / plan.makespan:.1%} on the busiest rank, {plan.bubble * 1e3:.1f} ms = "
              f"{plan.bubble / plan.makespan:.1%} on the least busy) + gradient reduction {plan.dp_seconds * 1e3:.1f} ms"
              + (f" (exposed of {plan.dp_total_seconds * 1e3:.1f} ms: each chunk reduces after its last backward)"
                 if plan.overlap_grad_reduce else "")
              + " + optimizer step"
              + (" and ZeRO's all-gather " if plan.zero_stage >= 1 and plan.layout["data_parallel"] > 1 else " ")
              + f"{plan.optimizer_seconds * 1e3:.1f} ms = {plan.step_seconds:.3f} s predicted; "
              f"{plan.tokens_per_s:,.0f} tokens/s ({plan.tokens_per_s / (plan.nodes * plan.ranks_per_node):,.0f} per GPU)"]
    lines += [f"note: {n}" for n in plan.notes]
    return "\n".join(lines)


def main(argv=None):
    from ds_ext.errors import SeekspeedError
    from ds_ext.planner import Hardware, check_fits, make_plan, nodes_from_hostfile
    args = parse_args(argv)
    try:
        filters = [f for f, v in (("--include", args.include), ("--exclude", args.exclude),
                                  ("--num_nodes", args.num_nodes), ("--num_gpus", args.num_gpus))
                   if v not in ("", None)]
        if filters and not args.hostfile:
            raise SeekspeedError(f"{filters[0]} filters a hostfile: pass --hostfile too, or use --nodes and "
                                 f"--gpus-per-node")
        if args.hostfile:
            nodes, per_node = nodes_from_hostfile(args.hostfile, include=args.include, exclude=args.exclude,
                                                  num_nodes=args.num_nodes, num_gpus=args.num_gpus)
        elif args.nodes:
            nodes, per_node = args.nodes, args.gpus_per_node
        else:
            raise SeekspeedError("pass --hostfile hosts, or --nodes N (and --gpus-per-node, default 8)")
        for flag in ("memory_gb", "peak_tflops", "efficiency", "fp8_tflops"):       # links: Hardware checks them
            value = getattr(args, flag)
            if value is not None and not value > 0:
                raise SeekspeedError(f"--{flag.replace('_', '-')} {value:g}: a hardware figure must be positive")
        if args.efficiency > 1:
            raise SeekspeedError(f"--efficiency {args.efficiency:g} is achieved / peak FLOP/s: give a fraction in (0, 1]")
        hw = Hardware(name=args.gpu, memory_gb=args.memory_gb, reserve_gb=args.reserve_gb, peak_tflops=args.peak_tflops,
                      efficiency=args.efficiency, gpus_per_node=per_node, nics_per_node=args.nics_per_node,
                      intra_gbps=args.intra_gbps, inter_gbps=args.inter_gbps, fp8_tflops=args.fp8_tflops)
        if args.sweep:
            from ds_ext.planner.sweep import report as sweep_report
            from ds_ext.planner.sweep import sweep
            fitting, skipped = sweep(args.config, nodes=nodes, ranks_per_node=per_node, hardware=hw,
                                     log=lambda m: print(m, flush=True))
            print(sweep_report(fitting, skipped, top=args.top), flush=True)
            if args.json:
                with open(args.json, "w") as f:
                    json.dump({"config": args.config, "nodes": nodes, "ranks_per_node": per_node,
                               "layouts": [c.to_json() for c in fitting], "skipped": skipped}, f, indent=2)
            return 0 if fitting else 2
        plan = make_plan(args.config, nodes=nodes, ranks_per_node=per_node, hardware=hw)
        print(report(plan), flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(plan.to_json(), f, indent=2)
        check_fits(plan)
    except SeekspeedError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

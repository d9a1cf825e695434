"""Gradient synchronisation per optimizer step of a 25.2M-parameter MLP (1024-4096-
4096-1024, batch 32 per rank, fp32) trained as a one-stage DeepSpeed pipeline on every
rank: DeepSpeed's dense reduction against each seekspeed compressor (flat and
hierarchical), next to torch's PowerSGD DDP communication hook (rank 4, one bucket) on
the same model and data, in one run.

Per method: step time (median over --steps, slowest rank); sync time: for the
DeepSpeed engines the ReduceGrads instruction timed from a barrier just before it to
a barrier after it, for DDP (whose hook overlaps backward) the step time minus
compute alone (the same model's forward, backward and torch AdamW step with no
communication, measured on each rank in the same launch); the compressors' CPU
time; and the bytes each node sent on its inter-node link during the timed steps
(/proc/net/dev of the node's eth0; 0 on loopback).

    python benchmarks/compressed_sync.py --json bench_out/sync.json              # 2 x 2 simulated, 1 Gbit/s (root)
    python benchmarks/compressed_sync.py --loopback --json bench_out/sync_lo.json   # the same ranks on loopback

Each method runs in fresh processes (launch/simcluster.py, or the deepspeed
launcher on loopback), one after another.
"""

import argparse
import gc
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks import add_output_args, machine_line, run_for_rows, simcluster_cmd, write_figures

METHODS = {
    "deepspeed-dense": None,
    "fp32-hier": {"compressor": "fp32", "hierarchical": True},
    "bf16": {"compressor": "bf16"},
    "int8": {"compressor": "int8"},
    "int8-hier": {"compressor": "int8", "hierarchical": True},
    "int4": {"compressor": "int4"},
    "sign": {"compressor": "sign"},
    "sign-hier": {"compressor": "sign", "hierarchical": True},
    # Adam's momentum through sign (1-bit Adam's scheme); the benchmark's untimed steps hold its warm-up
    "momentum-sign": {"compressor": "sign", "target": "momentum"},
    "momentum-sign-hier": {"compressor": "sign", "target": "momentum", "hierarchical": True},
    "powersgd-r4": {"compressor": "powersgd", "rank": 4},
    "powersgd-r4-hier": {"compressor": "powersgd", "rank": 4, "hierarchical": True},
    "topk-1%-exact": {"compressor": "topk", "ratio": 0.01, "selection": "exact"},
    "topk-1%": {"compressor": "topk", "ratio": 0.01, "selection": "sampled"},
    "topk-1%-torch-ops": {"compressor": "topk", "ratio": 0.01, "selection": "sampled", "kernel": "torch"},
    "topk-1%-hier": {"compressor": "topk", "ratio": 0.01, "selection": "sampled", "hierarchical": True},
    "torch-powersgd-hook-r4": "ddp",
}
SIZES = (1024, 4096, 4096, 1024)
BATCH = 32


def _layers():
    import torch
    layers = []
    for i, (a, b) in enumerate(zip(SIZES[:-1], SIZES[1:])):
        layers.append(torch.nn.Linear(a, b))
        if i < len(SIZES) - 2:
            layers.append(torch.nn.ReLU())
    return layers


def _tx_bytes(iface):
    try:
        with open("/proc/net/dev") as f:
            for line in f:
                name, _, rest = line.partition(":")
                if name.strip() == iface:
                    return int(rest.split()[8])
    except OSError:
        pass
    return 0


def _data(rank, steps):
    import torch
    g = torch.Generator().manual_seed(rank)
    return [(torch.randn(BATCH, SIZES[0], generator=g), torch.randn(BATCH, SIZES[-1], generator=g))
            for _ in range(steps)]


def _mse(out, target):
    return ((out - target) ** 2).mean()


def _compute_alone(batches):
    import torch
    torch.manual_seed(0)
    model = torch.nn.Sequential(*_layers())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    times = []
    for x, y in batches:
        t0 = time.perf_counter()
        opt.zero_grad()
        _mse(model(x), y).backward()
        opt.step()
        times.append(time.perf_counter() - t0)
    return times


def _deepspeed(method, comm, batches, args, node_of):
    import torch
    from deepspeed.pipe import PipelineModule
    from ds_ext.config import CommSection
    from ds_ext.pipe.engine import initialize
    torch.manual_seed(0)
    model = PipelineModule(layers=_layers(), num_stages=1, loss_fn=_mse)
    ds = {"train_micro_batch_size_per_gpu": BATCH, "gradient_accumulation_steps": 1, "steps_per_print": 10 ** 9,
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}, "zero_optimization": {"stage": 0}}
    warmup = 1 if comm and comm.get("target") == "momentum" else 0     # one dense step, then the variance freezes
    section = CommSection(**{**comm, "warmup_steps": warmup, "chunk_mb": args.chunk_mb}) if comm else None
    engine = initialize(model=model, config=ds, model_parameters=list(model.parameters()), schedule="1f1b",
                        comm=section, node_of=node_of, log=lambda _: None)
    reduce_s, cpu_s = [], []
    # the gradient reduction, timed from a barrier just before it (so that no rank's
    # lateness in backward counts as communication) to its end on the slowest rank
    from deepspeed.runtime.pipe import schedule as ds_schedule
    reduce_grads = type(engine)._INSTRUCTION_MAP[ds_schedule.ReduceGrads]
    timing = {"on": False}

    def timed_reduce(self, **kwargs):
        import torch.distributed as tdist
        tdist.barrier()
        t0 = time.perf_counter()
        reduce_grads(self, **kwargs)
        tdist.barrier()
        if timing["on"]:
            reduce_s.append(time.perf_counter() - t0)
    engine._INSTRUCTION_MAP = {**type(engine)._INSTRUCTION_MAP, ds_schedule.ReduceGrads: timed_reduce}

    def step(i, timed):
        timing["on"] = timed
        engine.train_batch(iter([batches[i]]))
        if timed and engine.grad_reducer is not None:
            st = engine.grad_reducer.last
            cpu_s.append(st.compress_s + st.decompress_s)
    times, tx = _timed_loop(step, args)
    wire = engine.grad_reducer.last.wire_bytes if engine.grad_reducer is not None else None
    return times, tx, reduce_s, cpu_s, wire


def _ddp_powersgd(batches, args):
    import torch
    import torch.distributed as tdist
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Sequential(*_layers()), bucket_cap_mb=200)
    state = powerSGD_hook.PowerSGDState(process_group=tdist.group.WORLD, matrix_approximation_rank=4,
                                        start_powerSGD_iter=2, min_compression_rate=2, use_error_feedback=True,
                                        warm_start=True)
    model.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step(i, timed):
        x, y = batches[i]
        opt.zero_grad()
        _mse(model(x), y).backward()
        opt.step()
    times, tx = _timed_loop(step, args)
    return times, tx, [], [], None


def _model_bytes(spec, *, nodes, per_node):
    """ds_ext.comm.traffic's count for a method of this benchmark (None: not modelled)."""
    from ds_ext.comm.traffic import inter_node_bytes
    if spec == "ddp":
        spec = {"compressor": "powersgd", "rank": 4}
    spec = spec or {"compressor": "none"}
    pairs = list(zip(SIZES[:-1], SIZES[1:]))
    numel = sum(a * b + b for a, b in pairs)
    return inter_node_bytes(spec["compressor"], nodes=nodes, per_node=per_node,
                            hierarchical=spec.get("hierarchical", False), numel=numel,
                            matrices=[(b, a) for a, b in pairs], ratio=spec.get("ratio", 0.01), rank=spec.get("rank", 4))


def _scaling_table(rows, *, nodes, per_node, grid=(2, 4, 8, 16, 32, 64, 128), wide=8):
    """Counted bytes per node per step out of the node: this run's layout next to the
    measured figure, then how they grow with nodes of ``wide`` ranks."""
    print(f"\ninter-node MB per node per step: counted (ds_ext/comm/traffic.py) vs measured on this run "
          f"({nodes} x {per_node}), then counted for N nodes x {wide} ranks")
    print(f"{'method':<24} {'counted':>8} {'measured':>9} " + " ".join(f"{'N=' + str(n):>8}" for n in grid))
    out = {}
    for r in rows:
        spec = METHODS[r["method"]]
        here = _model_bytes(spec, nodes=nodes, per_node=per_node)
        growth = [_model_bytes(spec, nodes=n, per_node=wide) for n in grid]
        out[r["method"]] = {"counted_here": here, "measured_here": r["inter_node_bytes_per_node_step"],
                            "counted_by_nodes": dict(zip(grid, growth))}
        print(f"{r['method']:<24} {here / 1e6:8.2f} {r['inter_node_bytes_per_node_step'] / 1e6:9.2f} "
              + " ".join(f"{g / 1e6:8.1f}" for g in growth))
    return out


def _timed_loop(step, args):
    """Per-step times of the timed steps, and the bytes sent out of this node during
    them (read by one rank per node; engine start-up broadcasts are not counted)."""
    import torch.distributed as tdist
    times = []
    tx0 = None
    for i in range(args.warmup + args.steps):
        tdist.barrier()
        if i == args.warmup:
            tx0 = _tx_bytes(args.iface)
        t0 = time.perf_counter()
        step(i, i >= args.warmup)
        tdist.barrier()
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
    return times, (_tx_bytes(args.iface) - tx0) / args.steps


def _ranks(args):
    """Per-rank mode (under a launcher): time ``args.methods``, rank 0 writes the rows."""
    import warnings
    warnings.filterwarnings("ignore")
    import torch
    import torch.distributed as tdist
    from ds_ext.distributed import init_distributed
    from ds_ext.topology.setup import local_world_size
    init_distributed("gloo")
    torch.set_num_threads(1)
    rank, world = tdist.get_rank(), tdist.get_world_size()
    per_node = args.ranks_per_node or local_world_size(world)
    node_of = [r // per_node for r in range(world)]
    batches = _data(rank, args.warmup + args.steps)
    compute_s = statistics.median(_compute_alone(batches)[args.warmup:])
    counts_tx = rank % per_node == 0
    rows = []
    for method in args.methods:
        spec = METHODS[method]
        if spec == "ddp":
            times, tx, reduce_s, cpu_s, wire = _ddp_powersgd(batches, args)
        else:
            times, tx, reduce_s, cpu_s, wire = _deepspeed(method, spec, batches, args, node_of)
        # the method's engine or DDP model went with its function's frame; collect its
        # reference cycles before the next method builds its own
        gc.collect()
        tx = tx if counts_tx else 0.0
        mine = torch.tensor([statistics.median(times), statistics.median(reduce_s) if reduce_s else float("nan"),
                             statistics.median(cpu_s) if cpu_s else float("nan"), tx, compute_s])
        everyone = [torch.zeros_like(mine) for _ in range(world)]
        tdist.all_gather(everyone, mine)
        stack = torch.stack(everyone)
        step_s, reduce_instr = float(stack[:, 0].max()), float(stack[:, 1].max())
        # DeepSpeed engines: the reduction timed on its own; DDP overlaps it with backward,
        # so there: step - compute alone (both with torch's AdamW)
        sync = reduce_instr if spec != "ddp" else step_s - float(stack[:, 4].max())
        rows.append({"method": method, "step_s": step_s, "compute_s": float(stack[:, 4].max()), "sync_s": sync,
                     "reduce_instr_s": reduce_instr, "compressor_cpu_s": float(stack[:, 2].max()),
                     "inter_node_bytes_per_node_step": float(stack[:, 3].max()),
                     "wire_bytes_estimate_per_rank": wire, "step_runs_s": times})
    if rank == 0:
        with open(args.rows_json, "w") as f:
            json.dump({"nodes": world // per_node, "ranks_per_node": per_node, "rows": rows}, f)
    tdist.barrier()
    tdist.destroy_process_group()
    # Interpreter teardown here sometimes aborts in a gloo thread ("terminate called without
    # an active exception") after all the work is done and written; leave without it.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _launch(method, args, rows_json):
    """One method in fresh processes (DeepSpeed engines do not give their memory back
    within a process): on the simulated cluster, or on loopback."""
    script = [os.path.abspath(__file__), "--methods", method, "--steps", str(args.steps), "--warmup",
              str(args.warmup), "--chunk-mb", str(args.chunk_mb), "--rows-json", rows_json]
    if args.loopback:
        cmd = [os.path.join(os.path.dirname(sys.executable), "deepspeed"), "--num_gpus",
               str(args.nodes * args.ranks_per_node), "--master_port", str(29650 + len(method)), *script,
               "--ranks-per-node", str(args.ranks_per_node), "--iface", "lo-none"]
    else:
        cmd = simcluster_cmd(script, nodes=args.nodes, ranks_per_node=args.ranks_per_node, rate=args.rate)
    return run_for_rows(cmd, rows_json, name=method)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--chunk-mb", type=float, default=16.0)
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--ranks-per-node", type=int, default=2)
    p.add_argument("--rate", default="1gbit", help="inter-node link of the simulated cluster")
    p.add_argument("--loopback", action="store_true", help="all ranks on this machine's loopback, no namespaces")
    p.add_argument("--iface", default=os.environ.get("GLOO_SOCKET_IFNAME", "eth0"))
    add_output_args(p)
    args = p.parse_args()
    if args.rows_json:
        return _ranks(args)
    import tempfile
    rows, layout = [], None
    where = "loopback" if args.loopback else f"simulated cluster, {args.rate} between nodes"
    with tempfile.TemporaryDirectory(prefix="seekspeed-sync-") as tmp:
        for i, method in enumerate(args.methods):
            print(f"[{i + 1}/{len(args.methods)}] {method} on {args.nodes} x {args.ranks_per_node} ranks ({where}) ...",
                  file=sys.stderr, flush=True)
            got = _launch(method, args, os.path.join(tmp, f"{i}.json"))
            layout = (got["nodes"], got["ranks_per_node"])
            rows += got["rows"]
    nodes, per_node = layout
    dense = next((r for r in rows if r["method"] == "deepspeed-dense"), None)
    compute = statistics.median(r["compute_s"] for r in rows)
    print(machine_line())
    print(f"\n25.2M-parameter MLP, fp32, batch {BATCH} per rank, {nodes} node(s) x {per_node} ranks ({where}); "
          f"compute alone {compute * 1e3:.0f} ms per step; median of {args.steps} steps (slowest rank)")
    print("sync: DeepSpeed engines: the ReduceGrads instruction from a barrier to its end; DDP (overlapped with "
          "backward): step - compute alone")
    print(f"{'method':<24} {'step s':>7} {'sync s':>7} {'sync vs dense':>13} {'step vs dense':>13} {'CPU s':>6} "
          f"{'MB/step out of node':>19}")
    for r in rows:
        r["sync_speedup_vs_dense"] = dense["sync_s"] / r["sync_s"] if dense and r["sync_s"] > 0 else float("nan")
        r["step_speedup_vs_dense"] = dense["step_s"] / r["step_s"] if dense else float("nan")
        print(f"{r['method']:<24} {r['step_s']:7.3f} {r['sync_s']:7.3f} {r['sync_speedup_vs_dense']:12.1f}x "
              f"{r['step_speedup_vs_dense']:12.1f}x {r['compressor_cpu_s']:6.3f} "
              f"{r['inter_node_bytes_per_node_step'] / 1e6:19.2f}")
    scaling = _scaling_table(rows, nodes=nodes, per_node=per_node) if not args.loopback else None
    write_figures(args.json, {"where": where, "nodes": nodes, "ranks_per_node": per_node, "rows": rows,
                              "inter_node_scaling": scaling})


if __name__ == "__main__":
    main()

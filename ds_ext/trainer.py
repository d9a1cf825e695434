"""The training run behind launch/train.py: config -> run plan (validated once, before
any process group) -> recipe -> DeepSpeed pipeline engine -> data -> loop with
progress, checkpoints and traces -> summary.

Runs under the deepspeed launcher, torchrun, or plain ``python`` (one rank). The loop
only executes the plan (ds_ext/run_plan.py) through its components: checkpoints
(ds_ext/checkpointer.py), per-step reporting (ds_ext/step_metrics.py), traces and the
profile window (ds_ext/step_trace.py).
"""

import argparse
import json
import logging
import os
import sys
import time

from .checkpointer import Checkpointer
from .data.feed import DataFeed, node_dp_ranks
from .config import print_warnings
from .distributed import free_port
from .errors import SeekspeedError
from .log import rank0_log
from .progress import fmt_duration, peak_rss_mib
from .run_plan import check_partition, partition_for, validate
from .step_metrics import StepMetrics
from .step_trace import StepTrace

# importers of ds_ext.trainer use these; check_partition and partition_for live in ds_ext/run_plan.py
__all__ = ["main", "parse_args", "validate", "check_partition", "partition_for"]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="Train a seekspeed recipe with DeepSpeed's pipeline engine.")
    p.add_argument("--deepspeed", "--deepspeed_config", dest="config", required=True, metavar="JSON",
                   help="DeepSpeed config with a 'seekspeed' section (ds_configs/*.json)")
    p.add_argument("--steps", type=int, help="override seekspeed.train.steps (total optimizer steps)")
    p.add_argument("--checkpoint-dir", help="override seekspeed.checkpoint.dir")
    p.add_argument("--resume", nargs="?", const="yes", choices=("yes", "auto"), default=None,
                   help="continue from the newest complete checkpoint in the checkpoint directory; '--resume auto' "
                        "starts fresh when there is none (for restarts by torchrun or launch/elastic.py)")
    p.add_argument("--summary-json", metavar="PATH", help="write the run summary (rank 0) to PATH")
    p.add_argument("--pipe-trace", metavar="DIR",
                   help="record every pipeline instruction of the last step and write a Chrome trace and a PNG "
                        "timeline (one lane per rank) into DIR")
    p.add_argument("--profile", metavar="FIRST:LAST",
                   help="record optimizer steps FIRST..LAST with torch.profiler on every rank: a Chrome trace and a "
                        "table of the top operations per rank, communication grouped by collective, and the "
                        "pipeline timeline, under the report directory's profile/ (overrides seekspeed.report.profile)")
    p.add_argument("--report-dir", metavar="DIR",
                   help="where metrics.csv, the plots and profiles go (default: seekspeed.report.dir, else "
                        "<checkpoint dir>/report)")
    p.add_argument("--verbose", action="store_true", help="keep DeepSpeed's INFO logging")
    p.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def _single_process_env():
    """Plain ``python launch/train.py``: a one-rank world on this machine."""
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))


class _ControlPlane:
    """Small CPU collectives (errors, summary) on a gloo group, whatever backend
    DeepSpeed trains with: NCCL only takes CUDA tensors."""

    def __init__(self):
        import torch.distributed as tdist
        self.tdist = tdist
        self.group = tdist.new_group(backend="gloo")

    def gather(self, obj):
        out = [None] * self.tdist.get_world_size()
        self.tdist.all_gather_object(out, obj, group=self.group)
        return out

    def rank0_decides(self, flag):
        """Rank 0's ``flag`` on every rank (a decision from a clock, say)."""
        import torch
        t = torch.tensor([int(bool(flag))])
        self.tdist.broadcast(t, src=0, group=self.group)
        return bool(t.item())

    def stop_if_any_failed(self, error, *, rank):
        """Every rank learns whether any rank failed; rank 0 prints each distinct error
        once, with the ranks that hit it; then all ranks stop together."""
        messages = self.gather(None if error is None else f"{error}")
        failed = {}
        for r, m in enumerate(messages):
            if m is not None:
                failed.setdefault(m, []).append(r)
        if not failed:
            return
        if rank == 0:
            for message, ranks in failed.items():
                print(f"error (rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}): {message}",
                      file=sys.stderr, flush=True)
        raise _Reported()


class _Reported(Exception):
    """A failure already reported on rank 0; this rank only exits with code 2."""


def run(args):
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    plan = validate(args, world_size=world_size)
    print_warnings(plan.cfg.warnings, rank=rank)

    import torch
    from deepspeed.accelerator import get_accelerator

    if not args.verbose:
        logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    _single_process_env()
    if get_accelerator().device_name() == "cpu":
        from .topology.setup import local_world_size
        local = local_world_size(world_size)
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(local, 1)))
    else:
        get_accelerator().set_device(int(os.environ.get("LOCAL_RANK", "0")))
    _load_ops(plan, rank=rank)
    from .distributed import init_distributed
    init_distributed()
    finished = False
    try:
        rc = _train(args, plan, _ControlPlane())
        finished = True
        return rc
    finally:
        # After a failure, peers may sit in a collective: no barrier then; the launcher
        # (or process exit) tears the job down.
        if finished and torch.distributed.is_initialized():
            torch.distributed.barrier()
            torch.distributed.destroy_process_group()


def _load_ops(plan, *, rank):
    """The compiled ops DeepSpeed will load (its CPU all-reduce, the optimizer's),
    loaded first under ds_ext.ops.build_guard: built here when missing, a dead build's
    lock removed, a live one waited for with a progress line (node-local rank 0 prints
    the waits; any rank the build and the removal)."""
    from .ops import load_deepspeed_ops, run_ops
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))

    def log(message):
        if local_rank == 0 or not message.startswith("ops: waiting"):
            print(f"{message}{f' (rank {rank})' if rank else ''}", file=sys.stderr, flush=True)
    load_deepspeed_ops(run_ops(plan.cfg.compiled_ops), log=log)


def _train(args, plan, control):
    import torch
    from deepspeed import comm as dist
    s, layout = plan.section, plan.layout
    rank = dist.get_rank()
    if rank == 0:
        print(f"seekspeed: {s.recipe.name}/{s.recipe.preset} | {layout.describe()}", flush=True)
    torch.manual_seed(s.train.seed)
    model, topo, init_tensors = _build_model(plan, control, rank=rank)
    stage, dp_rank = model._grid.get_stage_id(), model._grid.get_data_parallel_id()
    data = DataFeed(plan, control, rank=rank, stage=stage, dp_rank=dp_rank,
                    node_dp_ranks=node_dp_ranks(plan, topo, rank=rank))
    engine = _build_engine(plan, model, topo, rank=rank)
    hooks = plan.recipe.active_hooks(plan.model_config)
    for hook in hooks:
        hook.setup(engine, section=s, grad_accum=layout.grad_accum)
    checkpoints = Checkpointer(plan, engine, control, rank=rank)
    if plan.resume:
        checkpoints.resume()
    start, total = engine.global_steps, s.train.steps
    batches = data.resume(engine)
    trace = StepTrace(plan, engine, control, pipe_trace=args.pipe_trace, start=start, rank=rank, stage=stage,
                      dp_rank=dp_rank)
    metrics = StepMetrics(plan, engine, control, window=trace.window, batches=batches, start=start, rank=rank,
                          dp_rank=dp_rank)
    if start >= total and rank == 0:
        print(f"nothing to do: the checkpoint is at step {start} and seekspeed.train.steps is {total}", flush=True)

    for step in range(start + 1, total + 1):
        trace.before_step(step)
        t_step = time.perf_counter()
        loss = engine.train_batch(batches).item()
        step_s = time.perf_counter() - t_step
        trace.after_step(step)
        figures = [hook.after_step(engine, section=s) for hook in hooks]
        metrics.step(step, loss=loss, step_s=step_s, figures=[f for f in figures if f is not None])
        checkpoints.after_step(step)
    checkpoints.finish(start=start)

    summary = _summary(plan, control, metrics=metrics, checkpoints=checkpoints, data=data, init_tensors=init_tensors)
    if rank == 0:
        _print_summary(summary)
        if args.summary_json:
            os.makedirs(os.path.dirname(os.path.abspath(args.summary_json)), exist_ok=True)
            with open(args.summary_json, "w") as f:
                json.dump(summary, f, indent=2)
    return 0


def _build_model(plan, control, *, rank):
    """This rank's stages of the recipe's PipelineModule, placed by the topology plan
    (collective when the links are probed), with weights from seekspeed.init_from when
    set; returns (model, topology plan, tensors read from init_from)."""
    from .topology.placement import deepspeed_topology
    from .topology.setup import plan as plan_topology
    s, layout, model_config = plan.section, plan.layout, plan.model_config
    topo = plan_topology(s.topology, layout=layout, model_config=model_config, ds=plan.cfg.ds,
                         stage_params=plan.stage_params, moe=s.moe,
                         log=rank0_log(rank))
    model = plan.recipe.build_pipeline(
        model_config, topology=deepspeed_topology(topo.placement, pp=layout.pipe_stages, dp=layout.data_parallel),
        schedule=s.schedule, partition_method=plan.layers.partition,
        activation_checkpoint_interval=plan.cfg.ds.get("pipeline", {}).get("activation_checkpoint_interval", 0),
        seed=s.train.seed, document_token=plan.tokenizer.eos_token_id if s.data.attention == "document" else None,
        **plan.recipe_options, **plan.recipe.build_options(s))
    init_tensors, error = 0, None
    if plan.init_from is not None:
        from .hf_io import load_hf_into_module
        try:
            init_tensors = load_hf_into_module(model, plan.init_from, model_config)
        except SeekspeedError as exc:
            error = exc
    control.stop_if_any_failed(error, rank=rank)
    if plan.init_from is not None and rank == 0:
        print(f"init_from: {plan.init_from} (each stage read only its own layers)", flush=True)
    return model, topo, init_tensors


def _build_engine(plan, model, topo, *, rank):
    """deepspeed.initialize through ds_ext.pipe.engine: the schedule, F&B overlap, the
    gradient communication backend and the checkpoint engine the config chose."""
    from .pipe.engine import initialize
    from .pipe.overlap import check_splittable
    s, model_config = plan.section, plan.model_config
    if plan.overlap == "layer":
        check_splittable(model)
        if rank == 0:
            print("overlap: layer (each F&B chunk's forward and backward take turns at every expert all-to-all)",
                  flush=True)
    engine = initialize(model=model, config=plan.ds_config, schedule=s.schedule, overlap=plan.overlap,
                        model_parameters=[p for p in model.parameters() if p.requires_grad], comm=s.comm,
                        checkpoint=s.checkpoint if plan.checkpoint_dir else None, node_of=topo.node_of,
                        overlap_grad_reduce=s.overlap_grad_reduce, grad_norm=s.grad_norm, muon_update=s.muon_update,
                        log=lambda line: print(line, flush=True))
    if engine.has_moe_layers and rank == 0:
        print(f"moe: {model_config.n_routed_experts} routed experts per layer, expert-parallel degree "
              f"{s.moe.expert_parallel_size} ({model_config.n_routed_experts // s.moe.expert_parallel_size} per rank)",
              flush=True)
    return engine


def _summary(plan, control, *, metrics, checkpoints, data, init_tensors):
    """The run summary (collective: every rank gathers its figures; rank 0's is complete)."""
    layout = plan.layout
    summary = metrics.finish()
    summary.update(peak_rss_mib=[round(r, 1) for r in control.gather(peak_rss_mib())], config=plan.cfg.path,
                   layout=vars(layout) | {"tokens_per_step": layout.tokens_per_step}, checkpoints=checkpoints.paths)
    if plan.init_from is not None:
        summary["init_from_tensors_per_rank"] = control.gather(init_tensors)
    if metrics.loss_parts:
        summary["loss_parts"] = metrics.loss_parts
    if metrics.layer_loss_summary() is not None:
        summary["layer_losses"] = metrics.layer_loss_summary()
    comm = metrics.comm_summary()
    if comm is not None:
        summary["comm"] = comm
    if checkpoints.history is not None:
        summary["checkpoint_history"] = checkpoints.history
    tiers = data.summary(control)
    if tiers is not None:
        summary["data_tiers"] = tiers
    moe_figures = metrics.moe_summary()
    if moe_figures is not None:
        summary["moe"] = moe_figures
    return summary


def _print_summary(summary):
    lines = [
        "=" * 64,
        f"done: {summary['steps']} steps (step {summary['start_step']} -> {summary['final_step']}) in "
        f"{fmt_duration(summary['wall_s'])}",
    ]
    if summary["steps"]:
        lines += [
            f"loss: {summary['loss_first']:.4f} (mean of first {summary['loss_window']}) -> "
            f"{summary['loss_last']:.4f} (mean of last {summary['loss_window']})",
            f"throughput: {summary['tokens_per_s']:,.0f} tok/s overall, {summary['steady_tokens_per_s']:,.0f} tok/s "
            f"after the first step; {summary['tokens']:,} tokens",
        ]
    lines.append("peak RSS per rank (MiB): " + ", ".join(f"{r:.0f}" for r in summary["peak_rss_mib"]))
    if summary["checkpoints"]:
        lines.append(f"checkpoints: {', '.join(summary['checkpoints'])}")
    lines.append("=" * 64)
    print("\n".join(lines), flush=True)


def main(argv=None):
    from .ops import use_environment_root
    use_environment_root()         # this environment's op builds, before torch or DeepSpeed looks for one
    args = parse_args(argv)
    rank = int(os.environ.get("RANK", "0"))
    try:
        return run(args)
    except _Reported:
        return 2
    except SeekspeedError as exc:
        # Every rank validates the same config: say it once, on rank 0, plus once per
        # other node in case its files differ (a path missing on one node only).
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        if rank == 0:
            print(f"error: {exc}", file=sys.stderr, flush=True)
        elif local_rank == 0:
            print(f"error (rank {rank}): {exc}", file=sys.stderr, flush=True)
        return 2

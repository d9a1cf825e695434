"""The training run behind launch/train.py: config -> recipe -> DeepSpeed pipeline
engine -> data -> loop with progress and checkpoints -> summary.

Runs under the deepspeed launcher, torchrun, or plain ``python`` (one rank).
"""

import argparse
import dataclasses
import json
import logging
import os
import socket
import sys
import time

from .config import load_config, print_warnings
from .errors import ConfigError, DataError, SeekspeedError
from .progress import Progress, fmt_duration, peak_rss_mib
from recipes.layers import moe


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


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _single_process_env():
    """Plain ``python launch/train.py``: a one-rank world on this machine."""
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))


def _config_overrides(args):
    overrides = {}
    if args.steps is not None:
        overrides["train.steps"] = args.steps
    if args.checkpoint_dir is not None:
        overrides["checkpoint.dir"] = args.checkpoint_dir
    return overrides


def _checkpoint_exists(directory):
    """A checkpoint lives here: a 'latest' file or a global_step* tag (torn staging
    directories of a crashed first save do not count)."""
    if not directory or not os.path.isdir(directory):
        return False
    return any(name == "latest" or name.startswith("global_step") for name in os.listdir(directory))


def validate(args, *, world_size):
    """Everything that can be checked before a process group exists: config, recipe,
    stages vs layers, partitioning, tokenizer vs vocabulary, data path, resume.
    Writes nothing."""
    from recipes import get_recipe
    from .data import load_tokenizer, resolve_source
    cfg = load_config(args.config, world_size=world_size, overrides=_config_overrides(args))
    s = cfg.section
    recipe = get_recipe(s.recipe.name)
    model_config = recipe.make_config(s.recipe.preset, s.recipe.overrides)
    recipe.check_stages(model_config, stages=cfg.layout.pipe_stages, schedule=s.schedule)
    ep = s.moe.expert_parallel_size
    if ep > 1 and model_config.num_moe_layers() == 0:
        raise ConfigError(f"seekspeed.moe.expert_parallel_size {ep} but preset {s.recipe.preset!r} has no MoE layers: "
                          f"set it to 1 or use an MoE preset (tiny-moe, deepseek-v2-lite, deepseek-v3)")
    if model_config.num_moe_layers() and model_config.n_routed_experts % ep:
        raise ConfigError(f"seekspeed.moe.expert_parallel_size {ep} does not divide n_routed_experts "
                          f"{model_config.n_routed_experts}: choose a divisor of {model_config.n_routed_experts}")
    s.overlap = s.resolve_overlap(has_moe=model_config.num_moe_layers() > 0)
    specs = recipe.layer_specs(model_config, seed=0)
    check_partition(_partition_method(cfg.ds, recipe), specs, model_config, recipe)
    from recipes.layers.pipe import check_checkpointing, layer_warnings
    interval = cfg.ds.get("pipeline", {}).get("activation_checkpoint_interval", 0)
    check_checkpointing(recipe, specs, interval=interval)
    cfg.warnings += layer_warnings(recipe, specs, schedule=s.schedule, checkpoint_interval=interval)
    recipe.train_options(s)
    partition_for(cfg, recipe, model_config)
    from .topology.setup import check as check_topology
    check_topology(s.topology, model_config=model_config)
    if model_config.max_position_embeddings < s.data.seq_len:
        raise ConfigError(f"seekspeed.data.seq_len {s.data.seq_len} exceeds the model's max_position_embeddings "
                          f"{model_config.max_position_embeddings}: lower seq_len or raise it in recipe.overrides")
    if s.data.attention == "document" and model_config.num_mtp_layers:
        raise ConfigError("seekspeed.data.attention \"document\" does not support multi-token prediction yet: set "
                          "num_mtp_layers to 0 in recipe.overrides or attention to \"causal\"")
    tokenizer = load_tokenizer(s.data.tokenizer, vocab_size=model_config.vocab_size)
    for section, _ in s.data.sources():
        resolve_source(section)
    if s.init_from is not None:
        from .hf_io import check_hf_dir
        check_hf_dir(s.init_from, model_config)
    profile = args.profile or s.report.profile
    if profile:
        from .profile.run import report_dir
        from .profile.window import parse_window
        first, last = parse_window(profile, flag="--profile" if args.profile else "seekspeed.report.profile")
        if last > s.train.steps:
            raise ConfigError(f"profile window {profile} ends after the last step ({s.train.steps}): choose steps "
                              f"within 1..{s.train.steps}")
        if report_dir(s.report, checkpoint_dir=s.checkpoint.dir, override=args.report_dir) is None:
            raise ConfigError("a profile window needs a report directory: set seekspeed.checkpoint.dir, "
                              "seekspeed.report.dir or --report-dir")
    if args.resume and not s.checkpoint.dir:
        raise ConfigError("--resume needs a checkpoint directory: set seekspeed.checkpoint.dir or --checkpoint-dir")
    if args.resume:
        from .checkpoint import list_checkpoints
        found = list_checkpoints(s.checkpoint.dir)[0]
        if not found and args.resume == "yes":
            raise ConfigError(f"--resume: no checkpoint in {s.checkpoint.dir!r} (none complete): run without --resume (or "
                              f"with --resume auto), or set seekspeed.checkpoint.dir / --checkpoint-dir")
        if not found:
            if int(os.environ.get("RANK", "0")) == 0:
                print(f"--resume auto: no checkpoint in {s.checkpoint.dir} yet, starting fresh", flush=True)
            args.resume = None
    if not args.resume and _checkpoint_exists(s.checkpoint.dir):
        raise ConfigError(f"checkpoint directory {s.checkpoint.dir} already holds a checkpoint: pass --resume (or "
                          f"--resume auto) to continue it, or choose another --checkpoint-dir (nothing was "
                          f"overwritten)")
    return cfg, recipe, model_config, tokenizer


def check_partition(method, specs, model_config, recipe=None):
    """DeepSpeed's partition methods and "balanced", checked before any rank builds a
    layer; "balanced" needs the recipe's planner costs to cost every layer class."""
    import re
    if method in ("uniform", "parameters"):
        return
    if method == "balanced":
        from recipes import spec_for
        try:
            (recipe or spec_for(model_config)).layer_kinds(specs, model_config)
        except ConfigError as exc:
            raise ConfigError(f"pipeline.partition 'balanced' cuts layers by the planner's cost: {exc}; or use "
                              f"'type:REGEX' / 'parameters'") from None
        return
    if not method.startswith("type:"):
        raise ConfigError(f"pipeline.partition {method!r} is not a DeepSpeed partition method: use 'best' "
                          f"(the recipe's default), 'uniform', 'parameters', 'type:REGEX' or 'balanced' (cut from "
                          f"the planner's per-layer costs)")
    try:
        pattern = re.compile(method[len("type:"):], re.IGNORECASE)
    except re.error as exc:
        raise ConfigError(f"pipeline.partition {method!r}: invalid regular expression ({exc})") from None
    names = sorted({spec.typename.__name__ for spec in specs})
    if not any(pattern.search(n) for n in names):
        raise ConfigError(f"pipeline.partition {method!r} matches no layer of the recipe (layers: {names})")


def _partition_method(ds, recipe):
    method = ds.get("pipeline", {}).get("partition", "best")
    return recipe.default_partition if method == "best" else method


def partition_for(cfg, recipe, model_config):
    """What the layers are cut by: a DeepSpeed partition method, or for "balanced" the
    boundaries ds_ext.profile.plan cuts from its per-layer costs on this run's layout
    (nodes of LOCAL_WORLD_SIZE ranks; ds_ext.profile.plan.cut_hardware's figures),
    computed once per run and the same on every rank."""
    method = _partition_method(cfg.ds, recipe)
    if method != "balanced":
        return method
    cached = getattr(cfg, "_balanced_bounds", None)
    if cached is None:
        from .profile.plan import cut_hardware, make_plan
        world = cfg.layout.world_size
        per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        if per_node < 1 or world % per_node:
            per_node = world
        cached = make_plan(cfg, nodes=world // per_node, ranks_per_node=per_node,
                           hardware=cut_hardware(cfg.section.topology, per_node)).bounds
        cfg._balanced_bounds = cached
    return list(cached)


# What a checkpoint must agree on for --resume to continue the same sample order. With
# the tiered pipeline the order is one stream of rows that a resumed run continues at
# DeepSpeed's global_samples, so the batch shape may change (_RESHAPEABLE); the memory
# pipeline cuts the corpus per replica, and another cut would replay and skip data.
_RESUME_KEYS = ("data_parallel", "micro_batch", "grad_accum", "seq_len", "schedule_steps", "source", "tokenizer",
                "max_documents", "seed", "data_order")
_RESHAPEABLE = ("data_parallel", "micro_batch", "grad_accum")
# The parallel layout a checkpoint records: when one differs, the checkpoint is cut anew
# for this run (ds_ext/checkpoint/reshard.py) instead of loaded by DeepSpeed.
_LAYOUT_KEYS = ("pipe_stages", "data_parallel", "expert_parallel_size", "schedule")


def _layout_record(cfg, recipe, model_config, engine=None):
    """The parallel layout of this run, saved beside each checkpoint so that a run on
    another layout can find each layer's state: degrees, schedule, the optimizer that
    cut its state, and the layer keys (global layer index, or tied_modules.<key>) each
    pipeline rank holds."""
    from .checkpoint.reshard import optimizer_kind
    from recipes.layers.pipe import partition, rank_layers
    from .pipe import virtual_stages
    s, lay = cfg.section, cfg.layout
    specs = recipe.layer_specs(model_config, seed=0)
    bounds = partition(specs, num_parts=virtual_stages(s.schedule, lay.pipe_stages),
                       method=partition_for(cfg, recipe, model_config))

    def key(i):
        tied = getattr(specs[i], "key", None)
        return f"tied_modules.{tied}" if tied is not None else str(i)

    held = rank_layers(specs, bounds=bounds, schedule=s.schedule, stages=lay.pipe_stages)
    return {"pipe_stages": lay.pipe_stages, "data_parallel": lay.data_parallel,
            "expert_parallel_size": s.moe.expert_parallel_size, "schedule": s.schedule,
            "zero_stage": cfg.ds.get("zero_optimization", {}).get("stage", 0), "train_batch": lay.train_batch,
            "optimizer": optimizer_kind(engine) if engine is not None else None,
            "bf16": bool(cfg.ds.get("bf16", {}).get("enabled", False)),
            "n_routed_experts": model_config.n_routed_experts if model_config.num_moe_layers() else 0,
            "stage_keys": [sorted({key(i) for i in h}) for h in held]}


def _resume_state(cfg):
    s, lay = cfg.section, cfg.layout
    return {"data_parallel": lay.data_parallel, "micro_batch": lay.micro_batch, "grad_accum": lay.grad_accum,
            "seq_len": lay.seq_len, "schedule_steps": s.train.steps, "source": s.data.source,
            "tokenizer": s.data.tokenizer, "max_documents": s.data.max_documents, "seed": s.train.seed,
            "data_order": _data_order(s.data)}


def _data_order(data):
    """What the sample order depends on beyond the keys above (hot/cold tier settings do not count).
    encoding_errors appears only when not "strict", so checkpoints from before it still match."""
    encodings = [section.encoding_errors for section, _ in data.sources()]
    encoding = "" if set(encodings) == {"strict"} else f" encoding_errors={encodings}"
    if data.pipeline == "memory":
        return "memory" + encoding
    mixture = [(m.source, m.weight) for m in data.mixture]
    return f"tiered rows_per_shard={data.rows_per_shard} shuffle_window={data.shuffle_window} mixture={mixture}" \
        + encoding


def _check_resume_state(saved, cfg, path, *, layout, model_config):
    """Refuse what --resume cannot continue, naming every difference; returns the layout
    keys that differ (empty: DeepSpeed loads the checkpoint as it is)."""
    if not saved:
        raise ConfigError(f"--resume: {path} was not written by seekspeed (no data position in it); "
                          f"start a new run in another --checkpoint-dir")
    now = _resume_state(cfg)
    saved = {"data_order": "memory"} | saved        # checkpoints from before the tiered pipeline
    fields = dataclasses.asdict(model_config)
    model = [f"{k} {v!r} -> {fields.get(k)!r}" for k, v in (saved.get("model_config") or {}).items()
             if fields.get(k) != v]
    if model:
        raise ConfigError(f"--resume: {path} holds another model ({'; '.join(model[:4])}): resume with the "
                          f"checkpoint's recipe.preset and recipe.overrides, or start a new run")
    tiered = cfg.section.data.pipeline == "tiered"
    diff = [f"{k} {saved.get(k)!r} -> {now[k]!r}" for k in _RESUME_KEYS
            if saved.get(k) != now[k] and not (tiered and k in _RESHAPEABLE)]
    if diff:
        reshape = [d for d in diff if d.split()[0] in _RESHAPEABLE]
        hint = (" (data.pipeline \"memory\" gives each replica its own cut of the corpus, which another degree or "
                "batch would cut anew, replaying and skipping data: resume with the checkpoint's batch layout, or "
                "train with seekspeed.data.pipeline \"tiered\", whose one global order a resume continues at any "
                "layout)") if reshape and not tiered else ""
        raise ConfigError(f"--resume: {path} was trained with other settings ({'; '.join(diff)}){hint}: resume "
                          f"with the checkpoint's data, sequence length and train.steps")
    record = saved.get("layout")
    if record is None:
        if now["data_parallel"] != saved.get("data_parallel"):
            raise ConfigError(f"--resume: {path} predates seekspeed's layout records, so it can only resume on its "
                              f"own layout ({saved.get('data_parallel')} data-parallel replicas)")
        return []
    changed = [k for k in _LAYOUT_KEYS if record.get(k) != layout[k]]
    from .checkpoint.reshard import PARTITIONED_OPTIMIZERS
    if changed and not {record.get("optimizer"), layout["optimizer"]} <= set(PARTITIONED_OPTIMIZERS):
        what = "; ".join(f"{k} {record.get(k)!r} -> {layout[k]!r}" for k in changed)
        raise ConfigError(f"--resume: {path} was written on another layout ({what}), and resuming on another "
                          f"layout needs an optimizer state DeepSpeed cuts by replicas on both sides (ZeRO stage 1, "
                          f"or bf16; checkpoint: {record.get('optimizer')}, now: {layout['optimizer']}): resume on "
                          f"the checkpoint's layout, or train with zero_optimization.stage 1")
    return changed


def _newest_tag(engine, ckpt_dir):
    """The tag --resume loads: the newest checkpoint that verifies (async-zstd), or the
    one DeepSpeed's 'latest' names."""
    ckpt = engine._async_checkpoints()
    if ckpt is not None:
        ckpt.wait()
        return ckpt.resolve(ckpt_dir)
    latest = os.path.join(ckpt_dir, "latest")
    if not os.path.isfile(latest):
        return None
    with open(latest) as f:
        return f.read().strip()


def _resume(engine, cfg, recipe, model_config, ckpt_dir, *, control, rank):
    """Load the newest complete checkpoint of ``ckpt_dir``: by DeepSpeed when it was
    written on this run's layout, cut anew for this layout when not. Returns its path."""
    from .checkpoint import reshard
    from .comm import state as comm_state
    tag = _newest_tag(engine, ckpt_dir)
    if tag is None:
        raise ConfigError(f"--resume: DeepSpeed found no loadable checkpoint in {ckpt_dir}")
    tag_dir = os.path.join(ckpt_dir, tag)
    layout = _layout_record(cfg, recipe, model_config, engine)
    error, changed, saved, comm = None, [], None, None
    try:
        state = reshard.load_model_state(engine, tag_dir)
        saved = state.get("seekspeed") if isinstance(state, dict) else None
        changed = _check_resume_state(saved, cfg, tag_dir, layout=layout, model_config=model_config)
        comm = comm_state.resume_plan(saved.get("comm"), comm_state.settings(cfg.section.comm, layout=layout),
                                      section=cfg.section.comm, path=tag_dir)
    except SeekspeedError as exc:
        error = exc
    control.stop_if_any_failed(error, rank=rank)
    if comm.warning and rank == 0:
        print(f"warning: {comm.warning}", file=sys.stderr, flush=True)
    assert not (comm.load and changed), "a layout change is a compression settings change"
    if not changed:
        load_path, _ = engine.load_checkpoint(ckpt_dir, tag=tag)
        if load_path is None:
            raise ConfigError(f"--resume: DeepSpeed could not load {tag_dir}")
        if comm.load:      # this rank's residuals, Q, generator and step count
            try:
                steps = comm_state.load_file(engine, tag_dir, saved=saved["comm"])
            except SeekspeedError as exc:
                error = exc
            control.stop_if_any_failed(error, rank=rank)
            if rank == 0:
                print(f"comm: every rank's compression state restored ({cfg.section.comm.compressor}, {steps} steps "
                      f"reduced)", flush=True)
        return load_path
    record = saved["layout"]
    if rank == 0:
        print(f"--resume: {tag_dir} was written on another layout ("
              + "; ".join(f"{k} {record[k]} -> {layout[k]}" for k in changed) + "): cutting it anew for this run",
              flush=True)
    try:
        reshard.load_into(engine, tag_dir, saved=record, log=(lambda m: print(m, flush=True)) if rank == 0 else
                          (lambda m: None))
    except SeekspeedError as exc:
        error = exc
    control.stop_if_any_failed(error, rank=rank)
    return tag_dir


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


def run(args):
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    cfg, recipe, model_config, tokenizer = validate(args, world_size=world_size)
    print_warnings(cfg.warnings, rank=rank)

    import torch
    import deepspeed
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
    from .distributed import init_distributed
    init_distributed()
    finished = False
    try:
        rc = _train(args, cfg, recipe, model_config, tokenizer, _ControlPlane())
        finished = True
        return rc
    finally:
        # After a failure, peers may sit in a collective: no barrier then; the launcher
        # (or process exit) tears the job down.
        if finished and torch.distributed.is_initialized():
            torch.distributed.barrier()
            torch.distributed.destroy_process_group()


def _packed_store(data, tokenizer, control, *, rank):
    """The tiered pipeline's packed shards: rank 0 builds them if missing (the others
    wait), then every rank opens the same cache."""
    from .data.sources import cache_dir
    from .data.store import build_all, open_all
    root = data.cache_dir or str(cache_dir() / "packed")
    error = None
    if rank == 0:
        try:
            build_all(data, tokenizer, root=root, rows_per_shard=data.rows_per_shard,
                      log=lambda m: print(m, flush=True))
        except SeekspeedError as exc:
            error = exc
        except OSError as exc:
            error = DataError(f"seekspeed.data.cache_dir {root}: cannot build the packed cache ({exc})")
    control.stop_if_any_failed(error, rank=rank)
    store = open_all(data, tokenizer, root=root, rows_per_shard=data.rows_per_shard)
    control.stop_if_any_failed(None if store is not None else DataError(
        f"seekspeed.data.cache_dir {root}: rank 0 built the packed cache but this rank cannot read it; the "
        f"cache directory must be shared by all ranks"), rank=rank)
    if rank == 0:
        from .data.textfiles import describe_undecodable
        mix = "" if len(store.stores) == 1 else \
            f"; mixture of {len(store.stores)} sources, weights {', '.join(f'{w:g}' for w in store.weights)}"
        undecodable = describe_undecodable(store.index["replaced_documents"], store.index["skipped_documents"])
        print(f"data: {store.num_rows:,} packed rows in {len(store.shards)} shards under {store.root} "
              f"({store.index['documents']:,} documents{mix}{'; ' + undecodable if undecodable else ''})", flush=True)
    return store


def _tiered_batches(s, layout, store, *, dp_rank, stage):
    from .data.order import SampleOrder
    from .data.tiers import ColdTier, HotTier, TierStats, TieredBatches
    d = s.data
    order = SampleOrder([sh["rows"] for sh in store.shards], seed=s.train.seed, window=d.shuffle_window,
                        dp_size=layout.data_parallel, micro_batch=layout.micro_batch,
                        sources=store.source_of_shard, weights=store.weights)
    cold = ColdTier(store.root)
    hot = None
    if d.hot_dir:
        hot = HotTier(store, cold, os.path.join(d.hot_dir, f"dp{dp_rank}-stage{stage}"),
                      budget_bytes=int(d.hot_budget_mb * 1e6), policy=d.policy, stats=TierStats(),
                      min_shards=d.shuffle_window * len(store.stores))
    return TieredBatches(store, order, dp_rank=dp_rank, cold=cold, hot=hot, prefetch=d.prefetch)


def _load_rows(s, layout, tokenizer, model_config, *, shard, stats=None):
    from .data import packed_sequences
    try:
        return packed_sequences(s.data, tokenizer, vocab_size=model_config.vocab_size, shard=shard,
                                num_shards=layout.data_parallel, stats=stats)
    except SeekspeedError:
        raise
    except Exception as exc:  # a corrupt file surfaces as whatever its reader raises
        first = (str(exc).splitlines() or [""])[0][:300]
        raise DataError(f"cannot load seekspeed.data.source {s.data.source} ({type(exc).__name__}: {first}); "
                        f"check the files, or point data.source elsewhere") from None


def _train(args, cfg, recipe, model_config, tokenizer, control):
    import torch
    import deepspeed
    from deepspeed import comm as dist
    from .data import PackedBatches
    from .pipe import data_stages

    s, layout = cfg.section, cfg.layout
    rank = dist.get_rank()
    if rank == 0:
        print(f"seekspeed: {s.recipe.name}/{s.recipe.preset} | {layout.describe()}", flush=True)
    torch.manual_seed(s.train.seed)
    from .topology.placement import deepspeed_topology
    from .topology.setup import plan
    from recipes.layers.pipe import stage_parameter_counts
    stage_params = max(r["params"] for r in stage_parameter_counts(
        recipe.layer_specs(model_config, seed=0), stages=layout.pipe_stages, schedule=s.schedule,
        partition_method=partition_for(cfg, recipe, model_config)))
    topo = plan(s.topology, layout=layout, model_config=model_config, ds=cfg.ds, stage_params=stage_params,
                ep=s.moe.expert_parallel_size, log=(lambda msg: print(msg, flush=True)) if rank == 0 else (lambda m: None))
    model = recipe.build_pipeline(model_config, topology=deepspeed_topology(topo.placement, pp=layout.pipe_stages,
                                                                            dp=layout.data_parallel),
                                  schedule=s.schedule,
                                  partition_method=partition_for(cfg, recipe, model_config),
                                  activation_checkpoint_interval=cfg.ds.get("pipeline", {}).get(
                                      "activation_checkpoint_interval", 0),
                                  seed=s.train.seed, mtp_loss_weight=s.mtp.loss_weight,
                                  expert_parallel_size=s.moe.expert_parallel_size,
                                  document_token=tokenizer.eos_token_id if s.data.attention == "document" else None,
                                  **recipe.train_options(s))
    grid = model._grid
    stage, dp_rank = grid.get_stage_id(), grid.get_data_parallel_id()
    init_tensors, error = 0, None
    if s.init_from is not None and not args.resume:
        from .hf_io import load_hf_into_module
        try:
            init_tensors = load_hf_into_module(model, s.init_from, model_config)
        except SeekspeedError as exc:
            error = exc
    control.stop_if_any_failed(error, rank=rank)
    if s.init_from is not None and not args.resume and rank == 0:
        print(f"init_from: {s.init_from} (each stage read only its own layers)", flush=True)
    has_moe = model_config.num_moe_layers() > 0
    if has_moe:
        moe.configure_balancing(model, alpha=s.moe.balance_loss_alpha, grad_scale=1.0 / layout.grad_accum)

    store = None
    if s.data.pipeline == "tiered":
        store = _packed_store(s.data, tokenizer, control, rank=rank)
    batches, error = None, None
    if store is not None and stage in data_stages(s.schedule, layout.pipe_stages):
        try:
            batches = _tiered_batches(s, layout, store, dp_rank=dp_rank, stage=stage)
        except SeekspeedError as exc:
            error = exc
    elif stage in data_stages(s.schedule, layout.pipe_stages):
        try:
            t0 = time.perf_counter()
            stats = {}
            rows = _load_rows(s, layout, tokenizer, model_config, shard=dp_rank, stats=stats)
            batches = PackedBatches(rows, micro_batch=layout.micro_batch, seed=s.train.seed)
            if dp_rank == 0 and stage == 0:
                from .data.textfiles import describe_undecodable
                undecodable = describe_undecodable(stats["replaced"], stats["skipped"])
                print(f"data: {s.data.source} -> {len(rows):,} sequences of {s.data.seq_len} tokens on data-parallel "
                      f"shard 0 ({time.perf_counter() - t0:.1f}s){'; corpus: ' + undecodable if undecodable else ''}",
                      flush=True)
        except SeekspeedError as exc:
            error = exc
    control.stop_if_any_failed(error, rank=rank)

    ds_config = {k: v for k, v in cfg.ds.items() if k != "seekspeed"}
    from .pipe.engine import initialize
    from .pipe.overlap import check_splittable
    if s.overlap == "layer":
        check_splittable(model)
        if rank == 0:
            print("overlap: layer (each F&B chunk's forward and backward take turns at every expert all-to-all)",
                  flush=True)
    engine = initialize(model=model, config=ds_config, schedule=s.schedule, overlap=s.overlap,
                        model_parameters=[p for p in model.parameters() if p.requires_grad], comm=s.comm,
                        checkpoint=s.checkpoint if s.checkpoint.dir else None, node_of=topo.node_of,
                        overlap_grad_reduce=s.overlap_grad_reduce, log=lambda line: print(line, flush=True))
    if engine.has_moe_layers and rank == 0:
        print(f"moe: {model_config.n_routed_experts} routed experts per layer, expert-parallel degree "
              f"{s.moe.expert_parallel_size} ({model_config.n_routed_experts // s.moe.expert_parallel_size} per rank)",
              flush=True)
    ckpt_dir = s.checkpoint.dir
    if args.resume:
        load_path = _resume(engine, cfg, recipe, model_config, ckpt_dir, control=control, rank=rank)
        from .checkpoint.adam_history import replay
        replay(engine.optimizer)          # CPU FusedAdam's beta powers as the uninterrupted run has them
        if rank == 0:
            print(f"resumed from {load_path} at step {engine.global_steps}", flush=True)
    start = engine.global_steps
    if store is not None and batches is not None:
        batches.seek(engine.global_samples)           # the rows consumed so far, whatever the layout was
    elif batches is not None:
        batches.position = start * layout.grad_accum
    report, window = _run_report(args, s, model_config, engine, control, start=start, rank=rank, has_moe=has_moe)
    if batches is not None:
        from .profile.run import TimedBatches
        batches = TimedBatches(batches)
    total = s.train.steps
    if start >= total and rank == 0:
        print(f"nothing to do: the checkpoint is at step {start} and seekspeed.train.steps is {total}", flush=True)

    async_ckpt = engine._async_checkpoints()
    last_save = time.monotonic()
    layout_record = _layout_record(cfg, recipe, model_config, engine)
    from .comm.state import settings as comm_settings

    def save(step):
        nonlocal last_save
        # "comm": what each rank's compression state file (written by the engine) depends on
        meta = _resume_state(cfg) | {"recipe": s.recipe.name, "model_config": dataclasses.asdict(model_config),
                                     "layout": layout_record, "comm": comm_settings(s.comm, layout=layout_record)}
        if engine.save_checkpoint(ckpt_dir, tag=f"global_step{step}", client_state={"seekspeed": meta}) is not False:
            saved.append(step)
        last_save = time.monotonic()

    def save_due(step):
        if not ckpt_dir or step >= total:
            return False
        if s.checkpoint.interval_steps and step % s.checkpoint.interval_steps == 0:
            return True
        if s.checkpoint.interval_seconds:
            return control.rank0_decides(time.monotonic() - last_save >= s.checkpoint.interval_seconds)
        return False

    progress = Progress(start_step=start, total_steps=total, tokens_per_step=layout.tokens_per_step,
                        log_interval=s.train.log_interval, enabled=rank == 0)
    saved = []
    moe_stats, loss_parts, comm_steps = None, [], []
    for step in range(start + 1, total + 1):
        trace_dir = args.pipe_trace if args.pipe_trace and step == total else None
        if window is not None and step == max(window.first, start + 1) and s.report.plots:
            trace_dir = trace_dir or window.out_dir     # before the profiler starts: its barrier stays out
        if trace_dir:
            from .pipe.engine import InstructionTimeline
            dist.barrier()
            origin = time.perf_counter()
            engine.timeline = InstructionTimeline()
        if window is not None:
            window.before_step(step)
        t_step = time.perf_counter()
        loss = engine.train_batch(batches).item()
        step_s = time.perf_counter() - t_step
        if window is not None and step == window.last:
            error = None
            try:
                window.after_step(step)
            except OSError as exc:
                error = SeekspeedError(str(exc))
            control.stop_if_any_failed(error, rank=rank)
        if trace_dir:
            _write_pipe_trace(trace_dir, engine, control, origin, rank=rank, stage=stage, dp_rank=dp_rank,
                              title=f"{s.schedule}, {layout.pipe_stages} stages, {layout.grad_accum} micro-batches, "
                                    f"step {step}")
        extra = None
        parts = engine.agg_additional_losses
        if parts and progress.is_log_step(step):
            extra = " | ".join(f"{name} {float(value):.4f}" for name, value in parts.items())
        if has_moe:
            loads, balance = moe_step_update(engine, speed=s.moe.bias_update_speed)
            if progress.is_log_step(step):
                moe_stats = _moe_stats(control, loads if dp_rank == 0 else None, balance if dp_rank == 0 else None)
                extra = f"{extra} | {moe_stats['line']}" if extra else moe_stats["line"]
        reducer = engine.grad_reducer
        if reducer is not None and reducer.last is not None:
            comm_steps.append(reducer.last.figures())
            if progress.is_log_step(step):
                what = s.comm.compressor + ("" if s.comm.target == "gradient" else f" {s.comm.target}")
                line = reducer.last.line(what + (f" ({reducer.last.dense}, dense)" if reducer.last.dense else ""))
                extra = f"{extra} | {line}" if extra else line
        progress.update(step, loss, lr=engine.get_lr()[0], extra=extra)
        if parts:
            loss_parts.append({name: float(value) for name, value in parts.items()})
        _report_step(report, engine, step=step, loss=loss, step_s=step_s, layout=layout, batches=batches, parts=parts,
                     moe_stats=moe_stats if has_moe and progress.is_log_step(step) else None)
        if save_due(step):
            save(step)
    if ckpt_dir and s.checkpoint.save_final and total > start:
        if async_ckpt is not None:
            async_ckpt.wait()      # the final save is never skipped for one still writing
        save(total)
    if async_ckpt is not None:
        async_ckpt.wait()
        saved = [h["step"] for h in async_ckpt.committed()]

    report_entry = report.finish(control, title=f"{s.recipe.name}/{s.recipe.preset}, {s.schedule}")
    summary = progress.summary()
    if report_entry is not None:
        summary["report"] = report_entry
    summary.update(peak_rss_mib=[round(r, 1) for r in control.gather(peak_rss_mib())], config=cfg.path,
                   layout=vars(layout) | {"tokens_per_step": layout.tokens_per_step},
                   checkpoints=[os.path.join(ckpt_dir, f"global_step{n}") for n in saved] if ckpt_dir else [])
    if s.init_from is not None and not args.resume:
        summary["init_from_tensors_per_rank"] = control.gather(init_tensors)
    if loss_parts:
        summary["loss_parts"] = loss_parts
    if comm_steps:
        summary["comm"] = _comm_summary(control, comm_steps, s.comm)
    if async_ckpt is not None:
        summary["checkpoint_history"] = async_ckpt.history
    if store is not None:
        tiers = control.gather(batches.figures() if batches is not None else None)
        summary["data_tiers"] = [t for t in tiers if t is not None]
        if batches is not None:
            batches.close()
    if moe_stats is not None:
        summary["moe"] = {k: v for k, v in moe_stats.items() if k != "line"}
    if rank == 0:
        _print_summary(summary)
        if args.summary_json:
            os.makedirs(os.path.dirname(os.path.abspath(args.summary_json)), exist_ok=True)
            with open(args.summary_json, "w") as f:
                json.dump(summary, f, indent=2)
    return 0


def _run_report(args, s, model_config, engine, control, *, start, rank, has_moe):
    from .profile.run import RunReport, report_dir
    directory = report_dir(s.report, checkpoint_dir=s.checkpoint.dir, override=args.report_dir)
    window = None
    profile = args.profile or s.report.profile
    if profile:
        from .profile.window import ProfileWindow, parse_window
        first, last = parse_window(profile)
        if last <= start and rank == 0:
            print(f"profile: window {profile} lies before the resumed step {start}; nothing is profiled", flush=True)
        window = ProfileWindow(first, last, out_dir=os.path.join(directory, "profile"), rank=rank,
                               log=(lambda m: print(m, flush=True)) if rank == 0 else (lambda m: None))
    extra = []
    if model_config.num_mtp_layers:
        extra += ["loss_lm", "loss_mtp"]
    if has_moe:
        extra += ["moe_max_over_mean"]
    report, error = None, None
    try:
        report = RunReport(directory, rank=rank, start_step=start, extra_columns=extra,
                           monitor=getattr(engine, "monitor", None), window=window, plots=s.report.plots,
                           log=(lambda m: print(m, flush=True)) if rank == 0 else (lambda m: None))
    except OSError as exc:
        error = SeekspeedError(f"report directory {directory}: {exc.strerror or exc}; choose a writable "
                               f"seekspeed.report.dir or --report-dir")
    control.stop_if_any_failed(error, rank=rank)
    if rank == 0 and directory:
        print(f"report: {directory} (metrics.csv{', plots' if s.report.plots else ''}"
              f"{f', profile of steps {profile}' if profile else ''})", flush=True)
    return report, window


def _report_step(report, engine, *, step, loss, step_s, layout, batches, parts, moe_stats):
    norm = engine.get_global_grad_norm()
    row = {"step": step, "loss": loss, "tokens_per_s": layout.tokens_per_step / step_s if step_s > 0 else None,
           "lr": engine.get_lr()[0], "grad_norm": None if norm is None else float(norm), "step_s": step_s,
           "data_wait_s": batches.take_wait() if batches is not None else None}
    reducer = getattr(engine, "grad_reducer", None)
    if reducer is not None and reducer.last is not None:
        row["comm_bytes"], row["comm_s"] = reducer.last.wire_bytes, reducer.last.total_s
    else:
        row["comm_bytes"], row["comm_s"] = report.comms_logger_step()
    for name, value in (parts or {}).items():
        row[f"loss_{name}"] = float(value)
    load = None
    if moe_stats is not None:
        row["moe_max_over_mean"] = moe_stats["max_over_mean_load"]
        load = moe_stats["expert_load"]
    report.write(row, expert_load=load)


def _comm_summary(control, steps, section):
    """Per-rank means over the steps after warm-up of the compressed reduction's counters."""
    after = steps[section.warmup_steps:] or steps
    mine = {k: sum(st[k] for st in after) / len(after) for k in after[0]}
    ranks = control.gather(mine)
    return {"compressor": section.compressor, "hierarchical": section.hierarchical, "steps_averaged": len(after),
            "per_rank_mean_per_step": ranks}


def _write_pipe_trace(directory, engine, control, origin, *, rank, stage, dp_rank, title):
    """Gather the traced step's instruction times of data-parallel replica 0 (one lane
    per pipeline stage; times from a barrier just before the step) and write them."""
    from .pipe.trace import from_engine_events, plot_timeline, write_chrome_trace
    events = from_engine_events(engine.timeline.events, origin=origin) if dp_rank == 0 else None
    engine.timeline = None
    lanes = control.gather((stage, events))
    if rank != 0:
        return
    lanes = [e for _, e in sorted((s, e) for s, e in lanes if e is not None)]
    os.makedirs(directory, exist_ok=True)
    write_chrome_trace(lanes, os.path.join(directory, "pipeline_trace.json"), name=title)
    plot_timeline(lanes, os.path.join(directory, "pipeline_timeline.png"), title=title)
    print(f"pipeline trace: {directory}/pipeline_trace.json, {directory}/pipeline_timeline.png", flush=True)


def moe_step_update(engine, *, speed):
    """After an optimizer step: the routers' bias update (loads summed over the stage's
    replicas) and this rank's balance loss. Under dualpipe each stage's two copies (a
    rank pair) see half the micro-batches each: their loads are summed too, so both
    copies' biases move alike, and each layer's balance loss is the mean of its copies'."""
    pair = getattr(engine, "_pair_group", None)
    loads = moe.update_expert_biases(engine.module, speed=speed, group=[engine.grid.get_data_parallel_group(), pair])
    balance = moe.take_balance_loss(engine.module)
    if pair is not None and balance is not None:
        balance /= 2
    return loads, balance


def _moe_stats(control, loads, balance):
    """Gather each stage's per-expert loads (summed over its replicas) and balance loss;
    the line shows the worst layer's max/mean expert load."""
    gathered = control.gather((loads, balance))
    per_layer, balance_total = {}, None
    for stage_loads, stage_balance in gathered:
        per_layer.update(stage_loads or {})
        if stage_balance is not None:
            balance_total = (balance_total or 0.0) + stage_balance
    worst = max((max(l) / (sum(l) / len(l)) for l in per_layer.values() if sum(l) > 0), default=1.0)
    line = f"moe max/mean expert load {worst:.2f}"
    if balance_total is not None:
        line += f" | balance loss {balance_total:.2e}"
    return {"line": line, "max_over_mean_load": worst, "expert_load": per_layer, "balance_loss": balance_total}


class _Reported(Exception):
    """A failure already reported on rank 0; this rank only exits with code 2."""


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

"""Resume a checkpoint on another parallel layout: another data-parallel degree,
expert-parallel degree, pipeline degree or schedule.

DeepSpeed's own load_checkpoint needs the layout it saved with: each rank reads its
own ``zero_pp_rank_<dp>_mp_rank_<stage>`` file, a flat slice of its stage's fp32
master weights and Adam moments cut for that many replicas. Here, as DeepSpeed's
universal checkpoint does (arXiv 2406.18820), every tensor is first made whole again
under its logical name, then cut anew for this run:

- logical names: a parameter's name in the PipelineModule (its global layer index,
  ``tied_modules.<key>.`` for tied layers), with routed experts by their global
  index (``...deepspeed_experts.<e>...``) instead of their index on one rank;
- the saved run's ``layout`` record (written by the trainer beside each checkpoint:
  degrees, schedule and the layer keys each pipeline rank held) says which stage
  files hold a rank's layers; of those it reads every replica's ZeRO file and puts
  each parameter's fragments together in partition order (``param_slice_mappings``
  name them: dense parameters are cut over the data-parallel replicas, routed
  experts over the ranks holding the same experts, data-parallel index // E, their
  expert-parallel rank the index % E, as deepspeed.utils.groups lays them out);
- writing: each local parameter gets its whole fp32 master (cast to the model's
  dtype), the slice ZeRO-1 or the BF16 optimizer gives this rank (``_hp_mapping``, the
  link DeepSpeed's universal loader uses) gets the master and both moments, the optimizer's step and
  hyper-parameters, the loss scaler, the lr scheduler, the engine's step and sample
  counters and the routers' correction biases (persistent buffers) come from the
  checkpoint.

Every file is read through the engine's checkpoint engine, so async-zstd files are
verified against their manifest and neither format can run code. Nothing here is
collective: a rank that fails raises, and the trainer stops every rank together.
"""

import os
import re

import torch

from ds_ext.errors import SeekspeedError

_EXPERT = re.compile(r"^(?P<head>.*\.deepspeed_experts\.)(?P<index>\d+)(?P<tail>\..+)$")
_MOMENTS = ("exp_avg", "exp_avg_sq")


class ReshardError(SeekspeedError):
    """A checkpoint cannot be resumed on this layout; the message says why and what to do."""


def layer_key(name):
    """The layer a parameter or buffer name belongs to: ``"12"`` or ``"tied_modules.embed"``."""
    parts = name.split(".")
    return ".".join(parts[:2]) if parts[0] == "tied_modules" else parts[0]


def to_global(name, *, ep_rank, local_experts):
    """``name`` with a routed expert's local index replaced by its global one."""
    m = _EXPERT.match(name)
    if m is None:
        return name
    return f"{m['head']}{ep_rank * local_experts + int(m['index'])}{m['tail']}"


# DeepSpeed optimizers whose state is cut over the replicas with a name for every slice
# (param_slice_mappings) and a link from each parameter to its slice (_hp_mapping): ZeRO
# stage 1, and the BF16 optimizer (bf16 with fp32 gradient accumulation, or ZeRO 0 bf16)
PARTITIONED_OPTIMIZERS = ("DeepSpeedZeroOptimizer", "BF16_Optimizer")


def zero_file(tag_dir, *, dp, stage, bf16=False):
    return os.path.join(tag_dir, f"{'bf16_' if bf16 else ''}zero_pp_rank_{dp}_mp_rank_{stage:02d}_optim_states.pt")


def model_file(tag_dir, *, stage):
    return os.path.join(tag_dir, f"mp_rank_{stage:02d}_model_states.pt")


def _load(engine, path):
    if not os.path.isfile(path):
        raise ReshardError(f"{path} is missing: the checkpoint is incomplete or was written with another layout "
                           f"than its layout record says")
    return engine.checkpoint_engine.load(path, map_location=torch.device("cpu"))


def load_model_state(engine, tag_dir):
    """The checkpoint's first model file (global step, lr scheduler, client state)."""
    return _load(engine, model_file(tag_dir, stage=0))


def _local_moe(module, routed_experts):
    """(expert-parallel rank, routed experts per rank) of ``module``'s MoE layers, or (0,
    0); ``routed_experts`` is the recipe's (RecipeSpec.routed_experts)."""
    for group in routed_experts(module):
        return group.ep_rank, group.num_local
    return 0, 0


def optimizer_kind(engine):
    """The name of the engine's optimizer (one of PARTITIONED_OPTIMIZERS when resharding works)."""
    optimizer = engine.optimizer
    name = type(optimizer).__name__
    if name == "DeepSpeedZeroOptimizer" and optimizer.partition_gradients:
        return "DeepSpeedZeroOptimizer (stage 2)"
    return name


class _Partitions:
    """What a reshard writes in DeepSpeed's partitioned optimizers: the model's parameter
    groups, their fp32 slices on this rank, and the optimizer holding the moments."""

    def __init__(self, engine, what):
        kind = optimizer_kind(engine)
        if kind not in PARTITIONED_OPTIMIZERS:
            raise ReshardError(f"{what}: resuming on another layout needs an optimizer whose state DeepSpeed cuts "
                               f"by replicas ({', '.join(PARTITIONED_OPTIMIZERS)}: zero_optimization.stage 1, or bf16); "
                               f"this run's is {kind}. Resume with the checkpoint's layout")
        self.optimizer = engine.optimizer
        self.bf16 = kind == "BF16_Optimizer"
        self.lp_groups = self.optimizer.bf16_groups if self.bf16 else self.optimizer.bit16_groups
        self.hp_groups = self.optimizer.fp32_groups_flat_partition if self.bf16 else \
            self.optimizer.single_partition_of_fp32_groups
        self.inner = self.optimizer.optimizer

    def finish(self, osd):
        """The optimizer-wide state (clip, loss scaler) of a saved ZeRO file, and the
        parameter-to-slice links made again over the state just written."""
        if self.bf16:
            self.optimizer.clip_grad = osd.get("clip_grad", self.optimizer.clip_grad)
            self.optimizer._link_all_hp_params()
        else:
            self.optimizer._load_global_state(osd)


def read_stage(engine, tag_dir, *, stage, saved, wanted):
    """The whole tensors of the parameters in ``wanted`` (logical names) that saved
    pipeline rank ``stage`` holds: {name: {"fp32", "exp_avg", "exp_avg_sq"}}; and per
    kind of parameter group ("dense", "moe") its saved optimizer step, hyper-parameters
    and one optimizer state dict (for the loss scaler)."""
    dp, ep = saved["data_parallel"], saved["expert_parallel_size"]
    local = saved["n_routed_experts"] // ep if saved.get("n_routed_experts") else 0
    bf16 = bool(saved.get("bf16"))
    pieces, groups, first = {}, {}, None
    for r in range(dp):
        state = _load(engine, zero_file(tag_dir, dp=r, stage=stage, bf16=bf16))
        osd = state["optimizer_state_dict"]
        first = first or osd
        base = osd["base_optimizer_state"]
        for g, mappings in enumerate(osd["param_slice_mappings"]):
            hyper = base["param_groups"][g]
            moe = bool(hyper.get("moe"))
            part = r // ep if moe else r
            flat = {"fp32": osd["single_partition_of_fp32_groups"][g]}
            flat.update({k: base["state"][g][k] for k in _MOMENTS})
            kind = "moe" if moe else "dense"
            step = base["state"][g].get("step")
            if kind in groups and groups[kind]["step"] != step:
                raise ReshardError(f"{zero_file(tag_dir, dp=r, stage=stage, bf16=bf16)}: optimizer step {step} differs from "
                                   f"{groups[kind]['step']} in another replica's file: the checkpoint is inconsistent")
            groups.setdefault(kind, {"step": step, "hyper": {k: v for k, v in hyper.items() if k != "params"}})
            for name, address in mappings.items():
                logical = to_global(name, ep_rank=r % ep, local_experts=local) if moe else name
                if logical not in wanted:
                    continue
                got = pieces.setdefault(logical, {})
                if part in got:
                    continue            # the same partition of a dense group on another expert-parallel rank
                got[part] = {k: v.narrow(0, address.start, address.numel) for k, v in flat.items()}
    # a parameter lies in one partition or runs across consecutive ones: its fragments in
    # partition order are the whole of it (load_into checks the element count)
    whole = {name: {k: torch.cat([parts[p][k] for p in sorted(parts)]) for k in ("fp32",) + _MOMENTS}
             for name, parts in pieces.items()}
    return whole, groups, first


def _saved_buffers(engine, tag_dir, *, stage, keys):
    """The module tensors (persistent buffers among them) the saved stage's files hold
    for layer ``keys``: the stage's model file (MoE models keep the stage's module there),
    else one file per numbered layer. Returns them and the model file's state dict."""
    import glob
    out = {}
    state = _load(engine, model_file(tag_dir, stage=stage))
    module = state.get("module") if isinstance(state, dict) else None
    if module:
        out.update(module)
    for key in keys:
        if key.isdigit():
            for path in sorted(glob.glob(os.path.join(tag_dir, f"layer_{int(key):02d}-model_*states.pt")))[:1]:
                out.update({f"{key}.{k}": v for k, v in _load(engine, path).items()})
    return out, state


@torch.no_grad()
def load_into(engine, tag_dir, *, saved, routed_experts, log=print):
    """Fill ``engine`` (built for this run's layout) with the state of checkpoint
    ``tag_dir``, written with the layout record ``saved``; ``routed_experts`` finds the
    recipe's experts in the engine's module (RecipeSpec.routed_experts). Returns the
    checkpoint's model-file state dict (client state included)."""
    parts = _Partitions(engine, tag_dir)
    if saved.get("optimizer") not in PARTITIONED_OPTIMIZERS:
        raise ReshardError(f"{tag_dir} was written by {saved.get('optimizer')}, whose state is not cut by replicas; "
                           f"resume it on its own layout")
    ep_rank, local = _local_moe(engine.module, routed_experts)
    names = {id(p): n for n, p in engine.module.named_parameters()}
    mine = {n: to_global(n, ep_rank=ep_rank, local_experts=local) for n in names.values()}
    wanted = set(mine.values())
    my_keys = {layer_key(n) for n in wanted}
    stage_keys = saved["stage_keys"]
    sources = {}                            # saved stage -> the layer keys read from it
    for key in sorted(my_keys):
        holders = [s for s, keys in enumerate(stage_keys) if key in keys]
        if not holders:
            raise ReshardError(f"{tag_dir}: no pipeline rank of the saved run held layer {key}: the checkpoint is "
                               f"another model's (check recipe.preset and recipe.overrides)")
        sources.setdefault(holders[0], set()).add(key)
    tensors, groups, first_optim, buffers, model_state = {}, {}, None, {}, None
    for stage, keys in sorted(sources.items()):
        want = {n for n in wanted if layer_key(n) in keys}
        whole, kinds, osd = read_stage(engine, tag_dir, stage=stage, saved=saved, wanted=want)
        tensors.update(whole)
        for kind, g in kinds.items():
            groups.setdefault(kind, g)
        first_optim = first_optim or osd
        got, state = _saved_buffers(engine, tag_dir, stage=stage, keys=keys)
        buffers.update({k: v for k, v in got.items() if layer_key(k) in keys})
        model_state = model_state or state
    missing = sorted(wanted - set(tensors))
    if missing:
        raise ReshardError(f"{tag_dir}: no optimizer state for {missing[:3]}: the checkpoint is another model's or "
                           f"incomplete")

    params = dict(engine.module.named_parameters())
    for name, p in params.items():
        full = tensors[mine[name]]["fp32"]
        if full.numel() != p.numel():
            raise ReshardError(f"{tag_dir}: {mine[name]} has {full.numel():,} elements in the checkpoint, "
                               f"{p.numel():,} in this model: it is another model (check recipe.overrides)")
        p.data.copy_(full.view(p.shape).to(p.dtype))
    for i, flat in enumerate(parts.hp_groups):
        moe = bool(parts.inner.param_groups[i].get("moe"))
        kind = "moe" if moe else "dense"
        if kind not in groups:
            raise ReshardError(f"{tag_dir}: the checkpoint has no {kind} parameter group: it is another model's")
        moments = {k: torch.zeros_like(flat) for k in _MOMENTS}
        for lp in parts.lp_groups[i]:
            mapping = getattr(lp, "_hp_mapping", None)
            if mapping is None:
                continue
            lp_at, hp_at = mapping.lp_fragment_address, mapping.get_hp_fragment_address()
            t = tensors[mine[names[id(lp)]]]
            mapping.hp_fragment.data.copy_(t["fp32"].narrow(0, lp_at.start, lp_at.numel))
            for k in _MOMENTS:
                moments[k].narrow(0, hp_at.start, hp_at.numel).copy_(t[k].narrow(0, lp_at.start, lp_at.numel))
        group = parts.inner.param_groups[i]
        parts.inner.state[group["params"][0]] = {"step": groups[kind]["step"], **moments}
        for key, value in groups[kind]["hyper"].items():
            if key != "name":
                group[key] = value
    parts.finish(first_optim)

    for name, buf in engine.module.named_buffers():
        key = to_global(name, ep_rank=ep_rank, local_experts=local)
        if key in buffers:
            buf.copy_(buffers[key])
        elif name in engine.module.state_dict():
            raise ReshardError(f"{tag_dir}: no saved value for buffer {key}: the checkpoint is another model's")

    engine.global_steps = model_state["global_steps"]
    engine.global_samples = model_state.get("global_samples", engine.global_steps * saved["train_batch"])
    engine.skipped_steps = model_state["skipped_steps"]
    if engine.lr_scheduler is not None and model_state.get("lr_scheduler") is not None:
        engine.lr_scheduler.load_state_dict(model_state["lr_scheduler"])
    log(f"resharded {tag_dir}: {len(params)} tensors of this rank from saved pipeline rank(s) "
        f"{sorted(sources)} of {len(stage_keys)} x {saved['data_parallel']} replicas")
    return model_state

"""What a compressed run keeps between steps, saved with every checkpoint and restored
by ``--resume``.

A ``GradientReducer`` holds, per global rank (every rank's residuals are its own):
``steps`` (optimizer steps reduced: the first ``warmup_steps`` go dense), the
compressor's ``state`` (key -> {name: tensor}: error-feedback residuals, DGC's
momentum, PowerSGD's warm-start Q and error), the compressor's sampling
``generator`` (top-k) when it has one, and the reducer's own dict attributes
(``momentum`` and any named in ``STATE_ATTRS``: key -> tensor, or -> {name: tensor}).

Each rank writes ``comm_state_rank<global rank, 5 digits>.pt`` in the checkpoint's tag
directory through the engine's checkpoint engine, so DeepSpeed's torch.save engine and
the async-zstd engine (which stages, hashes, lists in its manifest and commits it with
the rest of the checkpoint) both hold it. The file holds only plain values (dicts,
lists, tuples, strings, numbers, tensors), so it loads through safe_pickle's allow-list
and through torch's ``weights_only`` loader; dict keys are kept as they are (tuples of
strings and ints: pickled without naming any global) in a list of ``[key, value]``
pairs::

    {"format": "seekspeed-comm-state", "version": 1, "rank": 3, "world_size": 4,
     "settings": settings(section),                    # without the layout
     "state": {"steps": 120,
               "compressor": [[("dense", 0), {"residual": tensor}], ...],
               "generator": uint8 tensor | None,       # torch.Generator.get_state()
               "attrs": {"momentum": [[key, tensor], ...]}}}

``settings(section, layout=...)`` is what the saved state means something under: the
``seekspeed.comm`` fields that change the compressor's arithmetic or which elements a
key names, and the parallel layout that decides what a rank's gradients are. The
trainer records it in each checkpoint's seekspeed client state; ``resume_plan``
compares it with this run's and, per ``seekspeed.comm.on_mismatch``, loads the state,
refuses in one line, or starts compression afresh with a warning.
"""

import dataclasses
import os

import torch

from ds_ext.errors import ConfigError

FORMAT = "seekspeed-comm-state"
VERSION = 1

# seekspeed.comm fields whose change makes saved state meaningless (not: kernel, which
# computes the same selection; pipeline_depth, warmup_steps, on_mismatch)
SETTINGS_FIELDS = ("compressor", "target", "ratio", "selection", "sample_ratio", "momentum", "rank", "block_size",
                   "error_feedback", "min_numel", "dense_params", "chunk_mb", "hierarchical")
# fields recorded only away from their default (checkpoints written before them hold the default)
_OPTIONAL_SETTINGS = {"residual_dtype": "fp32", "var_rescale": False}
# the trainer's layout record (run_plan.layout_record) keys that decide which gradients a
# rank reduces, in which order and over which group: chunk keys name elements of them
LAYOUT_FIELDS = ("data_parallel", "pipe_stages", "expert_parallel_size", "zero_stage", "schedule", "bf16",
                 "optimizer", "stage_keys")
# compressors whose wire format loses nothing: no residuals to carry
_LOSSLESS = ("fp32", "bf16", "fp16")


def file_name(rank):
    return f"comm_state_rank{rank:05d}.pt"


def settings(section, *, layout=None):
    """The fingerprint of ``section`` (a ``seekspeed.comm`` section) and ``layout`` (a
    mapping with LAYOUT_FIELDS, run_plan.layout_record) that saved state depends on;
    None when the section compresses nothing (compressor ``none``)."""
    if section.compressor == "none":
        return None
    out = {name: getattr(section, name) for name in SETTINGS_FIELDS}
    out["block_size"] = section.resolved_block_size
    if out["dense_params"] is not None:
        out["dense_params"] = list(out["dense_params"])
    for name, default in _OPTIONAL_SETTINGS.items():     # recorded when set, so older fingerprints still match
        if getattr(section, name) != default:
            out[name] = getattr(section, name)
    if layout is not None:
        out["layout"] = {name: layout.get(name) for name in LAYOUT_FIELDS}
    return out


def differences(saved, now):
    """``"field saved -> now"`` for each field of two ``settings`` that differs."""
    out = []
    for name in dict.fromkeys([*saved, *now]):
        if name == "layout":
            before, after = saved.get(name) or {}, now.get(name) or {}
            for field in dict.fromkeys([*before, *after]):
                if before.get(field) != after.get(field):
                    if field == "stage_keys":
                        out.append("layout stage_keys (the layers each pipeline rank holds) differ")
                    else:
                        out.append(f"layout {field} {before.get(field)!r} -> {after.get(field)!r}")
        else:
            default = _OPTIONAL_SETTINGS.get(name)
            before, after = saved.get(name, default), now.get(name, default)
            if before != after:
                out.append(f"{name} {before!r} -> {after!r}")
    return out


# -- the reducer's state ---------------------------------------------------------------------

def _check_key(key, where):
    """Keys are stored as they are: only values that pickle without naming a global
    (and so load through safe_pickle and torch's weights_only loader)."""
    if type(key) is tuple:            # not a subclass (torch.Size, a namedtuple): those pickle as a global
        for part in key:
            _check_key(part, where)
    elif type(key) not in (str, int, float, bool, type(None)):
        raise TypeError(f"{where}: key part {key!r} ({type(key).__name__}) cannot be saved in a checkpoint; "
                        f"compression state keys are tuples of strings and ints")


def _plain(value, where):
    """``value`` with every tensor a plain detached one (a view, not a copy: a Parameter
    or a tensor subclass would pickle as a global), checked to hold nothing else."""
    if torch.is_tensor(value):
        return value.detach().as_subclass(torch.Tensor)
    if value is None or type(value) in (str, int, float, bool):
        return value
    if type(value) in (list, tuple):
        return type(value)(_plain(v, where) for v in value)
    if type(value) is dict:
        for k in value:
            _check_key(k, where)
        return {k: _plain(v, where) for k, v in value.items()}
    raise TypeError(f"{where}: a {type(value).__name__} cannot be saved in a checkpoint; compression state holds "
                    f"tensors, numbers, strings and containers of them")


def _entries(mapping, where):
    out = []
    for key, value in mapping.items():
        _check_key(key, where)
        out.append([key, _plain(value, f"{where}[{key!r}]")])
    return out


def _to(value, device):
    if torch.is_tensor(value):
        return value.to(device) if device is not None else value
    if isinstance(value, dict):
        return {k: _to(v, device) for k, v in value.items()}
    if isinstance(value, list):
        return [_to(v, device) for v in value]
    if isinstance(value, tuple):
        return tuple(_to(v, device) for v in value)
    return value


def _attr_names(reducer):
    return tuple(dict.fromkeys(("momentum", *getattr(reducer, "STATE_ATTRS", ()))))


def state_dict(reducer):
    """Everything ``reducer`` (a GradientReducer) carries from one step to the next, as
    plain values (the tensors themselves, not copies: save it before the next step)."""
    comp = reducer.compressor
    generator = getattr(comp, "generator", None)
    attrs = {}
    for name in _attr_names(reducer):
        value = getattr(reducer, name, None)
        if isinstance(value, dict):
            attrs[name] = _entries(value, f"reducer.{name}")
    return {"steps": int(reducer.steps),
            "compressor": _entries(getattr(comp, "state", {}), f"{type(comp).__name__}.state"),
            "generator": generator.get_state() if generator is not None else None,
            "attrs": attrs}


def load_state_dict(reducer, sd, *, device=None):
    """Put ``sd`` (from ``state_dict``) into ``reducer``: its steps, the compressor's state
    and generator, its dict attributes (cleared and refilled, so references to them stay
    valid). ``device``: where the state tensors go (the gradients' device); the
    generator's state stays on the CPU."""
    comp = reducer.compressor
    has_state = hasattr(comp, "state")
    if sd["compressor"] and not has_state:
        raise ValueError(f"compression state for {len(sd['compressor'])} key(s), but {type(comp).__name__} keeps none")
    generator = getattr(comp, "generator", None)
    if (sd["generator"] is None) != (generator is None):
        raise ValueError(f"the saved state {'has' if sd['generator'] is not None else 'has no'} sampling generator, "
                         f"{type(comp).__name__} {'has none' if generator is None else 'has one'}")
    for name, entries in sd["attrs"].items():
        if entries and not isinstance(getattr(reducer, name, None), dict):
            raise ValueError(f"saved reducer.{name} ({len(entries)} entries), but this reducer has no dict {name!r}")
    reducer.steps = int(sd["steps"])
    if has_state:
        comp.state = {key: _to(value, device) for key, value in sd["compressor"]}
    if generator is not None:
        generator.set_state(sd["generator"].cpu())
    for name, entries in sd["attrs"].items():
        target = getattr(reducer, name, None)
        if isinstance(target, dict):
            target.clear()
            target.update((key, _to(value, device)) for key, value in entries)


# -- checkpoint files ------------------------------------------------------------------------

def save_file(engine, save_dir, tag):
    """Write this rank's compression state into checkpoint ``tag`` of ``save_dir``
    through ``engine.checkpoint_engine`` (the async engine stages and commits it with
    the checkpoint). Called from the engine's save_checkpoint, on every rank."""
    import torch.distributed as tdist
    reducer = engine.grad_reducer
    ckpt = engine.checkpoint_engine
    tag_dir = os.path.join(save_dir, str(tag))
    ckpt.makedirs(tag_dir, exist_ok=True)
    rank = tdist.get_rank()
    ckpt.save({"format": FORMAT, "version": VERSION, "rank": rank, "world_size": tdist.get_world_size(),
               "settings": settings(reducer.section), "state": state_dict(reducer)},
              os.path.join(tag_dir, file_name(rank)))


def load_file(engine, tag_dir, *, saved):
    """Load this rank's compression state file of ``tag_dir`` into ``engine.grad_reducer``
    (through the engine's restricted loader: manifest-checked, no code run). ``saved``:
    the checkpoint's recorded ``settings`` (the file must agree). Returns the steps
    it restored. Raises CheckpointError naming the file."""
    import torch.distributed as tdist
    from ds_ext.checkpoint import engine as engines, load as loader
    rank, world = tdist.get_rank(), tdist.get_world_size()
    path = os.path.join(tag_dir, file_name(rank))
    if not os.path.isfile(path):
        raise loader.CheckpointError(f"{path} is missing: the checkpoint records compression state for every rank "
                                     f"but not this one's file, so it is incomplete; resume an earlier checkpoint")
    ckpt = engine.checkpoint_engine
    if isinstance(ckpt, (engines.AsyncCheckpointEngine, engines.RestrictedTorchCheckpointEngine)):
        data = ckpt.load(path, map_location="cpu")
    else:
        data = loader.load_file(path, map_location="cpu")
    expected = {k: v for k, v in saved.items() if k != "layout"}
    got = (data.get("format"), data.get("version"), data.get("rank"), data.get("world_size"), data.get("settings")) \
        if isinstance(data, dict) else None
    if got != (FORMAT, VERSION, rank, world, expected):
        raise loader.CheckpointError(f"{path}: not the compression state of global rank {rank} of {world} with the "
                                     f"settings the checkpoint records (format, rank, world size, settings: "
                                     f"{got!r}); resume an earlier checkpoint")
    try:
        load_state_dict(engine.grad_reducer, data["state"], device=engine.device)
    except (KeyError, TypeError, ValueError) as exc:
        raise loader.CheckpointError(f"{path}: cannot be restored ({type(exc).__name__}: {exc}); resume an earlier "
                                     f"checkpoint") from None
    return engine.grad_reducer.steps


# -- what --resume does -----------------------------------------------------------------------

@dataclasses.dataclass
class ResumePlan:
    load: bool                 # each rank loads its file into its reducer
    warning: str | None        # one line for rank 0 to print


def _what_is_lost(section):
    """The state ``section``'s reducer keeps, as words for the restart warning."""
    kept = []
    if section.error_feedback and section.compressor not in _LOSSLESS:
        kept.append("error-feedback residuals")
    if section.compressor == "powersgd":
        kept.append("PowerSGD's warm-start Q")
    if section.compressor == "topk" and section.momentum > 0:
        kept.append("DGC's momentum")
    if section.compressor == "topk" and section.selection == "sampled":
        kept.append("top-k's sampling generator")
    if section.target == "momentum":
        kept.append("the momentum mode's buffers")
    state = (", ".join(kept[:-1]) + " and " + kept[-1] if len(kept) > 1 else kept[0]) + " start empty, " \
        if kept else ""
    n = section.warmup_steps
    again = (f"and the run begins again with {n} dense warm-up step{'s' if n != 1 else ''}" if n
             else "and compression starts at once (warmup_steps 0)")
    return state + again


def resume_plan(saved, now, *, section, path):
    """What --resume does with a checkpoint whose recorded compression settings are
    ``saved`` (None: it holds no compression state) when this run's are ``now``
    (``settings``; None: compressor none). Raises ConfigError when they disagree and
    ``section.on_mismatch`` is "refuse"."""
    if now is None:
        if saved is None:
            return ResumePlan(load=False, warning=None)
        return ResumePlan(load=False, warning=f"--resume: {path} holds compression state ({saved['compressor']}), "
                                              f"dropped: this run reduces with DeepSpeed's own all-reduce "
                                              f"(seekspeed.comm.compressor none)")
    if saved is None:
        problem = (f"{path} holds no compression state (written with seekspeed.comm.compressor none, or by a "
                   f"seekspeed from before compression state was saved)")
        fix = "resume with its comm settings (compressor \"none\" if it had no compression)"
    else:
        diff = differences(saved, now)
        if not diff:
            return ResumePlan(load=True, warning=None)
        problem = f"{path} was written with other compression settings ({'; '.join(diff)})"
        fix = "resume with the checkpoint's seekspeed.comm settings and layout"
    if section.on_mismatch == "refuse":
        raise ConfigError(f"--resume: {problem}, so its compression state does not apply: {fix}, or set "
                          f"seekspeed.comm.on_mismatch \"restart\" to begin compression afresh")
    return ResumePlan(load=False, warning=f"--resume: {problem}; seekspeed.comm.on_mismatch is restart: "
                                          f"{_what_is_lost(section)}")

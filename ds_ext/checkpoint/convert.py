"""Convert a seekspeed (async-zstd) checkpoint to DeepSpeed's torch.save layout, so
that DeepSpeed's own tools (zero_to_fp32, ds_to_universal) and anything else that
expects DeepSpeed's files can read it.

The result is what DeepSpeed's default engine writes: the same file names in
``OUT/TAG/``, each holding the same object torch.save'd (zip serialization, as
DeepSpeed's TorchCheckpointEngine by default; cloned where DeepSpeed clones), ``OUT/latest`` naming the tag, and
DeepSpeed's recovery scripts (zero_to_fp32.py, zero_to_torch.py) where the source
has them. It is built in a hidden directory beside OUT and renamed into place only
when every file is written and fsynced: nothing appears at OUT otherwise, and the
source is only read.
"""

import os
import shutil
import stat
import tempfile
import time

import torch

from ds_ext.errors import ConfigError
from ds_ext.fileio import fsync_directory
from . import catalog
from .load import CheckpointError, kind_of, open_tag

RECOVERY_SCRIPTS = ("zero_to_fp32.py", "zero_to_torch.py")


def _as_deepspeed_saves(obj, *, kind, moe):
    """``obj`` as DeepSpeed's torch engine hands it to torch.save. For the files it
    writes through clone_tensors_for_torch_save (pipeline layers, experts and their
    optimizer states, and with MoE the model states; deepspeed/runtime/engine.py and
    pipe/module.py, 0.19) that function, which detaches and copies each tensor and
    turns tuples such as torch.Size into plain tuples; everything else as it was
    handed to the engine, which is what the async engine stored."""
    if kind in ("layer", "expert", "expert_optim") or (kind == "model" and moe):
        from deepspeed.checkpoint.utils import clone_tensors_for_torch_save
        return clone_tensors_for_torch_save(obj)
    return obj


def _save(obj, path):
    with open(path, "wb") as f:
        try:
            torch.save(obj, f)
        except RuntimeError as exc:        # torch's zip writer, failing to finish after a failed write
            if isinstance(exc.__context__, OSError):
                raise exc.__context__ from None
            raise
        f.flush()
        os.fsync(f.fileno())


def to_deepspeed(ckpt_dir, out_dir, *, tag=None, log=print):
    """Write checkpoint ``tag`` (None or "latest": the one 'latest' names) of
    ``ckpt_dir`` to ``out_dir`` in DeepSpeed's format. ``out_dir`` must not exist or be
    empty. Returns {"out", "tag", "files", "source_bytes", "bytes"}."""
    if os.path.exists(out_dir) and (not os.path.isdir(out_dir) or os.listdir(out_dir)):
        raise ConfigError(f"--out {out_dir} exists and is not empty: choose a new directory")
    ckpt = open_tag(ckpt_dir, tag)
    if ckpt.kind != "seekspeed":
        raise ConfigError(f"{ckpt.path} has no {catalog.MANIFEST}: it is in DeepSpeed's format already (written by "
                          f"checkpoint.engine \"deepspeed\"), use it as it is")
    names = ckpt.files()
    moe = bool(ckpt.files("expert"))
    start = time.perf_counter()
    ckpt.check(verify="full")          # every file: size, sha256, allowed types; before anything is written
    log(f"convert: {ckpt.path}: {len(names)} files verified against {catalog.MANIFEST} "
        f"({time.perf_counter() - start:.1f} s)")
    parent = os.path.dirname(os.path.abspath(out_dir))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".convert-", dir=parent)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)          # mkdtemp's 0700 would become the checkpoint's mode
    source_bytes = written = 0
    try:
        os.makedirs(os.path.join(tmp, ckpt.tag))
        for number, name in enumerate(names, 1):
            target = os.path.join(tmp, ckpt.tag, name)
            os.makedirs(os.path.dirname(target), exist_ok=True)
            state = _as_deepspeed_saves(ckpt.load(name, verify="none"), kind=kind_of(name)[0], moe=moe)
            _save(state, target)
            size, size_in = os.path.getsize(target), os.path.getsize(ckpt.file(name))
            source_bytes, written = source_bytes + size_in, written + size
            log(f"convert: [{number}/{len(names)}] {name}: {size_in / 1e6:,.1f} MB -> {size / 1e6:,.1f} MB")
        for script in RECOVERY_SCRIPTS:
            if os.path.isfile(os.path.join(ckpt_dir, script)):      # DeepSpeed's own copy, as its engine makes it
                import deepspeed
                target = os.path.join(tmp, script)
                shutil.copyfile(os.path.join(os.path.dirname(deepspeed.__file__), "utils", script), target)
                os.chmod(target, os.stat(target).st_mode | stat.S_IEXEC)
        catalog.write_atomic(os.path.join(tmp, catalog.LATEST), ckpt.tag.encode())
        for root, _, _ in os.walk(tmp):
            fsync_directory(root)
        os.replace(tmp, out_dir)       # atomic, onto a missing or empty directory
        fsync_directory(parent)
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(exc, OSError):
            raise CheckpointError(f"converting {ckpt.path} to {out_dir} failed ({exc}); nothing was written to "
                                  f"{out_dir} and the source is untouched: free space or fix the path, then run "
                                  f"again") from None
        raise
    return {"out": out_dir, "tag": ckpt.tag, "files": len(names), "source_bytes": source_bytes, "bytes": written}

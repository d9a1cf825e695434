"""The one way seekspeed reads a checkpoint file, whichever engine wrote it.

A file is either seekspeed's own (``SSCKPT01``, format.py, written by the async-zstd
engine; checked against the checkpoint's manifest.json when the directory has one)
or a DeepSpeed ``torch.save`` file. Both are unpickled with safe_pickle's allow-list,
so loading never runs code from a file: a file that names anything else is refused
with an UnsafeCheckpointError naming the file and the type.

    tag = open_tag("runs/tiny")                     # the tag 'latest' names, or open_tag(DIR, "global_step200")
    tag.files("expert")                             # its files of one kind, by name (see KINDS)
    tag.check()                                     # every file: manifest, and globals (runs nothing)
    state = tag.load("mp_rank_00_model_states.pt")  # verified, restricted
    state = load_file(path, map_location="cpu")     # one file; the manifest beside it is used if there is one

Resume (``engine.load_checkpoint``), transformers export, generation and
launch/convert_checkpoint.py all read through here.
"""

import dataclasses
import io
import os
import pickle
import re
import zipfile

from ds_ext.errors import SeekspeedError
from . import catalog, format as fmt, safe_pickle


class CheckpointError(SeekspeedError):
    """A checkpoint could not be written or read; the message names the file."""


class UnsafeCheckpointError(CheckpointError):
    """A checkpoint file names a type outside the allow-list (it could run code when loaded)."""


def _refused(path, qualname):
    return UnsafeCheckpointError(
        f"{path}: refused to unpickle {qualname}, which no DeepSpeed or seekspeed checkpoint holds: the file "
        f"may be crafted to run code when loaded, and nothing of it was run; do not use this checkpoint (or, for "
        f"a file of your own, see the allow-list in ds_ext/checkpoint/safe_pickle.py)")


# DeepSpeed's file names in a tag directory: kind -> pattern (named groups are indices)
KINDS = {
    "model": re.compile(r"mp_rank_(?P<mp>\d+)_model_states\.pt"),
    "layer": re.compile(r"layer_(?P<layer>\d+)-model(?:_(?P<mp>\d+)-model)?_states\.pt"),
    "expert": re.compile(r"layer_(?P<moe_layer>\d+)_expert_(?P<expert>\d+)_mp_rank_(?P<mp>\d+)_model_states\.pt"),
    "zero": re.compile(r"(?:bf16_)?zero_pp_rank_(?P<dp>\d+)_mp_rank_(?P<mp>\d+)_optim_states\.pt"),
    "expert_optim": re.compile(r"expp_rank_(?P<ep>\d+)_mp_rank_(?P<mp>\d+)_optim_states\.pt"),
}


def kind_of(name):
    """(kind, {index: int}) of a DeepSpeed checkpoint file name; (None, {}) if none fits."""
    for kind, pattern in KINDS.items():
        m = pattern.fullmatch(os.path.basename(name))
        if m:
            return kind, {k: int(v) for k, v in m.groupdict().items() if v is not None}
    return None, {}


def file_format(path):
    """"seekspeed" (SSCKPT01) or "torch" (anything else, for torch.load to judge)."""
    return "seekspeed" if fmt.is_seekspeed_file(path) else "torch"


def file_globals(path):
    """The globals the pickle in ``path`` names, read statically: nothing runs."""
    try:
        if file_format(path) == "seekspeed":
            return safe_pickle.pickle_globals(io.BytesIO(fmt.read_skeleton(path)))
        return safe_pickle.torch_file_globals(path)
    except safe_pickle.UnreadableGlobal as exc:
        raise UnsafeCheckpointError(f"{path}: refused: {exc}, which no DeepSpeed or seekspeed checkpoint holds; "
                                    f"do not use this checkpoint") from None
    except fmt.CorruptCheckpointError as exc:
        raise CheckpointError(f"cannot load checkpoint file {exc}") from None
    except (OSError, EOFError, ValueError, pickle.UnpicklingError, zipfile.BadZipFile) as exc:
        raise CheckpointError(f"{path}: not a checkpoint file ({type(exc).__name__}: {exc}): neither seekspeed's "
                              f"format nor torch.save's") from None


def check_file(path):
    """Raise UnsafeCheckpointError unless every global ``path`` names is allowed."""
    for qualname in sorted(file_globals(path)):
        if qualname not in safe_pickle.ALLOWED:
            raise _refused(path, qualname)


def _manifest_of(directory):
    try:
        return catalog.read_manifest(directory)
    except fmt.CorruptCheckpointError as exc:
        raise CheckpointError(f"{exc}: the checkpoint cannot be verified") from None


def _verify(path, manifest, verify):
    """Check ``path`` against the manifest of its directory: listed, right size (and checksum)."""
    if manifest is None or verify == "none":
        return
    entry = manifest["files"].get(os.path.basename(path))
    if entry is None:
        raise CheckpointError(f"{path}: not listed in the checkpoint's {catalog.MANIFEST}, so not part of the "
                              f"committed checkpoint: remove it or load another checkpoint")
    try:
        fmt.verify(path, size=entry["size"], sha256=entry["sha256"] if verify == "full" else None)
    except fmt.CorruptCheckpointError as exc:
        raise CheckpointError(f"cannot load checkpoint file {exc}") from None


def load_file(path, *, map_location="cpu", manifest=None, verify="full"):
    """The object stored in checkpoint file ``path``, whichever engine wrote it.

    ``manifest``: the manifest of the directory holding ``path`` (catalog.read_manifest),
    read from there when None; a file in a directory with a manifest must be listed in it
    and match it (``verify``: "full" size and sha256, "size", or "none" when the caller
    has just verified it). Unpickling uses safe_pickle's allow-list: a file naming any
    other type raises UnsafeCheckpointError, and nothing of it runs."""
    if manifest is None:
        manifest = _manifest_of(os.path.dirname(os.path.abspath(path)))
    _verify(path, manifest, verify)
    try:
        if file_format(path) == "seekspeed":
            return fmt.read(path, map_location=map_location)
        return safe_pickle.torch_load(path, map_location=map_location)
    except safe_pickle.RefusedGlobal as exc:
        raise _refused(path, exc.qualname) from None
    except fmt.CorruptCheckpointError as exc:
        raise CheckpointError(f"cannot load checkpoint file {exc}") from None
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing: the checkpoint is incomplete") from None
    except (EOFError, pickle.UnpicklingError, RuntimeError, zipfile.BadZipFile) as exc:
        raise CheckpointError(f"{path}: not a checkpoint file ({type(exc).__name__}: {exc}): neither seekspeed's "
                              f"format nor torch.save's") from None


@dataclasses.dataclass
class Tag:
    """One checkpoint: ``path`` is ``ckpt_dir/tag``; ``manifest`` is None for DeepSpeed's
    own format (no manifest.json)."""
    ckpt_dir: str
    tag: str
    path: str
    manifest: dict | None

    @property
    def kind(self):
        return "seekspeed" if self.manifest is not None else "deepspeed"

    def files(self, kind=None):
        """Its checkpoint files, by name relative to ``path``, sorted: the manifest's list,
        or (DeepSpeed's format) every ``*.pt`` in the directory. ``kind``: only those of
        one kind of KINDS."""
        if self.manifest is not None:
            names = sorted(self.manifest["files"])
        else:
            names = sorted(n for n in os.listdir(self.path) if n.endswith(".pt"))
        return [n for n in names if kind is None or kind_of(n)[0] == kind]

    def file(self, name):
        return os.path.join(self.path, name)

    def load(self, name, *, map_location="cpu", verify="full"):
        return load_file(self.file(name), map_location=map_location, manifest=self.manifest, verify=verify)

    def check(self, names=None, *, verify="size"):
        """Every file (or ``names``) against the manifest (``verify``), and the globals each
        names against the allow-list, statically: the first problem raises, naming the file."""
        for name in self.files() if names is None else names:
            _verify(self.file(name), self.manifest, verify)
            check_file(self.file(name))


def open_tag(ckpt_dir, tag=None):
    """The checkpoint ``tag`` of ``ckpt_dir`` (None or "latest": the one its 'latest' names)."""
    if not os.path.isdir(ckpt_dir):
        raise CheckpointError(f"checkpoint directory {ckpt_dir} does not exist")
    if tag in (None, "latest"):
        tag = catalog.read_latest(ckpt_dir)
        if tag is None:
            tags = sorted(d for d in os.listdir(ckpt_dir) if os.path.isdir(os.path.join(ckpt_dir, d))
                          and not d.startswith("."))
            raise CheckpointError(f"{ckpt_dir} has no 'latest' file: pass a tag (--tag; one of {tags or 'none'})")
    path = os.path.join(ckpt_dir, tag)
    if not os.path.isdir(path):
        raise CheckpointError(f"checkpoint {path} does not exist")
    return Tag(ckpt_dir=ckpt_dir, tag=tag, path=path, manifest=_manifest_of(path))

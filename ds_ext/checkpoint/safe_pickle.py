"""Unpickling that never runs code from a checkpoint file.

A pickle may name any importable function and call it while it is read: that is how a
crafted checkpoint runs a shell command when ``torch.load(weights_only=False)`` opens
it. The only way a pickle reaches a function or class is the unpickler's
``find_class``; this module's ``Unpickler`` answers it only for the names in
``ALLOWED``, the types that DeepSpeed's and seekspeed's checkpoints hold, and refuses
anything else before importing it. Every allowed name is harmless whatever arguments
a file passes it (a container, a shape, an enum, a plain record, torch's tensor
rebuild): none runs code chosen by the file.

The list was found by loading real checkpoints of both engines (dense and MoE with
expert parallelism, ZeRO 0 and 1, fp32 and bf16): ``python benchmarks/checkpoint_globals.py``
trains each case, then lists every global its files name and what torch's
``weights_only=True`` loader refuses among them.

``globals_in`` lists the globals a pickle names without running it (a static pass
over its opcodes); loaders use it to refuse a bad checkpoint before any rank starts
reading it. It is a pre-check only: ``Unpickler`` is what enforces the list.
"""

import io
import pickle
import pickletools
import sys
import zipfile

import _compat_pickle

# name -> what holds it. Found in real checkpoints (benchmarks/checkpoint_globals.py): the first
# six. Read from DeepSpeed's source, since DeepSpeed refuses fp16 on CPU: the last two, what
# CreateLossScaler builds for fp16 with dynamic scaling (its dtype is torch.float16).
ALLOWED = {
    "collections.OrderedDict": "module and optimizer state dicts; DeepSpeed's param_shapes",
    "torch.Size": "param_shapes in the model-states files",
    "torch._utils._rebuild_tensor_v2": "every tensor of a torch.save file (a view of a storage torch.load made; "
                                       "seekspeed's own files keep tensors outside the pickle)",
    "deepspeed.runtime.zero.config.ZeroStageEnum": "ZeRO optimizer states: zero_stage",
    "deepspeed.runtime.fp16.loss_scaler.LossScaler": "ZeRO optimizer states: loss_scaler (fp32 and bf16)",
    "deepspeed.utils.tensor_fragment.fragment_address": "param_slice_mappings of ZeRO and bf16 optimizer states",
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler": "ZeRO optimizer states: loss_scaler (fp16)",
    "torch.float16": "DynamicLossScaler.dtype (fp16)",
}


class RefusedGlobal(pickle.UnpicklingError):
    """A pickle names a function or class that is not in ALLOWED."""

    def __init__(self, qualname):
        self.qualname = qualname
        super().__init__(f"refused to unpickle {qualname}: not a type DeepSpeed's or seekspeed's checkpoints hold")


def qualname(module, name):
    """``module.name`` as Python 3 reads it (protocol 2 pickles spell builtins ``__builtin__``)."""
    if (module, name) in _compat_pickle.NAME_MAPPING:
        module, name = _compat_pickle.NAME_MAPPING[(module, name)]
    elif module in _compat_pickle.IMPORT_MAPPING:
        module = _compat_pickle.IMPORT_MAPPING[module]
    return f"{module}.{name}"


class Unpickler(pickle.Unpickler):
    """pickle.Unpickler whose find_class returns only ALLOWED names."""

    def find_class(self, module, name):
        full = qualname(module, name)
        if full not in ALLOWED:
            raise RefusedGlobal(full)
        return super().find_class(module, name)


def load(file, **kwargs):
    """pickle.load through ``Unpickler``."""
    return Unpickler(file, **kwargs).load()


def torch_load(path, *, map_location=None):
    """torch.load of a torch.save file through ``Unpickler``: torch builds the tensors
    from their storages (its own storage types never reach find_class), the pickle
    gets nothing outside ALLOWED. Raises RefusedGlobal."""
    import torch
    return torch.load(path, map_location=map_location, weights_only=False, pickle_module=sys.modules[__name__])


# -- static listing ----------------------------------------------------------------------------

_STRINGS = {"SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8", "UNICODE", "SHORT_BINSTRING", "BINSTRING", "STRING"}
_GETS = {"GET", "BINGET", "LONG_BINGET"}
_PUTS = {"PUT", "BINPUT", "LONG_BINPUT"}


class UnreadableGlobal(pickle.UnpicklingError):
    """A STACK_GLOBAL whose module and name are not two strings pushed just before it."""


def pickle_globals(stream):
    """The qualified names of the globals one pickle in ``stream`` names (read up to its
    STOP). STACK_GLOBAL takes its names from the stack: a pickler pushes them (or gets
    them from the memo) just before it; any other construction raises
    UnreadableGlobal, since what it names cannot be told without running it."""
    found = set()
    memo, recent = {}, []          # recent: the values the last ops pushed, while they are strings
    for op, arg, _ in pickletools.genops(stream):
        name = op.name
        if name in _STRINGS:
            value = arg.decode("latin-1") if isinstance(arg, bytes) else arg
            recent.append(value)
            continue
        if name in _GETS:
            value = memo.get(arg)
            recent = recent + [value] if isinstance(value, str) else []
            continue
        if name in ("FRAME", "PROTO"):
            continue                   # framing: no effect on the stack (a frame may end between two pushes)
        if name == "MEMOIZE" or name in _PUTS:
            if recent:
                memo[len(memo) if name == "MEMOIZE" else arg] = recent[-1]
            else:
                memo.pop(len(memo) if name == "MEMOIZE" else arg, None)
                if name == "MEMOIZE":
                    memo[len(memo)] = None     # the slot exists, holding something not a string
            continue
        if name in ("GLOBAL", "INST"):
            module, _, attr = arg.partition(" ")
            found.add(qualname(module, attr))
        elif name == "STACK_GLOBAL":
            if len(recent) < 2:
                raise UnreadableGlobal("a STACK_GLOBAL whose module and name are computed")
            found.add(qualname(recent[-2], recent[-1]))
        elif name in ("EXT1", "EXT2", "EXT4"):
            raise UnreadableGlobal(f"an extension-registry global ({name} {arg})")
        recent = []
        if name == "STOP":
            break
    return found


def torch_file_globals(path):
    """Every global a torch.save file names (zip format: its data.pkl; legacy format:
    its header pickles and the object pickle). Runs nothing from the file."""
    if zipfile.is_zipfile(path):
        with zipfile.ZipFile(path) as z:
            records = [n for n in z.namelist() if n == "data.pkl" or n.endswith("/data.pkl")]
            if len(records) != 1:
                raise pickle.UnpicklingError(f"a zip archive with {len(records)} data.pkl records, not a torch.save "
                                             f"file")
            found = pickle_globals(io.BytesIO(z.read(records[0])))
    else:
        found = set()
        with open(path, "rb") as f:
            for _ in range(5):       # magic number, protocol version, system info, the object, its storage keys
                found |= pickle_globals(f)
    return {g for g in found if not _torch_storage_type(g)}


def _torch_storage_type(full):
    """torch.load resolves a global whose name holds "Storage" to its own storage type
    record when it knows the name (torch.FloatStorage...), without find_class."""
    from torch.serialization import StorageType
    name = full.rpartition(".")[2]
    if "Storage" not in name:
        return False
    try:
        StorageType(name)
    except KeyError:
        return False
    return True

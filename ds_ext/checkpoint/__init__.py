"""Asynchronous zstd checkpoints that are committed whole or not at all, and the one
loader every reader of a checkpoint goes through.

``engine.AsyncCheckpointEngine`` is a DeepSpeed CheckpointEngine (chosen by
``seekspeed.checkpoint.engine: "async-zstd"``), ``engine.RestrictedTorchCheckpointEngine``
DeepSpeed's own (``"deepspeed"``) with restricted loading; ``catalog`` knows what a
checkpoint directory holds and which checkpoint is the newest complete one; ``format``
is the file format (snapshot, byte grouping, zstd, sha256); ``load`` reads a file of
either format (``load_file``, ``open_tag``), unpickling only the types ``safe_pickle``
allows.
"""

from .catalog import Checkpoint, list_checkpoints, newest_complete
from .format import CorruptCheckpointError
from .load import CheckpointError, Tag, UnsafeCheckpointError, load_file, open_tag
from .engine import AsyncCheckpointEngine, RestrictedTorchCheckpointEngine

__all__ = ["AsyncCheckpointEngine", "Checkpoint", "CheckpointError", "CorruptCheckpointError",
           "RestrictedTorchCheckpointEngine", "Tag", "UnsafeCheckpointError", "list_checkpoints", "load_file",
           "newest_complete", "open_tag"]

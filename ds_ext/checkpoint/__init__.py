"""Asynchronous zstd checkpoints that are committed whole or not at all.

``engine.AsyncCheckpointEngine`` is a DeepSpeed CheckpointEngine (chosen by
``seekspeed.checkpoint.engine: "async-zstd"``); ``catalog`` knows what a checkpoint
directory holds and which checkpoint is the newest complete one; ``format`` is the
file format (snapshot, byte grouping, zstd, sha256).
"""

from .catalog import Checkpoint, list_checkpoints, newest_complete
from .engine import AsyncCheckpointEngine, CheckpointError
from .format import CorruptCheckpointError

__all__ = ["AsyncCheckpointEngine", "Checkpoint", "CheckpointError", "CorruptCheckpointError", "list_checkpoints",
           "newest_complete"]

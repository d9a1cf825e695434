"""Data: Hugging Face datasets from local files (or the offline stdlib demo corpus),
byte-level or local transformers tokenizer, packing into fixed-length sequences.
``data.pipeline: memory`` tokenises one share per data-parallel rank into RAM
(packing.py); ``tiered`` builds packed shards on disk once, in parts that any number
of tasks can pack (parts.py, store.py, prepare.py), walks one global order (order.py)
and reads through hot/cold tiers (tiers.py). Megatron indexed datasets (megatron.py)
are packed without tokenising again."""

from .sources import load_documents, resolve_source, stdlib_corpus
from .tokenizer import ByteTokenizer, load_tokenizer

__all__ = ["PackedBatches", "packed_sequences", "load_documents", "resolve_source", "stdlib_corpus",
           "ByteTokenizer", "load_tokenizer"]


def __getattr__(name):
    # packing.py needs torch; the packing tasks of a build (prepare.py) import this package without it
    if name in ("PackedBatches", "packed_sequences"):
        from . import packing
        return getattr(packing, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

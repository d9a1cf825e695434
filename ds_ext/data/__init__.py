"""Data: Hugging Face datasets from local files (or the offline stdlib demo corpus),
byte-level or local transformers tokenizer, packing into fixed-length sequences.
``data.pipeline: memory`` tokenises one share per data-parallel rank into RAM
(packing.py); ``tiered`` builds packed shards on disk once (store.py), walks one
global order (order.py) and reads through hot/cold tiers (tiers.py)."""

from .packing import PackedBatches, packed_sequences
from .sources import load_documents, resolve_source, stdlib_corpus
from .tokenizer import ByteTokenizer, load_tokenizer

__all__ = ["PackedBatches", "packed_sequences", "load_documents", "resolve_source", "stdlib_corpus",
           "ByteTokenizer", "load_tokenizer"]

"""Minimal data path: Hugging Face datasets from local files (or the offline stdlib
demo corpus), byte-level or local transformers tokenizer, packing into fixed-length
sequences, one shard per data-parallel rank. The tiered pipeline is a later issue."""

from .packing import PackedBatches, packed_sequences
from .sources import load_documents, resolve_source, stdlib_corpus
from .tokenizer import ByteTokenizer, load_tokenizer

__all__ = ["PackedBatches", "packed_sequences", "load_documents", "resolve_source", "stdlib_corpus",
           "ByteTokenizer", "load_tokenizer"]

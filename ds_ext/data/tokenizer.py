"""Tokenizers: a dependency-free byte-level one (the default) and any local
transformers tokenizer by path. Both append an end-of-document token."""

import os

import numpy as np

from ds_ext.errors import ConfigError, DataError


class ByteTokenizer:
    """UTF-8 bytes as ids 0-255; id 256 ends a document."""

    name = "byte"
    vocab_size = 257
    eos_token_id = 256

    def encode_documents(self, texts):
        return [np.frombuffer(t.encode("utf-8", errors="replace"), dtype=np.uint8).astype(np.int32).tolist() +
                [self.eos_token_id] for t in texts]

    def decode(self, ids):
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


class LocalHFTokenizer:
    """A transformers tokenizer from a local directory (never downloaded)."""

    def __init__(self, path):
        from transformers import AutoTokenizer
        try:
            self.tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
        except Exception as exc:  # transformers raises several types for a bad directory
            raise ConfigError(f"seekspeed.data.tokenizer: cannot load a tokenizer from {path} "
                              f"({type(exc).__name__}: {str(exc).splitlines()[0]}); "
                              f"point it at a directory with tokenizer.json / tokenizer_config.json") from None
        if self.tok.eos_token_id is None:
            raise ConfigError(f"seekspeed.data.tokenizer: the tokenizer at {path} has no eos_token; "
                              f"set one in its tokenizer_config.json (documents are separated by it)")
        self.name = os.path.abspath(path)
        self.vocab_size = len(self.tok)
        self.eos_token_id = self.tok.eos_token_id

    def encode_documents(self, texts):
        ids = self.tok(list(texts), add_special_tokens=False)["input_ids"]
        return [list(x) + [self.eos_token_id] for x in ids]

    def decode(self, ids):
        return self.tok.decode(ids)


def load_tokenizer(spec, *, vocab_size):
    """The tokenizer named by ``seekspeed.data.tokenizer``, checked against the model's vocabulary."""
    if spec == "byte":
        tok = ByteTokenizer()
    elif os.path.isdir(spec):
        tok = LocalHFTokenizer(spec)
    else:
        raise ConfigError(f"seekspeed.data.tokenizer {spec!r} is neither 'byte' nor an existing local directory")
    if tok.vocab_size > vocab_size:
        raise ConfigError(f"tokenizer {tok.name} has {tok.vocab_size} ids but the model's vocab_size is "
                          f"{vocab_size}: set seekspeed.recipe.overrides.vocab_size >= {tok.vocab_size}")
    return tok


def _check_ids(ids, vocab_size):
    if ids.size and int(ids.max()) >= vocab_size:
        raise DataError(f"token id {int(ids.max())} >= vocab_size {vocab_size}: the tokenizer and the model disagree")

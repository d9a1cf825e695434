"""Packed token shards on disk: tokenise a corpus once, pack it into rows of
``seq_len + 1`` tokens (an end-of-document token after every document), and write
the rows as numpy shards of ``rows_per_shard`` rows plus an ``index.json``.

    <root>/<key>/index.json          what was built, from what, and every shard's rows/bytes
    <root>/<key>/shard_00000.npy     memory-mappable (np.load(mmap_mode="r"))

``key`` hashes everything the rows depend on (the source files' names, sizes and
modification times, format, text field, document limit, encoding_errors, tokenizer,
vocabulary, row length, shard size): a cache built with other settings is a
different directory and is never reused. A build goes to a temporary directory
renamed into place at the end, so a failed or interrupted build never leaves a half
cache that looks complete, and never touches a cache already in place (one whose
index disagrees is replaced only once its rebuild is complete). ``index.json`` also
counts the documents whose undecodable bytes were replaced or that were skipped.
"""

import hashlib
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np

from ds_ext.errors import DataError

from .sources import load_documents, resolve_source, stdlib_corpus
from .textfiles import describe_undecodable, undecodable_counts

FORMAT_VERSION = 1
INDEX = "index.json"


def _fingerprint(path):
    if path is None:
        return None
    path = Path(path)
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    return [(str(p.relative_to(path) if path.is_dir() else p.name), p.stat().st_size, p.stat().st_mtime_ns)
            for p in files]


def cache_key(data, tokenizer, *, rows_per_shard):
    """The settings a packed cache depends on, and their hash (its directory name)."""
    fmt, path = resolve_source(data)
    if path is None:                               # the demo corpus: its own file
        path = stdlib_corpus()
    if fmt == "hub":
        from .sources import hub_revision
        source, files = path, hub_revision(path)
    else:
        source, files = str(Path(path).resolve()), _fingerprint(path)
    settings = {"version": FORMAT_VERSION, "source": source, "files": files,
                "format": fmt, "text_field": data.text_field, "max_documents": data.max_documents,
                "encoding_errors": data.encoding_errors,
                "tokenizer": tokenizer.name, "vocab_size": tokenizer.vocab_size, "eos": tokenizer.eos_token_id,
                "row_len": data.seq_len + 1, "rows_per_shard": rows_per_shard}
    digest = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]
    return settings, digest


def token_dtype(vocab_size):
    return np.uint16 if vocab_size <= np.iinfo(np.uint16).max + 1 else np.int32


class PackedStore:
    """A built cache: ``index`` (the parsed index.json) and where its shards live."""

    def __init__(self, root, index):
        self.root, self.index = str(root), index
        self.rows_per_shard = index["rows_per_shard"]
        self.row_len = index["row_len"]
        self.dtype = np.dtype(index["dtype"])
        self.shards = index["shards"]
        self.num_rows = index["rows"]

    def shard_of(self, row):
        return row // self.rows_per_shard

    def shard_bytes(self, shard):
        return self.shards[shard]["bytes"]

    def shard_name(self, shard):
        return self.shards[shard]["name"]


def open_store(directory, *, settings=None):
    """The cache in ``directory``; None when it is missing or was built with other
    settings than ``settings`` (then it is rebuilt, never reused)."""
    path = os.path.join(directory, INDEX)
    try:
        with open(path) as f:
            index = json.load(f)
    except (OSError, ValueError):
        return None
    if settings is not None and index.get("settings") != json.loads(json.dumps(settings)):
        return None
    return PackedStore(directory, index)


def build(data, tokenizer, *, root, rows_per_shard, log=print):
    """Build (or find) the packed cache for ``data`` under ``root``; returns its PackedStore."""
    settings, key = cache_key(data, tokenizer, rows_per_shard=rows_per_shard)
    final = os.path.join(root, key)
    store = open_store(final, settings=settings)
    if store is not None:
        return store
    stale = os.path.exists(final)                   # other settings or an unreadable index: never reused
    if stale:
        log(f"data: {final} does not match the current settings; rebuilding it")
    os.makedirs(root, exist_ok=True)
    tmp = tempfile.mkdtemp(dir=root, prefix=f".building-{key}-")
    old = None
    try:
        index = _write_shards(data, tokenizer, settings=settings, directory=tmp, rows_per_shard=rows_per_shard,
                              log=log)
        with open(os.path.join(tmp, INDEX), "w") as f:
            json.dump(index, f, indent=1)
        if stale:                                   # set aside only now that its replacement is complete
            old = tempfile.mkdtemp(dir=root, prefix=f".stale-{key}-")
            os.rename(final, os.path.join(old, key))
        os.rename(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if old is not None and not os.path.exists(final):
            os.rename(os.path.join(old, key), final)
        raise
    finally:
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    return PackedStore(final, index)


def _write_shards(data, tokenizer, *, settings, directory, rows_per_shard, log):
    start = time.perf_counter()
    ds, field = load_documents(data)
    replaced, skipped = undecodable_counts(ds)
    ds = ds.filter(lambda batch: [isinstance(t, str) and bool(t) for t in batch[field]], batched=True)
    if data.max_documents is not None:
        ds = ds.select(range(min(data.max_documents, len(ds))))
    if len(ds) == 0:
        raise DataError(f"the corpus {data.source} has no non-empty documents in column {field!r}: add data or "
                        f"fix seekspeed.data.text_field")
    tokens = ds.map(lambda batch: {"input_ids": tokenizer.encode_documents(batch[field])}, batched=True,
                    num_proc=data.num_proc if data.num_proc > 1 else None, remove_columns=ds.column_names)
    row_len = data.seq_len + 1
    dtype = token_dtype(tokenizer.vocab_size)
    per_shard = rows_per_shard * row_len
    pending, pending_len = [], 0
    shards, total_tokens, documents = [], 0, 0
    last_report = time.perf_counter()

    def emit(flat):
        name = f"shard_{len(shards):05d}.npy"
        rows = flat.reshape(-1, row_len)
        np.save(os.path.join(directory, name), rows)
        shards.append({"name": name, "rows": len(rows), "bytes": os.path.getsize(os.path.join(directory, name))})

    for batch in tokens.iter(batch_size=1000):
        for ids in batch["input_ids"]:
            arr = np.asarray(ids, dtype=np.int64)
            if arr.size and (arr.max() >= tokenizer.vocab_size or arr.min() < 0):
                raise DataError(f"token id {int(arr.max())} >= vocab_size {tokenizer.vocab_size}: the tokenizer and "
                                f"the model disagree")
            pending.append(arr.astype(dtype))
            pending_len += arr.size
            documents += 1
        while pending_len >= per_shard:
            flat = np.concatenate(pending)
            emit(flat[:per_shard])
            rest = flat[per_shard:]
            pending, pending_len = [rest], rest.size
            total_tokens += per_shard
        if time.perf_counter() - last_report > 10:
            last_report = time.perf_counter()
            log(f"data: packing {documents:,} documents so far, {len(shards)} shards, "
                f"{(total_tokens + pending_len) / (time.perf_counter() - start):,.0f} tokens/s")
    if pending_len >= row_len:                       # a last, shorter shard of whole rows
        flat = np.concatenate(pending)
        whole = flat.size // row_len * row_len
        emit(flat[:whole])
        total_tokens += whole
    if not shards:
        raise DataError(f"the corpus {data.source} has {pending_len} tokens, fewer than one sequence of seq_len + 1 "
                        f"= {row_len}: add data or lower seekspeed.data.seq_len")
    elapsed = time.perf_counter() - start
    rows = sum(s["rows"] for s in shards)
    undecodable = describe_undecodable(replaced, skipped)
    log(f"data: packed {documents:,} documents into {rows:,} rows of {row_len} tokens in {len(shards)} shards "
        f"({elapsed:.1f} s, {total_tokens / max(elapsed, 1e-9):,.0f} tokens/s){'; ' + undecodable if undecodable else ''}")
    return {"settings": settings, "rows": rows, "row_len": row_len, "dtype": np.dtype(dtype).name,
            "rows_per_shard": rows_per_shard, "shards": shards, "documents": documents, "tokens": total_tokens,
            "replaced_documents": replaced, "skipped_documents": skipped, "build_s": elapsed}


class ShardSet:
    """The shards of one or more packed stores under one cache ``root``, numbered
    globally (store by store); names are relative to ``root``. ``weights`` and
    ``source_of_shard`` describe a mixture (one store: weight 1)."""

    def __init__(self, root, stores, weights):
        if len({(s.row_len, s.dtype) for s in stores}) != 1:
            raise DataError("the sources of data.mixture were packed with different row lengths or token types")
        self.root, self.stores, self.weights = str(root), stores, list(weights)
        self.row_len, self.dtype = stores[0].row_len, stores[0].dtype
        self.shards, self.source_of_shard = [], []
        for i, store in enumerate(stores):
            rel = os.path.relpath(store.root, self.root)
            for sh in store.shards:
                self.shards.append({"name": f"{rel}/{sh['name']}", "rows": sh["rows"], "bytes": sh["bytes"]})
                self.source_of_shard.append(i)
        self.num_rows = sum(sh["rows"] for sh in self.shards)
        self.index = {name: sum(s.index.get(name, 0) for s in stores)
                      for name in ("documents", "tokens", "replaced_documents", "skipped_documents")}

    def shard_bytes(self, shard):
        return self.shards[shard]["bytes"]

    def shard_name(self, shard):
        return self.shards[shard]["name"]


def build_all(data, tokenizer, *, root, rows_per_shard, log=print):
    """Every source of ``data`` (one, or the mixture's) built or found under ``root``."""
    stores, weights = [], []
    for section, weight in data.sources():
        stores.append(build(section, tokenizer, root=root, rows_per_shard=rows_per_shard, log=log))
        weights.append(weight)
    return ShardSet(root, stores, weights)


def open_all(data, tokenizer, *, root, rows_per_shard):
    """The ShardSet rank 0 built, or None when any store is missing or stale."""
    stores, weights = [], []
    for section, weight in data.sources():
        settings, key = cache_key(section, tokenizer, rows_per_shard=rows_per_shard)
        store = open_store(os.path.join(root, key), settings=settings)
        if store is None:
            return None
        stores.append(store)
        weights.append(weight)
    return ShardSet(root, stores, weights)

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

import contextlib
import glob
import hashlib
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np

from ds_ext.errors import DataError
from ds_ext.fileio import atomic_write

from .sources import resolve_source, stdlib_corpus
from .textfiles import describe_undecodable

FORMAT_VERSION = 2
INDEX = "index.json"
PLAN = "plan.json"
PART = "part.json"


def _fingerprint(path, fmt):
    if path is None:
        return None
    path = Path(path)
    if fmt == "megatron":                           # every prefix's .bin and .idx
        from .megatron import megatron_prefixes
        files = [Path(prefix + ext) for prefix in megatron_prefixes(path) for ext in (".bin", ".idx")]
        return [(str(p), p.stat().st_size, p.stat().st_mtime_ns) for p in files]
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
        source, files = str(Path(path).resolve()), _fingerprint(path, fmt)
    settings = {"version": FORMAT_VERSION, "source": source, "files": files,
                "format": fmt, "text_field": data.text_field, "max_documents": data.max_documents,
                "encoding_errors": data.encoding_errors,
                "tokenizer": tokenizer.name, "vocab_size": tokenizer.vocab_size, "eos": tokenizer.eos_token_id,
                "row_len": data.seq_len + 1, "rows_per_shard": rows_per_shard, "part_mb": data.part_mb}
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
    index = _read_json(os.path.join(directory, INDEX))
    if index is None:
        return None
    if settings is not None and index.get("settings") != json.loads(json.dumps(settings)):
        return None
    return PackedStore(directory, index)


def _read_json(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


class BuildPlan:
    """One source's build: its settings and key, the parts it is cut into, and the
    directory the parts are packed into (``<root>/.building-<key>``; kept across
    interrupted runs, so a rerun packs only the parts that are missing)."""

    def __init__(self, data, tokenizer, *, root, rows_per_shard):
        from .parts import plan_parts
        self.data, self.root, self.rows_per_shard = data, str(root), rows_per_shard
        self.settings, self.key = cache_key(data, tokenizer, rows_per_shard=rows_per_shard)
        self.final = os.path.join(self.root, self.key)
        self.directory = os.path.join(self.root, f".building-{self.key}")
        self.row_len = data.seq_len + 1
        self.dtype = np.dtype(token_dtype(tokenizer.vocab_size)).name
        self.done = open_store(self.final, settings=self.settings)
        self.format = self.parts = None
        if self.done is None:
            self.format, self.parts = plan_parts(data)

    def write(self):
        """Create the build directory with plan.json (the parts), unless one is there."""
        os.makedirs(self.directory, exist_ok=True)
        plan = {"settings": self.settings, "format": self.format, "parts": self.parts}
        old = _read_json(os.path.join(self.directory, PLAN))
        if old is not None and old == json.loads(json.dumps(plan)):
            return
        if old is not None:                         # another cut (part_mb changed the key anyway): start over
            shutil.rmtree(os.path.join(self.directory, "parts"), ignore_errors=True)
        atomic_write(os.path.join(self.directory, PLAN), json.dumps(plan, indent=1))

    def part_dir(self, i):
        return os.path.join(self.directory, "parts", f"part_{i:06d}")

    def missing(self):
        """Indices of the parts not yet packed."""
        return [i for i in range(len(self.parts)) if not os.path.exists(os.path.join(self.part_dir(i), PART))]

    @contextlib.contextmanager
    def removed_on_bad_input(self):
        """Remove the build directory when the input is at fault (a DataError): fixing the
        input changes the key, so nothing there would be resumed; any other failure
        (a killed task, a full disk) leaves the packed parts for a rerun."""
        try:
            yield
        except DataError:
            shutil.rmtree(self.directory, ignore_errors=True)
            raise

    def record_error(self, rank, exc):
        """Keep the bad-input error of task ``rank`` for the driver (``raise_task_errors``)."""
        os.makedirs(os.path.join(self.directory, "errors"), exist_ok=True)
        atomic_write(os.path.join(self.directory, "errors", f"task_{rank:05d}.txt"), str(exc))

    def raise_task_errors(self):
        """The first task's bad-input error as a DataError, if any task recorded one."""
        folder = os.path.join(self.directory, "errors")
        names = sorted(os.listdir(folder)) if os.path.isdir(folder) else []
        if names:
            with open(os.path.join(folder, names[0])) as f:
                message = f.read()
            more = f" (and {len(names) - 1} more task{'s' * (len(names) > 2)} stopped)" if len(names) > 1 else ""
            raise DataError(message + more)

    def tasks_of(self, rank, world_size):
        """The parts task ``rank`` of ``world_size`` packs (every world_size-th)."""
        return list(range(rank, len(self.parts), world_size))


def run_task(plan, tokenizer, *, rank, world_size, log=print):
    """Pack the parts of task ``rank`` that are not packed yet."""
    mine = plan.tasks_of(rank, world_size)
    missing = set(plan.missing())
    todo = [i for i in mine if i in missing]
    if len(todo) < len(mine):
        log(f"data: task {rank}/{world_size}: {len(mine) - len(todo)} of its {len(mine)} parts already packed")
    for n, i in enumerate(todo):
        for stale in glob.glob(os.path.join(plan.directory, "parts", f".part_{i:06d}-*")):     # a died task's
            shutil.rmtree(stale, ignore_errors=True)
        manifest = pack_part(plan, tokenizer, i)
        log(f"data: task {rank}/{world_size}: part {i} ({n + 1}/{len(todo)}) packed: {manifest['rows']:,} rows, "
            f"{manifest['documents']:,} documents, {manifest['tokens'] / max(manifest['build_s'], 1e-9):,.0f} tokens/s")


def pack_part(plan, tokenizer, i):
    """Pack part ``i`` into its directory: shards of whole rows (the part's last shard
    may be shorter, the tokens after its last whole row are dropped) and part.json;
    written to a temporary directory renamed into place."""
    from .parts import documents
    start = time.perf_counter()
    parts_dir = os.path.join(plan.directory, "parts")
    os.makedirs(parts_dir, exist_ok=True)
    tmp = tempfile.mkdtemp(dir=parts_dir, prefix=f".part_{i:06d}-")
    final = plan.part_dir(i)
    rel = os.path.relpath(final, plan.directory)
    row_len, dtype, vocab = plan.row_len, np.dtype(plan.dtype), tokenizer.vocab_size
    per_shard = plan.rows_per_shard * row_len
    pending, pending_len = [], 0
    shards, counts, docs, tokens = [], {}, 0, 0

    def emit(flat):
        name = f"shard_{len(shards):04d}.npy"
        np.save(os.path.join(tmp, name), flat.reshape(-1, row_len))
        shards.append({"name": f"{rel}/{name}", "rows": flat.size // row_len,
                       "bytes": os.path.getsize(os.path.join(tmp, name))})

    try:
        for batch in documents(plan.data, plan.format, plan.parts[i], tokenizer, counts):
            top = max(int(d.max()) for d in batch)
            if top >= vocab or min(int(d.min()) for d in batch) < 0:
                raise DataError(f"token id {top} >= vocab_size {vocab}: the tokenizer and the model disagree")
            pending.extend(d.astype(dtype) for d in batch)
            pending_len += sum(d.size for d in batch)
            docs += len(batch)
            while pending_len >= per_shard:
                flat = np.concatenate(pending)
                emit(flat[:per_shard])
                rest = flat[per_shard:]
                pending, pending_len = [rest], rest.size
                tokens += per_shard
        whole = pending_len // row_len * row_len
        if whole:                                   # a last, shorter shard of whole rows
            emit(np.concatenate(pending)[:whole])
            tokens += whole
        manifest = {"index": i, "shards": shards, "rows": sum(sh["rows"] for sh in shards), "documents": docs,
                    "tokens": tokens, "dropped_tokens": pending_len - whole, "replaced": counts.get("replaced", 0),
                    "skipped": counts.get("skipped", 0), "build_s": time.perf_counter() - start}
        with open(os.path.join(tmp, PART), "w") as f:
            json.dump(manifest, f)
        try:
            os.rename(tmp, final)
        except OSError:                             # packed meanwhile by another builder: same rows
            if not os.path.exists(os.path.join(final, PART)):
                raise
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return manifest


def finish(plan, *, log=print):
    """Write index.json once every part is packed and rename the build into place
    (replacing a stale cache only now that its rebuild is complete)."""
    plan.raise_task_errors()
    missing = plan.missing()
    if missing:
        raise DataError(f"{plan.directory}: {len(missing)} of {len(plan.parts)} parts are not packed yet "
                        f"(parts {_ranges(missing)}): run the remaining tasks again (a rerun packs only those)")
    manifests = [_read_json(os.path.join(plan.part_dir(i), PART)) for i in range(len(plan.parts))]
    shards = [sh for m in manifests for sh in m["shards"]]
    documents = sum(m["documents"] for m in manifests)
    if documents == 0:
        raise DataError(f"the corpus {plan.data.source} has no non-empty documents in column "
                        f"{plan.data.text_field!r}: add data or fix seekspeed.data.text_field")
    if not shards:
        dropped = sum(m["dropped_tokens"] for m in manifests)
        raise DataError(f"the corpus {plan.data.source} has {dropped} tokens, fewer than one sequence of seq_len + 1 "
                        f"= {plan.row_len} in any part: add data or lower seekspeed.data.seq_len")
    index = {"settings": plan.settings, "rows": sum(sh["rows"] for sh in shards), "row_len": plan.row_len,
             "dtype": plan.dtype, "rows_per_shard": plan.rows_per_shard, "shards": shards,
             "parts": len(manifests), "documents": documents, "tokens": sum(m["tokens"] for m in manifests),
             "dropped_tokens": sum(m["dropped_tokens"] for m in manifests),
             "replaced_documents": sum(m["replaced"] for m in manifests),
             "skipped_documents": sum(m["skipped"] for m in manifests),
             "build_s": sum(m["build_s"] for m in manifests)}
    atomic_write(os.path.join(plan.directory, INDEX), json.dumps(index, indent=1))
    old = None
    try:
        if os.path.exists(plan.final):
            if open_store(plan.final, settings=plan.settings) is not None:     # finished by another builder
                shutil.rmtree(plan.directory, ignore_errors=True)
                return open_store(plan.final, settings=plan.settings)
            log(f"data: {plan.final} does not match the current settings; replacing it with the rebuild")
            old = tempfile.mkdtemp(dir=plan.root, prefix=f".stale-{plan.key}-")
            os.rename(plan.final, os.path.join(old, plan.key))
        os.rename(plan.directory, plan.final)
    except BaseException:
        if old is not None and not os.path.exists(plan.final):
            os.rename(os.path.join(old, plan.key), plan.final)
        raise
    finally:
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    undecodable = describe_undecodable(index["replaced_documents"], index["skipped_documents"])
    log(f"data: packed {documents:,} documents into {index['rows']:,} rows of {plan.row_len} tokens in "
        f"{len(shards)} shards from {len(manifests)} part{'s' * (len(manifests) != 1)} "
        f"({index['build_s']:.1f} s of packing, {index['tokens'] / max(index['build_s'], 1e-9):,.0f} tokens/s)"
        f"{'; ' + undecodable if undecodable else ''}")
    return PackedStore(plan.final, index)


def _ranges(indices):
    out, start = [], None
    for a, b in zip(indices, indices[1:] + [None]):
        start = a if start is None else start
        if b != a + 1:
            out.append(f"{start}" if start == a else f"{start}-{a}")
            start = None
    return ", ".join(out[:8]) + (", ..." if len(out) > 8 else "")


def describe_store(store):
    """Where a packed store's source comes from and what it holds, in one line."""
    settings, index = store.index["settings"], store.index
    fmt, source, files = settings["format"], settings["source"], settings["files"]
    if fmt == "hub":
        where = f"the Hugging Face hub, {source} at revision {files}"
    elif fmt == "megatron":
        where = f"Megatron indexed dataset {source} ({len(files) // 2} .bin/.idx pair(s), " \
                f"{sum(f[1] for f in files) / 1e6:,.1f} MB; token ids as stored)"
    else:
        where = f"{fmt} {source} ({len(files)} file(s), {sum(f[1] for f in files) / 1e6:,.1f} MB)"
    undecodable = describe_undecodable(index.get("replaced_documents", 0), index.get("skipped_documents", 0))
    return (f"{where} -> {index['documents']:,} documents, {index['tokens']:,} tokens in {index['rows']:,} rows of "
            f"{index['row_len']} ({len(index['shards'])} shards from {index.get('parts', 1)} part(s)) at "
            f"{store.root}{'; ' + undecodable if undecodable else ''}")


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

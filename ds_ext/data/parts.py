"""A source cut into parts, the units a packed cache is built in.

A part is a list of segments ``[path, start, stop]`` read in order: whole text,
JSON-array and parquet files, byte ranges of JSON Lines files (the lines that begin
in the range), row ranges of a ``save_to_disk`` dataset, document ranges of a
Megatron indexed dataset, or one file of a hub dataset (``[name, index, count]``).
The cut depends only on the data and ``data.part_mb``: small files are grouped in
name order until a part holds about ``part_mb``, a larger JSON Lines file is cut
into ranges of about ``part_mb``. So the parts, and the rows packed from each, are
the same however many tasks build them. A ``max_documents`` limit counts from the
start of the source, so such a source is one part.

Each part is read as a stream: text and JSON files by ``textfiles.segment_rows``
(``data.encoding_errors``), parquet files, saved and hub datasets as a ``datasets``
``IterableDataset``, Megatron datasets as token arrays, never the whole source in
memory.
"""

import math
from pathlib import Path

from ds_ext.errors import DataError

from .sources import data_files, hub_name, resolve_source, stdlib_corpus

BATCH = 1000


def plan_parts(data):
    """(format, parts) of one source (a DataSection without a mixture)."""
    fmt, path = resolve_source(data)
    if path is None:
        fmt, path = "json", stdlib_corpus()
    budget = max(1, int(data.part_mb * 2**20))
    if fmt == "hub":
        import datasets
        if datasets.config.HF_HUB_OFFLINE:      # streaming needs the hub: the HF cache's copy, by rows
            return "hub-cached", _row_parts(_hub_cached(path, data), path, data, budget)
        return fmt, _hub_parts(path, data)
    if fmt == "saved":
        return fmt, _saved_parts(Path(path), data, budget)
    if fmt == "megatron":
        return fmt, _megatron_parts(Path(path), data, budget)
    files = data_files(Path(path))
    if data.max_documents is not None:
        return fmt, [[[str(f), 0, f.stat().st_size] for f in files]]
    from .textfiles import json_is_array
    parts, group, size = [], [], 0
    for f in files:
        n = f.stat().st_size
        if fmt == "json" and n > budget and not json_is_array(f):
            if group:
                parts.append(group)
                group, size = [], 0
            count = math.ceil(n / budget)
            cuts = [n * i // count for i in range(count + 1)]
            parts.extend([[str(f), a, b]] for a, b in zip(cuts, cuts[1:]))
            continue
        group.append([str(f), 0, n])
        size += n
        if size >= budget:
            parts.append(group)
            group, size = [], 0
    if group:
        parts.append(group)
    return fmt, parts


def _saved(path):
    import datasets
    ds = datasets.load_from_disk(str(path))
    if isinstance(ds, datasets.DatasetDict):
        if "train" not in ds:
            raise DataError(f"{path}: saved DatasetDict has no 'train' split (has {list(ds)})")
        ds = ds["train"]
    return ds


def _saved_parts(path, data, budget):
    return _row_parts(_saved(path), str(path), data, budget)


def _row_parts(ds, name, data, budget):
    """Row ranges of about ``budget`` bytes of the Arrow dataset ``ds``."""
    if data.max_documents is not None or len(ds) == 0:
        return [[[name, 0, len(ds)]]]
    per = max(1, int(budget * len(ds) / max(1, ds.data.nbytes)))
    return [[[name, a, min(a + per, len(ds))]] for a in range(0, len(ds), per)]


def _hub_cached(source, data):
    import dataclasses
    from .sources import load_documents
    return load_documents(dataclasses.replace(data, source=source, mixture=[]))[0]


def _megatron_parts(path, data, budget):
    from .megatron import MegatronIndexed, megatron_prefixes
    prefixes = [(prefix, MegatronIndexed(prefix)) for prefix in megatron_prefixes(path)]
    if data.max_documents is not None:
        return [[[prefix, 0, ds.num_documents] for prefix, ds in prefixes]]
    parts = []
    for prefix, ds in prefixes:
        n = ds.num_documents
        per = max(1, int(budget * n / max(1, ds.num_tokens * ds.dtype.itemsize)))
        parts.extend([[prefix, a, min(a + per, n)]] for a in range(0, n, per))
    return parts


def _hub_stream(source):
    import datasets
    name, config = hub_name(source)
    try:
        return datasets.load_dataset(name, config, split="train", streaming=True)
    except Exception as exc:    # offline, unknown name, gated, network: whatever the hub client raises
        first = (str(exc).splitlines() or [""])[0][:200]
        raise DataError(f"seekspeed.data.source {source}: cannot stream it from the Hugging Face hub "
                        f"({type(exc).__name__}: {first}); the machine must be online, or save the dataset with "
                        f"datasets' save_to_disk and point seekspeed.data.source at that directory") from None


def _hub_parts(source, data):
    count = 1 if data.max_documents is not None else _hub_stream(source).num_shards
    return [[[source, i, count]] for i in range(count)]


def documents(data, fmt, part, tokenizer, counts):
    """Batches (lists) of token arrays of ``part``'s non-empty documents in order, each
    ending with the tokenizer's end-of-document token. ``counts`` (a dict) gains the
    documents whose undecodable bytes were ``replaced`` or that were ``skipped``."""
    import numpy as np
    limit = data.max_documents
    taken = 0
    if fmt == "megatron":
        from .megatron import MegatronIndexed
        eos = tokenizer.eos_token_id
        for prefix, start, stop in part:
            batch = []
            for doc in MegatronIndexed(prefix).documents(start, stop):
                if limit is not None and taken >= limit:
                    break
                if len(doc) == 0:
                    continue
                doc = np.asarray(doc, dtype=np.int64)
                if doc[-1] != eos:                      # written without --append-eod
                    doc = np.append(doc, eos)
                batch.append(doc)
                taken += 1
                if len(batch) == BATCH:
                    yield batch
                    batch = []
            if batch:
                yield batch
        return
    from .textfiles import FLAG, REPLACED, SKIPPED
    field = "text" if fmt == "text" else data.text_field
    for rows in _row_batches(data, fmt, part, field):
        texts = rows[field]
        flags = rows.get(FLAG)
        if flags is not None:
            counts["replaced"] = counts.get("replaced", 0) + sum(f == REPLACED for f in flags)
            counts["skipped"] = counts.get("skipped", 0) + sum(f == SKIPPED for f in flags)
        texts = [t for t in texts if isinstance(t, str) and t]
        if limit is not None:
            texts = texts[:limit - taken]
            taken += len(texts)
        if texts:
            yield [np.asarray(ids, dtype=np.int64) for ids in tokenizer.encode_documents(texts)]
        if limit is not None and taken >= limit:
            return


def stream(data, fmt, part):
    """``part`` as a ``datasets.IterableDataset`` (text, JSON and parquet files, saved
    and hub datasets): nothing is read until it is iterated."""
    import datasets
    datasets.disable_progress_bars()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)
    if fmt in ("text", "json"):
        from .textfiles import FLAG
        field = "text" if fmt == "text" else data.text_field
        features = datasets.Features({field: datasets.Value("string"), FLAG: datasets.Value("int8")})
        # one generator over the segments, in order (a list in gen_kwargs would be split across workers)
        return datasets.IterableDataset.from_generator(
            _segments, features=features,
            gen_kwargs={"todo": [(tuple(map(tuple, part)), fmt, field, data.encoding_errors, data.source)]})
    if fmt == "parquet":
        return datasets.load_dataset("parquet", data_files=[p for p, _, _ in part], split="train", streaming=True)
    if fmt == "saved":
        (path, start, stop), = part
        return _saved(path).select(range(start, stop)).to_iterable_dataset()
    if fmt == "hub-cached":
        (source, start, stop), = part
        return _hub_cached(source, data).select(range(start, stop)).to_iterable_dataset()
    if fmt == "hub":
        (source, index, count), = part
        ds = _hub_stream(source)
        return ds if count == 1 else ds.shard(num_shards=count, index=index)
    raise AssertionError(fmt)


def _segments(todo):
    from .textfiles import segment_rows
    for segments, fmt, field, errors, source in todo:
        yield from segment_rows(list(segments), fmt=fmt, field=field, errors=errors, source=source)


def _row_batches(data, fmt, part, field):
    ds = stream(data, fmt, part)
    try:
        for rows in ds.iter(batch_size=BATCH):
            if field not in rows:
                raise DataError(f"seekspeed.data.text_field {field!r} is not a column of {data.source} "
                                f"(columns: {sorted(rows)})")
            yield rows
    except DataError:
        raise
    except Exception as exc:         # a corrupt file surfaces as whatever its reader raises
        from ds_ext.errors import SeekspeedError
        cause = exc.__cause__ or exc
        if isinstance(cause, SeekspeedError):
            raise cause from None
        raise DataError(f"seekspeed.data.source {data.source}: cannot read as {fmt} "
                        f"({type(cause).__name__}: {(str(cause).splitlines() or [''])[0][:200]})") from None

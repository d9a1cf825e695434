"""Local text and JSON files, read by seekspeed rather than by datasets' text/json
builders, so that bytes which are not UTF-8 follow ``seekspeed.data.encoding_errors``
and a malformed JSON line is named by file and line.

    "strict"   (default) the first undecodable byte stops the run, naming file:line
    "replace"  undecodable bytes become U+FFFD; the documents that had any are counted
    "skip"     the documents that have any are left out, and counted

A document is a text file (.txt/.md, the whole file, newlines translated as text mode
does) or one line of a JSON Lines file (.json/.jsonl; a file that is one JSON array
is read whole, as datasets does). A JSON Lines file is streamed line by line. The
rows go into an Arrow dataset in the datasets cache, keyed by the files' names,
sizes and modification times, the format, the text field and the setting. Each row
holds the document (None for a skipped one) and ``FLAG`` (CLEAN, REPLACED, SKIPPED),
so the counts are known when the dataset comes from that cache too.
"""

import codecs
import hashlib
import json
import os
import re

from ds_ext.errors import ConfigError, DataError, SeekspeedError

FLAG = "__seekspeed_utf8__"
CLEAN, REPLACED, SKIPPED = 0, 1, 2
_READER_VERSION = 1
_FIX = ('set seekspeed.data.encoding_errors to "replace" (undecodable bytes become U+FFFD) or "skip" (leave out '
        'the documents that have any)')
_JSON_FIX = "fix or remove that line (a .json/.jsonl source holds one JSON object per line, or one JSON array)"


def read_files(files, *, fmt, field, errors, source):
    """The documents of ``files`` (``fmt`` "text" or "json") as a ``datasets.Dataset``
    with columns ``field`` and ``FLAG``; ``source`` names the source in errors."""
    import datasets
    stamp = [(f, os.path.getsize(f), os.stat(f).st_mtime_ns) for f in files]
    key = json.dumps({"reader": _READER_VERSION, "files": stamp, "format": fmt, "field": field, "errors": errors})
    features = datasets.Features({field: datasets.Value("string"), FLAG: datasets.Value("int8")})
    try:
        return datasets.Dataset.from_generator(
            _rows, features=features, fingerprint=hashlib.sha256(key.encode()).hexdigest()[:32],
            gen_kwargs={"files": list(files), "fmt": fmt, "field": field, "errors": errors, "source": source})
    except datasets.exceptions.DatasetGenerationError as exc:
        cause = exc.__cause__ or exc
        if isinstance(cause, SeekspeedError):
            raise cause from None
        raise DataError(f"seekspeed.data.source {source}: cannot read as {fmt} "
                        f"({type(cause).__name__}: {(str(cause).splitlines() or [''])[0][:200]})") from None


def undecodable_counts(ds):
    """(replaced, skipped) documents of a dataset from ``read_files`` (0, 0 for others)."""
    if FLAG not in ds.column_names:
        return 0, 0
    import numpy as np
    flags = ds.data.column(FLAG).to_numpy()
    counts = np.bincount(flags.astype(np.int64), minlength=3)
    return int(counts[REPLACED]), int(counts[SKIPPED])


def describe_undecodable(replaced, skipped):
    """The data summary's words for the counts ('' when there are none)."""
    parts = []
    if replaced:
        parts.append(f"{replaced:,} document{'s' * (replaced != 1)} with bytes that are not UTF-8 decoded with U+FFFD")
    if skipped:
        parts.append(f"{skipped:,} document{'s' * (skipped != 1)} with bytes that are not UTF-8 skipped")
    return "; ".join(parts)


def _rows(files, fmt, field, errors, source):
    yield from segment_rows([(f, 0, None) for f in files], fmt=fmt, field=field, errors=errors, source=source)


def segment_rows(segments, *, fmt, field, errors, source):
    """Rows ``{field, FLAG}`` of ``segments`` ``(path, start, stop)``: a text file is one
    document (the segment is the whole file); a JSON Lines segment holds the lines that
    begin in bytes [start, stop) (``stop`` None: to the end), so consecutive segments
    of one file hold each line once; a JSON array file is read whole."""
    seen = _Columns(field)
    for path, start, stop in segments:
        if fmt == "text":
            yield _text_row(path, errors)
        else:
            yield from _json_rows(path, field, errors, seen, start=start, stop=stop)
    if fmt == "json" and seen.objects and not seen.found:
        raise ConfigError(f"seekspeed.data.text_field {field!r} is not a column of {source} "
                          f"(columns: {sorted(seen.first)})")


def json_is_array(path):
    """Whether the JSON file ``path`` holds one array (read whole) rather than JSON Lines."""
    with open(path, "rb") as f:
        head = f.read(4096)
    if head.startswith(codecs.BOM_UTF8):
        head = head[len(codecs.BOM_UTF8):]
    return head.lstrip().startswith(b"[")


def _line_number(path, offset):
    """The 1-based line of byte ``offset`` of ``path`` (counted only for an error message)."""
    count = 0
    with open(path, "rb") as f:
        while offset > 0:
            chunk = f.read(min(offset, 1 << 24))
            if not chunk:
                break
            count += chunk.count(b"\n")
            offset -= len(chunk)
    return count + 1


class _Columns:
    """Whether any JSON object had the text field, and the first object's keys."""

    def __init__(self, field):
        self.field, self.objects, self.found, self.first = field, 0, False, None

    def note(self, obj):
        self.objects += 1
        if self.first is None:
            self.first = list(obj)
        self.found = self.found or self.field in obj


def _decode(raw, *, errors, path, line_of):
    """(text or None, flag) of ``raw`` under ``errors``; ``line_of(offset)`` gives
    (line, column) of a byte offset for the strict error."""
    try:
        return raw.decode("utf-8"), CLEAN
    except UnicodeDecodeError as exc:
        if errors == "skip":
            return None, SKIPPED
        if errors == "replace":
            return raw.decode("utf-8", errors="replace"), REPLACED
        line, column = line_of(exc.start)
        raise DataError(f"seekspeed.data.source {path}:{line}: byte 0x{raw[exc.start]:02x} at column {column} is not "
                        f"UTF-8 ({exc.reason}; data.encoding_errors is \"strict\"); {_FIX}") from None


def _line_in(raw):
    def line_of(offset):
        start = raw.rfind(b"\n", 0, offset) + 1
        return raw.count(b"\n", 0, offset) + 1, offset - start + 1
    return line_of


def _text_row(path, errors):
    with open(path, "rb") as f:
        raw = f.read()
    text, flag = _decode(raw, errors=errors, path=path, line_of=_line_in(raw))
    del raw
    if text is not None and "\r" in text:           # what text mode (universal newlines) gives
        text = text.replace("\r\n", "\n").replace("\r", "\n")
    return {"text": text, FLAG: flag}


def _json_rows(path, field, errors, seen, *, start=0, stop=None):
    with open(path, "rb") as f:
        if start == 0:
            if json_is_array(path):
                if stop is not None and stop < os.path.getsize(path):
                    raise ValueError(f"{path} is one JSON array: it cannot be read in byte ranges")
                yield from _json_array(path, f.read(), field, errors, seen)
                return
            if f.read(len(codecs.BOM_UTF8)) != codecs.BOM_UTF8:
                f.seek(0)
        else:                                     # the line holding byte start - 1 is the previous segment's
            f.seek(start - 1)
            f.readline()
        number = 0
        while stop is None or f.tell() < stop:
            here = f.tell()
            raw = f.readline()
            if not raw:
                break
            number += 1
            if not raw.strip():
                continue
            # a segment that starts inside the file counts its lines only for an error message
            line = number if start == 0 else None
            text, flag = _decode(raw, errors=errors, path=path,
                                 line_of=lambda offset: (line or _line_number(path, here), offset + 1))  # noqa: B023
            if text is None:
                yield {field: None, FLAG: flag}
                continue
            try:
                obj = json.loads(text)
            except json.JSONDecodeError as exc:
                raise DataError(f"seekspeed.data.source {path}:{line or _line_number(path, here)}: not valid JSON ({exc.msg} at column "
                                f"{exc.colno}); {_JSON_FIX}") from None
            if not isinstance(obj, dict):
                raise DataError(f"seekspeed.data.source {path}:{line or _line_number(path, here)}: a JSON {type(obj).__name__}, not an object "
                                f"with a {field!r} field; {_JSON_FIX}")
            seen.note(obj)
            yield {field: _text_of(obj, field), FLAG: flag}


_ESCAPED = re.compile("[\udc80-\udcff]")


def _json_array(path, raw, field, errors, seen):
    """A file holding one JSON array of objects (or of strings, each a document under
    "text", as datasets reads it). Bytes that are not UTF-8 are kept as escapes while
    parsing, then each document that has any is replaced, skipped or refused."""
    try:
        raw.decode("utf-8")
        clean = True
    except UnicodeDecodeError:
        if errors == "strict":
            _decode(raw, errors="strict", path=path, line_of=_line_in(raw))
        clean = False
    text = raw.decode("utf-8", errors="surrogateescape")
    del raw
    try:
        items = json.loads(text)
    except json.JSONDecodeError as exc:
        raise DataError(f"seekspeed.data.source {path}:{exc.lineno}: not valid JSON ({exc.msg} at column {exc.colno}); "
                        f"{_JSON_FIX}") from None
    del text
    strings = bool(items) and isinstance(items[0], str)
    for i, item in enumerate(items):
        if not isinstance(item, str if strings else dict):
            raise DataError(f"seekspeed.data.source {path}: item {i} of its JSON array is a {type(item).__name__}, "
                            f"item 0 a {type(items[0]).__name__}; an array must hold only objects or only strings")
        obj = {"text": item} if strings else item
        seen.note(obj)
        doc, flag = _text_of(obj, field), CLEAN
        if not clean and doc is not None and _ESCAPED.search(doc):
            doc, flag = (None, SKIPPED) if errors == "skip" else (_ESCAPED.sub("\ufffd", doc), REPLACED)
        yield {field: doc, FLAG: flag}


def _text_of(obj, field):
    value = obj.get(field)
    return value if isinstance(value, str) else None

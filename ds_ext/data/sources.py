"""Documents as Hugging Face ``datasets``: local text/json/parquet files, a
directory of them, a ``save_to_disk`` directory, a hub dataset (``hub:NAME`` or
``hub:NAME:CONFIG``, train split; needs the machine online or the dataset in the HF
cache), or the offline demo corpus. Text and JSON files are decoded by
``textfiles.py`` (``data.encoding_errors``), the others by ``datasets``."""

import json
import os
import sys
import sysconfig
from pathlib import Path

from ds_ext.errors import ConfigError, DataError
from ds_ext.fileio import atomic_open

DEMO_MAX_BYTES = 8 * 2**20
_MEGATRON = (".bin", ".idx")       # a Megatron indexed dataset (megatron.py)
_EXTENSIONS = {".txt": "text", ".text": "text", ".md": "text", ".json": "json", ".jsonl": "json",
               ".parquet": "parquet"}


def cache_dir():
    return Path(os.environ.get("SEEKSPEED_CACHE", Path.home() / ".cache" / "seekspeed"))


def stdlib_corpus(max_bytes=DEMO_MAX_BYTES):
    """A JSONL file of this Python's standard-library sources (one document per
    module, sorted by path, up to ``max_bytes``). Built once, atomically, offline."""
    version = ".".join(map(str, sys.version_info[:3]))
    out = cache_dir() / f"stdlib-{version}-{max_bytes}.jsonl"
    if out.exists():
        return out
    root = Path(sysconfig.get_paths()["stdlib"])
    total = 0
    out.parent.mkdir(parents=True, exist_ok=True)
    with atomic_open(out, "w") as f:
        for path in sorted(root.rglob("*.py")):
            if "site-packages" in path.parts or total >= max_bytes:
                continue
            try:
                text = path.read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):
                continue
            if not text.strip():
                continue
            f.write(json.dumps({"text": text, "path": str(path.relative_to(root))}) + "\n")
            total += len(text)
        if total == 0:
            raise DataError(f"no readable .py files under {root}: set seekspeed.data.source to a local corpus")
    return out


def _format_of(path, fmt):
    if fmt != "auto":
        return fmt
    if path.is_dir():
        if (path / "dataset_info.json").exists() or (path / "dataset_dict.json").exists():
            return "saved"
        if any(p.suffix in _MEGATRON for p in path.iterdir()):
            return "megatron"
        formats = {_EXTENSIONS.get(p.suffix) for p in path.iterdir() if p.is_file()} - {None}
        if len(formats) != 1:
            found = sorted(formats) or "no .txt/.md/.json/.jsonl/.parquet files at its top level"
            raise ConfigError(f"seekspeed.data.source {path}: cannot tell the format of this directory "
                              f"(found {found}); files must sit directly in it, all of one format "
                              f"(subdirectories are not read)")
        return formats.pop()
    if path.suffix in _MEGATRON:
        return "megatron"
    if path.suffix not in _EXTENSIONS:
        raise ConfigError(f"seekspeed.data.source {path}: unknown extension {path.suffix!r}; "
                          f"set seekspeed.data.format to text, json or parquet")
    return _EXTENSIONS[path.suffix]


def data_files(path):
    """The non-empty data files of a file or directory source, in name order (empty
    files are left out: datasets' readers fail on them)."""
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.is_file() and p.suffix in _EXTENSIONS)
        if not files:
            raise DataError(f"seekspeed.data.source {path}: no data files in this directory")
    else:
        files = [path]
    files = [f for f in files if f.stat().st_size > 0]
    if not files:
        raise DataError(f"seekspeed.data.source {path}: every data file is empty: add data or point "
                        f"seekspeed.data.source elsewhere")
    return files


HUB_PREFIX = "hub:"


def hub_name(source):
    """(dataset name, config or None) of a ``hub:NAME[:CONFIG]`` source."""
    name, _, config = source[len(HUB_PREFIX):].partition(":")
    if not name or name.startswith("/") or " " in name:
        raise ConfigError(f"seekspeed.data.source {source!r}: write a hub dataset as hub:NAME or hub:NAME:CONFIG, "
                          f"e.g. hub:allenai/c4:en")
    return name, config or None


def hub_revision(source):
    """The hub commit a ``hub:`` source resolves to now, or "cached" when the hub cannot
    be asked (offline): the packed cache is keyed by it, so a dataset updated upstream
    is packed again rather than mixed with an old cache."""
    from huggingface_hub import HfApi
    from huggingface_hub.utils import HfHubHTTPError
    import datasets
    name, _ = hub_name(source)
    if datasets.config.HF_HUB_OFFLINE:
        return "cached"
    try:
        return HfApi().dataset_info(name).sha
    except (HfHubHTTPError, OSError, ValueError):
        return "cached"


def resolve_source(data):
    """(format, path) of the configured source; checks it exists without reading it.
    A hub source gives ("hub", "hub:NAME[:CONFIG]") and is checked when it is loaded."""
    if data.source == "stdlib":
        return "json", None
    if data.source.startswith(HUB_PREFIX):
        hub_name(data.source)
        return "hub", data.source
    path = Path(data.source).expanduser()
    if not path.exists() and path.with_name(path.name + ".idx").exists():      # a Megatron prefix
        return "megatron", path
    if not path.exists():
        raise ConfigError(f"seekspeed.data.source {data.source} does not exist: point it at a local "
                          f"text/json/parquet file or directory, or use \"stdlib\" for the demo corpus")
    return _format_of(path, data.format), path


def load_documents(data):
    """The configured documents as a ``datasets.Dataset`` with a text column. Text and
    JSON files are read by ``textfiles.read_files`` (``data.encoding_errors``; count
    what it replaced or skipped with ``textfiles.undecodable_counts``), parquet, saved
    and hub datasets by ``datasets``."""
    import datasets
    datasets.disable_progress_bars()
    # datasets logs a failed read before raising it; we report it once, in one line
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)
    fmt, path = resolve_source(data)
    if fmt == "megatron":
        raise ConfigError(f"seekspeed.data.source {path} is a Megatron indexed dataset (token ids already): set "
                          f"seekspeed.data.pipeline to \"tiered\" (the memory pipeline tokenises text)")
    text_field = data.text_field
    if path is None:
        path, text_field = stdlib_corpus(), "text"
    if fmt == "hub":
        name, config = hub_name(path)
        try:
            ds = datasets.load_dataset(name, config, split="train")
        except Exception as exc:    # offline, unknown name, gated, network: whatever the hub client raises
            first = (str(exc).splitlines() or [""])[0][:200]
            raise DataError(f"seekspeed.data.source {path}: cannot load it from the Hugging Face hub "
                            f"({type(exc).__name__}: {first}); the machine must be online or hold the dataset in "
                            f"its HF cache (HF_HOME), or save it with datasets' save_to_disk and point "
                            f"seekspeed.data.source at that directory") from None
    elif fmt == "saved":
        ds = datasets.load_from_disk(str(path))
        if isinstance(ds, datasets.DatasetDict):
            if "train" not in ds:
                raise DataError(f"{path}: saved DatasetDict has no 'train' split (has {list(ds)})")
            ds = ds["train"]
    else:
        files = [str(f) for f in data_files(path)]
        if fmt == "text":
            text_field = "text"
        if fmt in ("text", "json"):          # read here: encoding_errors, and file:line for a bad line
            from .textfiles import read_files
            ds = read_files(files, fmt=fmt, field=text_field, errors=data.encoding_errors, source=path)
        else:
            try:
                ds = datasets.load_dataset(fmt, data_files=files, split="train")
            except datasets.exceptions.DatasetGenerationError as exc:
                cause = exc.__cause__ or exc
                raise DataError(f"seekspeed.data.source {path}: cannot read as {fmt} "
                                f"({type(cause).__name__}: {str(cause).splitlines()[0][:200]})") from None
    if text_field not in ds.column_names:
        raise ConfigError(f"seekspeed.data.text_field {text_field!r} is not a column of {path} "
                          f"(columns: {ds.column_names})")
    return ds, text_field

"""Minimal data path: local text/json/parquet files and saved datasets through
Hugging Face datasets, byte-level and local transformers tokenizers, packing with
end-of-document tokens, per-replica shards, resumable micro-batch order, and the
errors for empty or unusable data. Bytes that are not UTF-8 under each
data.encoding_errors (strict: file:line and the fix; replace: U+FFFD, counted; skip:
the document left out, counted) for JSON Lines, text and JSON-array files; a
malformed JSON line named by file:line. Single process; about 10 s."""

import json
import os

import numpy as np
import pytest

from ds_ext.config import DataSection
from ds_ext.data import ByteTokenizer, PackedBatches, load_tokenizer, packed_sequences, stdlib_corpus
from ds_ext.errors import ConfigError, DataError

DOCS = [f"document {i}: " + "abcdefgh" * (i + 1) for i in range(12)]


def _data(source, **kw):
    return DataSection(source=str(source), seq_len=kw.pop("seq_len", 16), **kw)


def _stream(docs):
    out = []
    for d in docs:
        out += list(d.encode()) + [ByteTokenizer.eos_token_id]
    return out


def _write_jsonl(path, docs, field="text"):
    path.write_text("".join(json.dumps({field: d, "id": i}) + "\n" for i, d in enumerate(docs)))
    return path


@pytest.mark.parametrize("fmt", ["jsonl", "parquet", "saved", "textdir"])
def test_formats_pack_the_same_token_stream(tmp_path, fmt):
    import datasets
    if fmt == "jsonl":
        source = _write_jsonl(tmp_path / "c.jsonl", DOCS)
    elif fmt == "parquet":
        source = tmp_path / "c.parquet"
        datasets.Dataset.from_dict({"text": DOCS}).to_parquet(str(source))
    elif fmt == "saved":
        source = tmp_path / "saved"
        datasets.Dataset.from_dict({"text": DOCS}).save_to_disk(str(source))
    else:
        source = tmp_path / "txt"
        source.mkdir()
        for i, d in enumerate(DOCS):   # one document per file, file order = sorted names
            (source / f"{i:03d}.txt").write_text(d)
    rows = packed_sequences(_data(source), ByteTokenizer(), vocab_size=512, shard=0, num_shards=1)
    stream = _stream(DOCS)
    assert rows.shape == (len(stream) // 17, 17)
    np.testing.assert_array_equal(rows.reshape(-1), stream[:rows.size])


def test_shards_are_contiguous_balanced_and_cover_the_corpus(tmp_path):
    from ds_ext.data.packing import _balanced_range
    import datasets
    docs = [f"doc {i} " + "x" * (10 * (i % 5) + 1) for i in range(40)]
    ds = datasets.Dataset.from_dict({"text": docs})
    ranges = [_balanced_range(ds, "text", shard=s, num_shards=3) for s in range(3)]
    assert ranges[0][0] == 0 and ranges[-1][1] == len(docs)
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))            # contiguous, disjoint, in order
    chars = [sum(len(d) for d in docs[a:b]) for a, b in ranges]
    assert max(chars) - min(chars) <= max(len(d) for d in docs), chars      # balanced to within one document
    source = _write_jsonl(tmp_path / "c.jsonl", docs)
    rows = packed_sequences(_data(source, seq_len=7), ByteTokenizer(), vocab_size=512, shard=1, num_shards=3)
    a, b = ranges[1]
    np.testing.assert_array_equal(rows.reshape(-1), _stream(docs[a:b])[:rows.size])


def test_skewed_corpus_is_balanced_or_refused(tmp_path):
    docs = ["short"] * 9 + ["y" * 100_000]
    source = _write_jsonl(tmp_path / "skew.jsonl", docs)
    with pytest.raises(DataError, match="shard 2 .* gets no documents"):
        packed_sequences(_data(source), ByteTokenizer(), vocab_size=512, shard=2, num_shards=3)
    # two shards: the long document alone on one, the short ones on the other
    short = packed_sequences(_data(source, seq_len=4), ByteTokenizer(), vocab_size=512, shard=0, num_shards=2)
    assert len(short) == len(_stream(docs[:9])) // 5


def test_batches_are_shifted_deterministic_and_resumable(tmp_path):
    rows = np.arange(40 * 9, dtype=np.int64).reshape(40, 9)
    a = PackedBatches(rows, micro_batch=4, seed=3)
    first = [next(a) for _ in range(25)]          # crosses an epoch boundary (10 per epoch)
    x, y = first[0]
    assert x.shape == (4, 8) and (y[:, :-1] == x[:, 1:]).all()
    b = PackedBatches(rows, micro_batch=4, seed=3, start=17)
    for i in range(17, 25):
        xb, yb = next(b)
        assert (xb == first[i][0]).all() and (yb == first[i][1]).all()
    epoch0 = [tuple(row.tolist()) for t, _ in first[:10] for row in t]
    assert len(set(epoch0)) == 40                           # every row exactly once per epoch
    epoch1 = [tuple(row.tolist()) for t, _ in first[10:20] for row in t]
    assert sorted(epoch1) == sorted(epoch0) and epoch1 != epoch0   # same rows, new order


def test_local_transformers_tokenizer(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {w: i for i, w in enumerate(["<unk>", "</s>", "document", "abcdefgh", ":", "0", "1", "2"])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", unk_token="<unk>").save_pretrained(tmp_path / "tok")
    t = load_tokenizer(str(tmp_path / "tok"), vocab_size=64)
    assert t.vocab_size == 8 and t.eos_token_id == 1
    assert t.encode_documents(["document 1: abcdefgh"]) == [[2, 6, 4, 3, 1]]
    with pytest.raises(ConfigError, match="vocab_size >= 8"):
        load_tokenizer(str(tmp_path / "tok"), vocab_size=4)
    with pytest.raises(ConfigError, match="neither 'byte' nor an existing local directory"):
        load_tokenizer(str(tmp_path / "missing"), vocab_size=64)


def test_empty_corpus_is_an_error(tmp_path):
    source = _write_jsonl(tmp_path / "empty.jsonl", ["", ""])
    with pytest.raises(DataError, match="no non-empty documents"):
        packed_sequences(_data(source), ByteTokenizer(), vocab_size=512, shard=0, num_shards=1)


def test_corpus_smaller_than_one_sequence(tmp_path):
    source = _write_jsonl(tmp_path / "small.jsonl", ["hi"])
    with pytest.raises(DataError, match="fewer than one sequence"):
        packed_sequences(_data(source, seq_len=64), ByteTokenizer(), vocab_size=512, shard=0, num_shards=1)


def test_max_documents_counts_non_empty_documents(tmp_path):
    source = _write_jsonl(tmp_path / "c.jsonl", ["", DOCS[0], "", DOCS[1], DOCS[2]])
    rows = packed_sequences(_data(source, seq_len=4, max_documents=2), ByteTokenizer(), vocab_size=512, shard=0,
                            num_shards=1)
    assert rows.size == len(_stream(DOCS[:2])) // 5 * 5


def test_wrong_text_field(tmp_path):
    source = _write_jsonl(tmp_path / "c.jsonl", DOCS, field="content")
    with pytest.raises(ConfigError, match="'text' is not a column"):
        packed_sequences(_data(source), ByteTokenizer(), vocab_size=512, shard=0, num_shards=1)


# documents with bytes that are not UTF-8 (a Latin-1 "é", a stray 0xff) among clean ones
BAD_DOCS = [("document %d: " % i + "abcdefgh" * (i + 1)).encode() for i in range(8)]
BAD_DOCS[2] = b"caf\xe9 au lait, " * 3
BAD_DOCS[5] = b"line one\nline two \xff\xfe end"
BAD = (2, 5)


def _write_bad(tmp_path, layout):
    """The BAD_DOCS corpus as a JSON Lines file, a directory of text files, or a JSON array."""
    if layout == "jsonl":
        path = tmp_path / "bad.jsonl"
        path.write_bytes(b"".join(b'{"text": "' + d.replace(b"\n", b"\\n") + b'"}\n' for d in BAD_DOCS))
    elif layout == "textdir":
        path = tmp_path / "txt"
        path.mkdir()
        for i, d in enumerate(BAD_DOCS):
            (path / f"{i:03d}.txt").write_bytes(d)
    else:
        path = tmp_path / "array.json"
        path.write_bytes(b"[\n" + b",\n".join(b'{"text": "' + d.replace(b"\n", b"\\n") + b'"}'
                                                for d in BAD_DOCS) + b"\n]\n")
    return path


@pytest.mark.parametrize("layout,where", [("jsonl", "bad.jsonl:3: byte 0xe9 at column 14"),
                                          ("textdir", "002.txt:1: byte 0xe9 at column 4"),
                                          ("array", "array.json:4: byte 0xe9 at column 14")])
def test_undecodable_bytes_stop_a_strict_run_naming_file_line_and_fix(tmp_path, layout, where):
    source = _write_bad(tmp_path, layout)
    with pytest.raises(DataError) as exc:
        packed_sequences(_data(source), ByteTokenizer(), vocab_size=512, shard=0, num_shards=1)
    message = str(exc.value)
    assert "\n" not in message and where in message, message
    assert 'set seekspeed.data.encoding_errors to "replace"' in message and '"skip"' in message


@pytest.mark.parametrize("layout", ["jsonl", "textdir", "array"])
@pytest.mark.parametrize("mode", ["replace", "skip"])
def test_undecodable_bytes_are_replaced_or_skipped_and_counted(tmp_path, layout, mode):
    source = _write_bad(tmp_path, layout)
    stats = {}
    rows = packed_sequences(_data(source, seq_len=7, encoding_errors=mode), ByteTokenizer(), vocab_size=512,
                            shard=0, num_shards=1, stats=stats)
    if mode == "replace":
        expected = [d.decode("utf-8", errors="replace") for d in BAD_DOCS]
        assert all("\ufffd" in expected[i] for i in BAD)
        assert stats == {"replaced": 2, "skipped": 0}
        fffd = list("\ufffd".encode())                         # U+FFFD reaches the tokens as EF BF BD
        flat = rows.reshape(-1).tolist()
        assert any(flat[i:i + 3] == fffd for i in range(len(flat)))
    else:
        expected = [d.decode() for i, d in enumerate(BAD_DOCS) if i not in BAD]
        assert stats == {"replaced": 0, "skipped": 2}
    np.testing.assert_array_equal(rows.reshape(-1), _stream(expected)[:rows.size])
    assert rows.size > len(_stream(expected)) - 8              # the whole stream but its last partial row


def test_a_malformed_json_line_names_file_line_and_fix(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b'{"text": "ok"}\n\n{"text": "trailing comma",}\n')
    with pytest.raises(DataError, match=r"bad\.jsonl:3: not valid JSON \(.* at column 27\); fix or remove that line"):
        packed_sequences(_data(bad), ByteTokenizer(), vocab_size=512, shard=0, num_shards=1)
    bad.write_bytes(b'{"text": "ok"}\n["not", "an object"]\n')
    with pytest.raises(DataError, match=r"bad\.jsonl:2: a JSON list, not an object with a 'text' field"):
        packed_sequences(_data(bad), ByteTokenizer(), vocab_size=512, shard=0, num_shards=1)
    # bytes that are neither UTF-8 nor JSON: replaced, the line is still not JSON, and named
    bad.write_bytes(b'{"text": "ok"}\n\xff\xfe not json\n')
    with pytest.raises(DataError, match=r"bad\.jsonl:2: not valid JSON"):
        packed_sequences(_data(bad, encoding_errors="replace"), ByteTokenizer(), vocab_size=512, shard=0,
                         num_shards=1)
    with pytest.raises(ConfigError, match=r"encoding_errors 'ignore' is not one of \['strict', 'replace', 'skip'\]"):
        DataSection(encoding_errors="ignore").check("seekspeed.data")


def test_stdlib_demo_corpus_is_offline_and_cached():
    path = stdlib_corpus()
    assert path.exists() and path.stat().st_size > 1_000_000
    stamp = (path.stat().st_ino, path.stat().st_mtime_ns)
    assert stdlib_corpus() == path
    assert (path.stat().st_ino, path.stat().st_mtime_ns) == stamp      # reused, not rebuilt
    first = json.loads(path.open().readline())
    assert set(first) == {"text", "path"} and first["path"].endswith(".py")


def test_hub_source_offline_is_a_one_line_error(tmp_path):
    """A hub dataset on a machine that cannot reach the hub (and has nothing cached):
    one line naming the source and the ways out. Offline by the hub's own switches, so
    the test sends nothing anywhere."""
    import subprocess
    import sys
    code = ("from ds_ext.config import DataSection; from ds_ext.data import load_documents\n"
            "from ds_ext.errors import DataError\n"
            "try:\n    load_documents(DataSection(source='hub:seekspeed-test/absent:en'))\n"
            "except DataError as exc:\n    print(exc)\n")
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", HF_HOME=str(tmp_path / "hf"),
               PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    line = out.stdout.strip()
    assert line.startswith("seekspeed.data.source hub:seekspeed-test/absent:en: cannot load it from the Hugging "
                           "Face hub") and "online" in line and "save_to_disk" in line, (out.stdout, out.stderr[-2000:])
    assert "\n" not in line
    from ds_ext.data.sources import hub_name
    assert hub_name("hub:allenai/c4:en") == ("allenai/c4", "en") and hub_name("hub:wikitext") == ("wikitext", None)
    with pytest.raises(ConfigError, match="hub:NAME or hub:NAME:CONFIG"):
        hub_name("hub:")

"""ds_ext.data.megatron, the reader of Megatron indexed datasets (.bin + .idx), against
the format's own writers and reader: pairs written by megatron-core's
IndexedDatasetBuilder (every integer dtype; documents of 0, 1 and many tokens; several
sequences in one document through add_item/end_document and add_document; an empty
sequence; pairs merged with add_index) and by datatrove's MegatronDocumentTokenizer
(uint16 and int32, with a small word-level tokenizer built here, nothing downloaded)
read back bitwise equal to megatron-core's IndexedDataset, with the counts, dtype and
documents(start, stop) ranges. Then each refusal, by corrupting a copy of a written
pair (magic, version, dtype code, a truncated .idx or .bin, trailing bytes, a
multimodal index, pointers, sizes, document indices, the .idx of another pair),
checking that the one-line message names the file and the difference; and
megatron_prefixes on prefixes, either file, directories and the mistakes. Single
process; about 10 s on a quiet machine, of which the tests are about 2 s and the rest is
importing torch and megatron-core (20-25 s when the machine is shared and busy)."""

import os
import pickle
import re
import shutil

import numpy as np
import pytest
import torch
from megatron.core.datasets.indexed_dataset import IndexedDataset, IndexedDatasetBuilder

from ds_ext.data.megatron import MegatronIndexed, megatron_prefixes
from ds_ext.errors import ConfigError, DataError

HEADER = 34  # magic 9, version 8, dtype code 1, sequence count 8, document-index count 8


def _docs(dtype):
    """Documents as lists of sequences, with token values at the ends of the dtype's
    range so that a wrong dtype or byte order shows."""
    info = np.iinfo(dtype)
    hi, lo = int(info.max), int(info.min)
    return [
        [[1, 2, 3]],
        [[hi]],                                 # one token, the dtype's largest value
        [[4, 5], [6], [7, 8, 9, lo]],           # three sequences (sentences) in one document
        [],                                     # no sequences: what preprocess_data writes for empty text
        [[], [10]],                             # an empty sequence
        [list(range(i % 100, i % 100 + 37)) for i in range(5)],
        [[11] * 300],
        [[hi - 1, lo + 1, 0]],
    ]


def _write(prefix, docs, dtype, *, whole=False, multimodal=False):
    """Write ``docs`` with megatron-core's builder: sequence by sequence with
    end_document, or (``whole``) each document at once with add_document."""
    b = IndexedDatasetBuilder(prefix + ".bin", dtype=dtype, multimodal=multimodal)
    for doc in docs:
        if whole:
            flat = [t for seq in doc for t in seq]
            b.add_document(torch.tensor(flat, dtype=torch.int64), [len(s) for s in doc],
                           **({"modes": [i % 2 for i in range(len(doc))]} if multimodal else {}))
        else:
            for k, seq in enumerate(doc):
                b.add_item(torch.tensor(seq, dtype=torch.int64), **({"mode": k % 2} if multimodal else {}))
            b.end_document()
    b.finalize(prefix + ".idx")
    return prefix


def _reference(prefix):
    """Each document as megatron-core's reader gives it: its sequences concatenated."""
    ref = IndexedDataset(prefix)
    bounds = ref.document_indices
    out = []
    for i in range(len(bounds) - 1):
        seqs = [ref[j] for j in range(int(bounds[i]), int(bounds[i + 1]))]
        out.append(np.concatenate(seqs) if seqs else np.empty(0, dtype=ref.index.dtype))
    return ref, out


def _same(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


@pytest.mark.parametrize("dtype", [np.uint16, np.int32, np.uint8, np.int8, np.int16, np.int64])
@pytest.mark.parametrize("whole", [False, True])
def test_megatron_core_writer_read_back_bitwise(tmp_path, dtype, whole):
    docs = _docs(dtype)
    prefix = _write(str(tmp_path / "corpus_text_document"), docs, dtype, whole=whole)
    m = MegatronIndexed(prefix)
    ref, expected = _reference(prefix)
    assert m.num_documents == len(docs) == len(expected)
    assert m.num_tokens == int(ref.sequence_lengths.sum()) == sum(len(s) for d in docs for s in d)
    assert m.num_sequences == len(ref)
    assert m.dtype == np.dtype(dtype) == np.dtype(ref.index.dtype)
    for i, doc in enumerate(docs):
        got = m.document(i)
        assert _same(got, expected[i]), i
        assert got.tolist() == [t for seq in doc for t in seq]
        assert not got.flags.writeable


def test_documents_ranges(tmp_path):
    docs = _docs(np.uint16)
    m = MegatronIndexed(_write(str(tmp_path / "c"), docs, np.uint16))
    n = m.num_documents
    for start, stop in [(0, n), (0, 1), (2, 5), (3, 4), (n - 1, n), (4, 4), (n, n)]:
        got = list(m.documents(start, stop))
        assert len(got) == stop - start
        assert all(_same(g, m.document(i)) for i, g in zip(range(start, stop), got, strict=True))
    with pytest.raises(ValueError, match=rf"documents\(3, {n + 1}\) is not a range within the {n} documents"):
        m.documents(3, n + 1)  # checked when called, not when first iterated
    with pytest.raises(ValueError, match=r"documents\(2, 1\)"):
        m.documents(2, 1)
    with pytest.raises(IndexError, match=f"document {n} is out of range"):
        m.document(n)
    with pytest.raises(IndexError, match="document -1 is out of range"):
        m.document(-1)
    assert len(m) == n
    back = pickle.loads(pickle.dumps(m))  # a worker gets the prefix and reopens the files
    assert back.prefix == m.prefix and _same(back.document(2), m.document(2))


def test_merged_with_add_index(tmp_path):
    a = _write(str(tmp_path / "a"), _docs(np.int32), np.int32)
    b = _write(str(tmp_path / "b"), _docs(np.int32)[::-1], np.int32, whole=True)
    merged = IndexedDatasetBuilder(str(tmp_path / "ab.bin"), dtype=np.int32)
    merged.add_index(a)
    merged.add_index(b)
    merged.finalize(str(tmp_path / "ab.idx"))
    m = MegatronIndexed(str(tmp_path / "ab"))
    _, expected = _reference(str(tmp_path / "ab"))
    assert m.num_documents == 2 * len(_docs(np.int32))
    assert all(_same(got, want) for got, want in zip(m.documents(0, m.num_documents), expected, strict=True))


def _word_tokenizer(path, num_words):
    from tokenizers import Tokenizer, models, pre_tokenizers
    vocab = {"<|endoftext|>": 0, "[UNK]": 1} | {f"w{i}": i + 2 for i in range(num_words)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(["<|endoftext|>"])
    tok.save(path)
    return Tokenizer.from_file(path)


@pytest.mark.parametrize("num_words, dtype", [(50, np.uint16), (70_000, np.int32)])
def test_datatrove_writer_read_back_bitwise(tmp_path, num_words, dtype):
    pytest.importorskip("datatrove")
    from datatrove.data import Document
    from datatrove.pipeline.tokens.megatron_tokenizer import MegatronDocumentTokenizer
    tok = _word_tokenizer(str(tmp_path / "tok.json"), num_words)
    texts = ["w3", ""] + [" ".join(f"w{(i * 7919 + j * 104729) % num_words}" for j in range(i * 3 + 1))
                          for i in range(12)]
    step = MegatronDocumentTokenizer(output_folder=str(tmp_path / "out"), tokenizer_name_or_path=str(tmp_path / "tok.json"),
                                     save_filename="corpus")
    step.run(iter(Document(text=t, id=str(i)) for i, t in enumerate(texts)), rank=0, world_size=1)
    (prefix,) = megatron_prefixes(str(tmp_path / "out"))
    assert os.path.basename(prefix) == "corpus_00000_tokens"
    m = MegatronIndexed(prefix)
    _, expected = _reference(prefix)
    assert m.dtype == np.dtype(dtype) and m.num_documents == len(texts)
    for i, got in enumerate(m.documents(0, m.num_documents)):
        assert _same(got, expected[i])
        # datatrove appends its eos_token ("<|endoftext|>" by default) to every document, the empty one too
        assert got.tolist() == tok.encode(texts[i]).ids + [0]


# Corruptions of a written pair. Each test copies the pair, changes it, and checks the message.

@pytest.fixture
def pair(tmp_path):
    os.makedirs(tmp_path / "good")
    prefix = _write(str(tmp_path / "good" / "corpus"), _docs(np.uint16), np.uint16)
    m = MegatronIndexed(prefix)
    return prefix, m.num_sequences, m.num_documents + 1


def _copy(prefix, tmp_path, name="bad"):
    os.makedirs(tmp_path / name, exist_ok=True)
    out = str(tmp_path / name / "corpus")
    for ext in (".bin", ".idx"):
        shutil.copyfile(prefix + ext, out + ext)
    return out


def _poke(path, offset, raw):
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(raw)


def _refused(prefix, pattern):
    with pytest.raises(DataError) as e:
        MegatronIndexed(prefix)
    msg = str(e.value)
    assert "\n" not in msg
    assert re.search(pattern, msg), msg
    return msg


def test_wrong_magic(pair, tmp_path):
    bad = _copy(pair[0], tmp_path)
    _poke(bad + ".idx", 0, b"TNTIDX\x00\x00\x00")
    msg = _refused(bad, r"starts with b'TNTIDX\\x00\\x00\\x00', not the Megatron index magic b'MMIDIDX\\x00\\x00'")
    assert msg.startswith(bad + ".idx ")


def test_wrong_version_and_dtype_codes(pair, tmp_path):
    bad = _copy(pair[0], tmp_path)
    _poke(bad + ".idx", 9, (2).to_bytes(8, "little"))
    assert _refused(bad, "has format version 2; only version 1").startswith(bad + ".idx ")
    for code, pattern in [(9, "has dtype code 9, not one of the known codes 1 uint8, .*8 uint16"),
                          (0, "has dtype code 0"),
                          (6, r"stores float64 values \(dtype code 6\), which are not token ids"),
                          (7, r"stores float32 values \(dtype code 7\)")]:
        bad = _copy(pair[0], tmp_path, f"code{code}")
        _poke(bad + ".idx", 17, bytes([code]))
        assert _refused(bad, pattern).startswith(bad + ".idx ")


def test_truncated_idx(pair, tmp_path):
    prefix, s, d = pair
    bad = _copy(prefix, tmp_path)
    size = os.path.getsize(bad + ".idx")
    os.truncate(bad + ".idx", size - 8)
    _refused(bad, rf"corpus\.idx is truncated: its header counts {s} sequences and {d} document indices, which "
                  rf"need {size} bytes, but the file holds {size - 8}")
    os.truncate(bad + ".idx", 20)
    _refused(bad, "is truncated: 20 bytes, shorter than the 34-byte header")
    os.truncate(bad + ".idx", 0)
    _refused(bad, r"starts with b'', not the Megatron index magic")


def test_trailing_bytes_and_multimodal(pair, tmp_path):
    prefix, s, _ = pair
    bad = _copy(prefix, tmp_path)
    with open(bad + ".idx", "ab") as f:
        f.write(b"\x00\x01\x02")
    _refused(bad, rf"has 3 bytes after its document indices: neither nothing nor a modes array of {s} bytes")
    # megatron-core's own multimodal pair: the modes array is there (its reader reads it), and it is refused
    mm = _write(str(tmp_path / "mm"), _docs(np.uint16), np.uint16, multimodal=True)
    assert IndexedDataset(mm, multimodal=True).index.sequence_modes.tolist() == [
        k % 2 for doc in _docs(np.uint16) for k in range(len(doc))]
    msg = _refused(mm, r"is a multimodal index \(a modes array, modes \[0, 1\]\): only text datasets are read")
    assert msg.startswith(mm + ".idx ")


def test_pointers_and_sizes_inconsistent(pair, tmp_path):
    prefix, s, _ = pair
    bad = _copy(prefix, tmp_path)
    pointers = HEADER + 4 * s
    _poke(bad + ".idx", pointers + 8 * 2, (999).to_bytes(8, "little"))
    # sequences 0 and 1 hold 3 and 1 uint16 tokens: pointer[2] should be (3 + 1) * 2 = 8
    _refused(bad, r"has pointer\[2\] = 999, but pointer\[1\] \+ sizes\[1\] \* 2 = 8: the pointers do not follow")
    bad = _copy(prefix, tmp_path, "first")
    _poke(bad + ".idx", pointers, (2).to_bytes(8, "little"))
    _refused(bad, "has its first sequence pointer at byte 2, not 0")
    bad = _copy(prefix, tmp_path, "negative")
    _poke(bad + ".idx", HEADER + 4 * 1, (-1).to_bytes(4, "little", signed=True))
    _refused(bad, r"gives sequence 1 a negative size \(-1 tokens\)")


def test_document_indices_inconsistent(pair, tmp_path):
    prefix, s, d = pair
    docs = HEADER + 12 * s
    for name, k, value, pattern in [
            ("start", 0, 1, "has document indices that do not start at 0 \\(the first is 1\\)"),
            ("down", 3, 1, "has decreasing document indices: index 3 is 1, after 2"),
            ("end", d - 1, s - 1, f"has document indices that end at {s - 1}, not at its sequence count {s}")]:
        bad = _copy(prefix, tmp_path, name)
        _poke(bad + ".idx", docs + 8 * k, value.to_bytes(8, "little"))
        _refused(bad, pattern)


def test_bin_not_what_the_idx_describes(pair, tmp_path):
    prefix, _, _ = pair
    m = MegatronIndexed(prefix)
    want = m.num_tokens * 2
    bad = _copy(prefix, tmp_path)
    os.truncate(bad + ".bin", want - 6)
    msg = _refused(bad, rf"holds {want - 6:,} bytes but corpus\.idx describes {want:,} \({m.num_tokens:,} tokens of "
                        r"uint16\): the two files are not a pair, or the \.bin was cut short")
    assert msg.startswith(bad + ".bin ")
    # the .idx of another pair of the same dtype
    other = _write(str(tmp_path / "other"), _docs(np.uint16)[:3], np.uint16)
    bad = _copy(prefix, tmp_path, "swapped")
    shutil.copyfile(other + ".idx", bad + ".idx")
    _refused(bad, rf"corpus\.bin holds {want:,} bytes but corpus\.idx describes {MegatronIndexed(other).num_tokens * 2}")
    os.remove(bad + ".bin")
    _refused(bad, r"corpus\.bin does not exist")


def test_megatron_prefixes(tmp_path):
    a = _write(str(tmp_path / "b_text_document"), [[[1]]], np.uint16)
    b = _write(str(tmp_path / "a_text_document"), [[[2]]], np.uint16)
    assert megatron_prefixes(a) == [a]
    assert megatron_prefixes(a + ".bin") == [a]
    assert megatron_prefixes(a + ".idx") == [a]
    assert megatron_prefixes(str(tmp_path)) == [b, a]  # sorted by name
    assert megatron_prefixes(tmp_path) == [b, a]
    with open(tmp_path / "notes.txt", "w") as f:
        f.write("other files in the directory are left alone")

    def refused(path, pattern):
        with pytest.raises(ConfigError) as e:
            megatron_prefixes(path)
        assert "\n" not in str(e.value) and re.search(pattern, str(e.value)), str(e.value)

    os.makedirs(tmp_path / "empty")
    refused(str(tmp_path / "empty"), r"empty holds no Megatron dataset \(no \.bin/\.idx pair\)")
    refused(str(tmp_path / "nope"), "nope does not exist, and neither .*nope.bin nor .*nope.idx exists")
    refused(str(tmp_path / "notes.txt"), r"notes\.txt is not a \.bin/\.idx pair")
    os.remove(a + ".idx")
    refused(a, r"b_text_document\.bin has no b_text_document\.idx beside it")
    refused(str(tmp_path), r"b_text_document\.bin has no b_text_document\.idx beside it")
    os.remove(b + ".bin")
    refused(b + ".idx", r"a_text_document\.idx has no a_text_document\.bin beside it")

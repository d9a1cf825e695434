"""Read Megatron-LM / Megatron-DeepSpeed indexed datasets (a ``.bin`` + ``.idx`` pair),
so data that is already tokenised trains without being tokenised again.

The format. ``prefix.bin`` is every token back to back in one dtype, nothing else.
``prefix.idx`` is little-endian, unpadded:

    9 bytes   magic b"MMIDIDX\\x00\\x00"
    uint64    version, 1
    uint8     dtype code: 1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 6 float64, 7 float32, 8 uint16
    uint64    S, the number of sequences
    uint64    D, the number of document indices (documents + 1)
    int32[S]  sizes: tokens per sequence
    int64[S]  pointers: byte offset of each sequence in the .bin
    int64[D]  document indices: document i is sequences [doc[i], doc[i+1]), concatenated
    int8[S]   modes, only in megatron-core's multimodal datasets

A sequence is a sentence when Megatron-LM's tools/preprocess_data.py ran with
``--split-sentences``, otherwise the whole document; a document may hold no sequences
(preprocess_data.py writes one for a text that tokenises to nothing) and then reads as
an empty array. Checked against megatron-core 0.16.1 (IndexedDatasetBuilder, the writer
preprocess_data.py drives, and its IndexedDataset reader) and datatrove 0.10.1
(pipeline/tokens/megatron_tokenizer.py, which writes uint16, or int32 for a vocabulary
over 65,536).

Refused, each with a one-line DataError naming the file: a wrong magic, version or
dtype code; float dtypes (codes 6, 7: not token ids); an .idx shorter than its header's
counts need, or with trailing bytes that are not a modes array; pointers that do not
follow from the sizes; document indices that do not run from 0 up to S; a .bin whose
size is not what the .idx describes. A multimodal dataset (a modes array present) is
refused too: the format does not say which mode is text, so reading some sequences
and leaving out others would be a guess; export the text as its own dataset.

Tokens come as stored (read-only arrays of the stored dtype, views of the memory-mapped
.bin); the caller checks them against its vocabulary. Whether each document ends with
an end-of-document token is the writer's choice and is not recorded in the files:
preprocess_data.py appends one only with ``--append-eod``, datatrove appends its
``eos_token`` ("<|endoftext|>" by default) unless given None. Look at the last tokens.
"""

import os

import numpy as np

from ds_ext.errors import ConfigError, DataError

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float32,
          8: np.uint16}
_FLOAT_CODES = (6, 7)
_HEADER = np.dtype([("magic", "u1", (9,)), ("version", "<u8"), ("code", "u1"), ("num_sequences", "<u8"),
                    ("num_doc_indices", "<u8")])
assert _HEADER.itemsize == 34
_CHUNK = 1 << 22  # elements per step when checking the index arrays, to bound the memory used


def megatron_prefixes(path):
    """The sorted prefixes of the Megatron datasets at ``path``: a prefix (the files
    being prefix.bin and prefix.idx), the .bin or .idx itself, or a directory holding
    one or more pairs. ConfigError when nothing matches or a file lacks its partner."""
    path = os.fspath(path)
    if os.path.isdir(path):
        names = sorted(os.listdir(path))
        stems = {n[:-4] for n in names if n.endswith((".bin", ".idx")) and os.path.isfile(os.path.join(path, n))}
        if not stems:
            raise ConfigError(f"{path} holds no Megatron dataset (no .bin/.idx pair): point the source at a "
                              f"directory of prefix.bin + prefix.idx pairs, or at one prefix")
        for stem in sorted(stems):
            _check_pair(os.path.join(path, stem))
        return [os.path.join(path, stem) for stem in sorted(stems)]
    prefix = path[:-4] if path.endswith((".bin", ".idx")) else path
    if not (os.path.exists(prefix + ".bin") or os.path.exists(prefix + ".idx")):
        what = "is not a .bin/.idx pair" if os.path.exists(path) else "does not exist"
        raise ConfigError(f"{path} {what}, and neither {prefix}.bin nor {prefix}.idx exists: give a Megatron "
                          f"dataset as its prefix (the path without .bin/.idx), either file, or their directory")
    _check_pair(prefix)
    return [prefix]


def _check_pair(prefix):
    for have, lack in ((".bin", ".idx"), (".idx", ".bin")):
        if os.path.exists(prefix + have) and not os.path.exists(prefix + lack):
            raise ConfigError(f"{prefix}{have} has no {os.path.basename(prefix)}{lack} beside it: a Megatron "
                              f"dataset is a .bin + .idx pair; copy the missing file or remove the lone one")


def _n(x):
    return f"{int(x):,}"


class MegatronIndexed:
    """One Megatron dataset, opened and validated against its .bin before anything is
    read: ``num_documents``, ``num_tokens``, ``dtype``, ``document(i)`` and
    ``documents(start, stop)``. Documents are read lazily from the memory-mapped .bin,
    so a worker reading one range touches only that range. Pickles as its prefix (the
    copy reopens and checks the files again)."""

    def __init__(self, prefix):
        self.prefix = os.fspath(prefix)
        self.idx_path, self.bin_path = self.prefix + ".idx", self.prefix + ".bin"
        for p in (self.idx_path, self.bin_path):
            if not os.path.isfile(p):
                raise DataError(f"{p} does not exist: a Megatron dataset is prefix.bin + prefix.idx; give the "
                                f"prefix of an existing pair")
        self._idx_name, self._bin_name = os.path.basename(self.idx_path), os.path.basename(self.bin_path)
        code = self._read_header()
        self.dtype = np.dtype(DTYPES[code])
        self._read_arrays()
        self._check_pointers()
        self._check_document_indices()
        self._open_bin()

    def __reduce__(self):
        return (type(self), (self.prefix,))

    def _error(self, what):
        return DataError(f"{self.idx_path} {what}")

    def _read_header(self):
        self._idx_size = os.path.getsize(self.idx_path)
        with open(self.idx_path, "rb") as f:
            raw = f.read(_HEADER.itemsize)
        magic = raw[:len(MAGIC)]
        if magic != MAGIC:
            raise self._error(f"starts with {magic!r}, not the Megatron index magic {MAGIC!r}: it is not a "
                              f"Megatron .idx file (give the prefix of a Megatron-LM/datatrove .bin + .idx pair)")
        if len(raw) < _HEADER.itemsize:
            raise self._error(f"is truncated: {self._idx_size} bytes, shorter than the {_HEADER.itemsize}-byte "
                              f"header; write the index again")
        h = np.frombuffer(raw, dtype=_HEADER)[0]
        if int(h["version"]) != VERSION:
            raise self._error(f"has format version {int(h['version'])}; only version {VERSION} (Megatron-LM, "
                              f"Megatron-DeepSpeed, datatrove) is read")
        code = int(h["code"])
        if code not in DTYPES:
            raise self._error(f"has dtype code {code}, not one of the known codes "
                              f"{', '.join(f'{c} {np.dtype(t).name}' for c, t in DTYPES.items())}")
        if code in _FLOAT_CODES:
            raise self._error(f"stores {np.dtype(DTYPES[code]).name} values (dtype code {code}), which are not "
                              f"token ids: tokenise into an integer dtype (uint16 or int32)")
        self.num_sequences, self._num_doc_indices = int(h["num_sequences"]), int(h["num_doc_indices"])
        return code

    def _read_arrays(self):
        s, d = self.num_sequences, self._num_doc_indices
        need = _HEADER.itemsize + 4 * s + 8 * s + 8 * d
        if self._idx_size < need:
            raise self._error(f"is truncated: its header counts {_n(s)} sequences and {_n(d)} document indices, "
                              f"which need {_n(need)} bytes, but the file holds {_n(self._idx_size)}; write the "
                              f"index again")
        extra = self._idx_size - need
        if extra and extra != s:
            raise self._error(f"has {_n(extra)} bytes after its document indices: neither nothing nor a "
                              f"modes array of {_n(s)} bytes (one per sequence); the file is damaged or not "
                              f"this format")
        if extra:
            modes = np.unique(self._array(np.int8, need, s)).tolist()
            raise self._error(f"is a multimodal index (a modes array, modes {modes}): only text datasets are "
                              f"read, since the format does not say which mode is text; export the text "
                              f"sequences as a dataset of their own")
        self._sizes = self._array(np.int32, _HEADER.itemsize, s)
        self._pointers = self._array(np.int64, _HEADER.itemsize + 4 * s, s)
        self._doc_indices = self._array(np.int64, _HEADER.itemsize + 12 * s, d)

    def _array(self, dtype, offset, count):
        if count == 0:
            return np.empty(0, dtype=dtype)
        return np.asarray(np.memmap(self.idx_path, dtype=np.dtype(dtype).newbyteorder("<"), mode="r",
                                    offset=offset, shape=(count,)))

    def _check_pointers(self):
        s, item = self.num_sequences, self.dtype.itemsize
        if s and self._pointers[0] != 0:
            raise self._error(f"has its first sequence pointer at byte {_n(self._pointers[0])}, not 0: the "
                              f"pointers do not follow from the sizes")
        for lo in range(0, s, _CHUNK):
            sizes = self._sizes[lo:lo + _CHUNK]
            bad = np.flatnonzero(sizes < 0)
            if bad.size:
                i = lo + int(bad[0])
                raise self._error(f"gives sequence {_n(i)} a negative size ({_n(self._sizes[i])} tokens)")
            ends = self._pointers[lo:lo + _CHUNK] + sizes.astype(np.int64) * item
            nxt = self._pointers[lo + 1:lo + _CHUNK + 1]
            bad = np.flatnonzero(ends[:nxt.size] != nxt)
            if bad.size:
                i = lo + int(bad[0])
                raise self._error(f"has pointer[{_n(i + 1)}] = {_n(self._pointers[i + 1])}, but pointer[{_n(i)}] "
                                  f"+ sizes[{_n(i)}] * {item} = {_n(ends[bad[0]])}: the pointers do not follow "
                                  f"from the sizes")
        self.num_tokens = 0 if s == 0 else (int(self._pointers[-1]) + int(self._sizes[-1]) * item) // item

    def _check_document_indices(self):
        d, s = self._num_doc_indices, self.num_sequences
        docs = self._doc_indices
        if d == 0 or docs[0] != 0:
            first = "none" if d == 0 else _n(docs[0])
            raise self._error(f"has document indices that do not start at 0 (the first is {first})")
        for lo in range(0, d - 1, _CHUNK):
            step = np.diff(docs[lo:lo + _CHUNK + 1])
            bad = np.flatnonzero(step < 0)
            if bad.size:
                i = lo + int(bad[0])
                raise self._error(f"has decreasing document indices: index {_n(i + 1)} is {_n(docs[i + 1])}, "
                                  f"after {_n(docs[i])}")
        if docs[-1] != s:
            raise self._error(f"has document indices that end at {_n(docs[-1])}, not at its sequence count "
                              f"{_n(s)}")
        self.num_documents = d - 1

    def _open_bin(self):
        have, want = os.path.getsize(self.bin_path), self.num_tokens * self.dtype.itemsize
        if have != want:
            raise DataError(f"{self.bin_path} holds {_n(have)} bytes but {self._idx_name} describes {_n(want)} "
                            f"({_n(self.num_tokens)} tokens of {self.dtype.name}): the two files are not a pair, "
                            f"or the .bin was cut short")
        if want == 0:
            self._tokens = np.empty(0, dtype=self.dtype)
        else:
            self._tokens = np.asarray(np.memmap(self.bin_path, dtype=self.dtype.newbyteorder("<"), mode="r",
                                                shape=(self.num_tokens,)))

    def _token_range(self, first_seq, end_seq):
        """Token offsets [a, b) of sequences first_seq..end_seq-1, contiguous in the .bin
        because the pointers were checked to follow from the sizes."""
        if first_seq == end_seq:
            return 0, 0
        a = int(self._pointers[first_seq]) // self.dtype.itemsize
        b = int(self._pointers[end_seq - 1]) // self.dtype.itemsize + int(self._sizes[end_seq - 1])
        return a, b

    def document(self, i):
        """The tokens of document ``i`` (its sequences concatenated): a read-only view of
        the .bin in the stored dtype, empty for a document with no sequences."""
        if not 0 <= i < self.num_documents:
            raise IndexError(f"document {i} is out of range: {self.prefix} has {self.num_documents} documents")
        a, b = self._token_range(int(self._doc_indices[i]), int(self._doc_indices[i + 1]))
        return self._tokens[a:b]

    def documents(self, start, stop):
        """An iterator over documents ``start`` .. ``stop - 1`` in order, each as
        ``document(i)`` gives it; the range is checked when called."""
        if not 0 <= start <= stop <= self.num_documents:
            raise ValueError(f"documents({start}, {stop}) is not a range within the {self.num_documents} "
                             f"documents of {self.prefix}: need 0 <= start <= stop <= {self.num_documents}")
        return self._iter_documents(start, stop)

    def _iter_documents(self, start, stop):
        for lo in range(start, stop, _CHUNK):
            bounds = self._doc_indices[lo:min(stop, lo + _CHUNK) + 1]
            for first, end in zip(bounds[:-1].tolist(), bounds[1:].tolist()):
                a, b = self._token_range(first, end)
                yield self._tokens[a:b]

    def __len__(self):
        return self.num_documents

    def __repr__(self):
        return (f"MegatronIndexed({self.prefix!r}: {self.num_documents:,} documents, {self.num_sequences:,} "
                f"sequences, {self.num_tokens:,} tokens of {self.dtype.name})")

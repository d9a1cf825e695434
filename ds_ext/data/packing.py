"""Tokenise documents, pack them into fixed-length sequences, and iterate micro-batches."""

import numpy as np
import torch

from ds_ext.errors import DataError

from .sources import load_documents
from .textfiles import undecodable_counts
from .tokenizer import _check_ids


def packed_sequences(data, tokenizer, *, vocab_size, shard, num_shards, stats=None):
    """This data-parallel shard's documents, tokenised with an end-of-document token
    after each and cut into rows of ``seq_len + 1`` tokens (inputs plus the shifted
    targets). Documents are sharded contiguously and balanced by characters before
    tokenisation, so each rank only tokenises its own part (it still reads and filters
    the whole corpus). Tokens are held in memory as int32. ``stats`` (a dict), when
    given, gets the corpus's counts of documents whose undecodable bytes were
    ``replaced`` or that were ``skipped`` (data.encoding_errors)."""
    ds, field = load_documents(data)
    if stats is not None:
        stats["replaced"], stats["skipped"] = undecodable_counts(ds)
    ds = ds.filter(lambda batch: [isinstance(t, str) and bool(t) for t in batch[field]], batched=True,
                   keep_in_memory=True)
    if len(ds) == 0:
        raise DataError(f"the corpus {data.source} has no non-empty documents in column {field!r}: "
                        f"add data or fix seekspeed.data.text_field")
    if data.max_documents is not None:
        ds = ds.select(range(min(data.max_documents, len(ds))))
    if len(ds) < num_shards:
        raise DataError(f"the corpus {data.source} has {len(ds)} documents, fewer than the {num_shards} "
                        f"data-parallel replicas that each need a shard: add documents or use fewer replicas")
    start, stop = _balanced_range(ds, field, shard=shard, num_shards=num_shards)
    if start == stop:
        raise DataError(f"data-parallel shard {shard} of {data.source} gets no documents (a few documents hold "
                        f"most of the text): add documents or use fewer replicas")
    ds = ds.select(range(start, stop))
    # numpy rows take datasets' direct Arrow path; lists of Python ints would have it infer
    # the type element by element, several times slower for the same rows
    tokens = ds.map(lambda batch: {"input_ids": [np.asarray(ids, dtype=np.int32)
                                                 for ids in tokenizer.encode_documents(batch[field])]}, batched=True,
                    num_proc=data.num_proc if data.num_proc > 1 else None, remove_columns=ds.column_names,
                    keep_in_memory=True)
    flat = tokens.data.column("input_ids").combine_chunks().flatten().to_numpy(zero_copy_only=False)
    flat = flat.astype(np.int32)
    _check_ids(flat, vocab_size)
    row = data.seq_len + 1
    rows = len(flat) // row
    if rows == 0:
        raise DataError(f"data-parallel shard {shard} of {data.source} has {len(flat)} tokens, fewer than one "
                        f"sequence of seq_len + 1 = {row}: add data or lower seekspeed.data.seq_len")
    return flat[:rows * row].reshape(rows, row)


def _balanced_range(ds, field, *, shard, num_shards):
    """Contiguous documents [start, stop) of ``shard``, cut so that every shard gets
    about the same number of characters (a document goes where its middle falls)."""
    import pyarrow.compute as pc
    lengths = pc.utf8_length(ds.with_format("arrow")[field]).to_numpy(zero_copy_only=False).astype(np.int64)
    ends = np.cumsum(lengths)
    owner = np.minimum((num_shards * (ends - lengths / 2) / ends[-1]).astype(np.int64), num_shards - 1)
    docs = np.flatnonzero(owner == shard)
    return (int(docs[0]), int(docs[-1]) + 1) if len(docs) else (0, 0)


class PackedBatches:
    """Endless micro-batches ``(input_ids, labels)`` over packed rows, reshuffled each
    epoch by a seeded permutation. ``position`` counts micro-batches served, so a
    resumed run can continue at the same sample (``start``, or ``seek``). The rows are
    this replica's cut of ``num_shards`` (data-parallel replicas, each as many rows a
    step)."""

    def __init__(self, sequences, *, micro_batch, seed, start=0, num_shards=1):
        if len(sequences) < micro_batch:
            raise DataError(f"only {len(sequences)} packed sequences on this data-parallel shard, fewer than "
                            f"train_micro_batch_size_per_gpu {micro_batch}: add data or lower the micro-batch")
        self.sequences = torch.from_numpy(sequences)
        self.micro_batch = micro_batch
        self.seed = seed
        self.per_epoch = len(sequences) // micro_batch
        self.position = start
        self.num_shards = num_shards
        self._epoch, self._order = None, None

    def seek(self, start_row):
        """Continue after ``start_row`` rows of the whole run (DeepSpeed's
        ``global_samples``): this replica served 1 / num_shards of them, a micro-batch
        per position. A resume keeps the replicas and the micro-batch (checkpointer's
        resume check), so the rows divide evenly."""
        position, rest = divmod(int(start_row), self.num_shards * self.micro_batch)
        assert rest == 0, f"{start_row} rows do not divide into {self.num_shards} replicas x {self.micro_batch}"
        self.position = position

    def _epoch_order(self, epoch):
        if self._epoch != epoch:
            g = torch.Generator().manual_seed(self.seed * 100_003 + epoch)
            self._epoch, self._order = epoch, torch.randperm(len(self.sequences), generator=g)
        return self._order

    def __iter__(self):
        return self

    def __next__(self):
        epoch, index = divmod(self.position, self.per_epoch)
        rows = self._epoch_order(epoch)[index * self.micro_batch:(index + 1) * self.micro_batch]
        self.position += 1
        batch = self.sequences[rows].long()
        return batch[:, :-1].contiguous(), batch[:, 1:].contiguous()

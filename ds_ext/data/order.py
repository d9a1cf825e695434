"""One deterministic global sample order per epoch, sharded over data-parallel ranks.

Epoch ``e``'s order is a seeded permutation of every packed row: the shards are
permuted, then the rows inside each window of ``window`` consecutive shards of that
order are permuted. Every row appears once per epoch, and a stretch of the order
touches only a few shards, which is what lets a hot tier of a few shards serve it.
Micro-step ``m`` of an epoch takes rows ``[m*D*B, (m+1)*D*B)`` of the order; data-
parallel rank ``r`` gets the ``r``-th block of ``B`` of them. The order depends only
on (rows per shard, seed, epoch, window), never on where the bytes are.
"""

import numpy as np


class SampleOrder:

    def __init__(self, shard_rows, *, seed, window, dp_size, micro_batch):
        self.shard_rows = np.asarray(shard_rows, dtype=np.int64)
        self.starts = np.concatenate([[0], np.cumsum(self.shard_rows)[:-1]])
        self.num_rows = int(self.shard_rows.sum())
        self.seed, self.window = seed, max(1, window)
        self.dp_size, self.micro_batch = dp_size, micro_batch
        self.per_step = dp_size * micro_batch
        self.steps_per_epoch = self.num_rows // self.per_step
        self._cache = (None, None)

    def epoch(self, epoch):
        """The global order of rows for ``epoch`` (int64 row ids)."""
        if self._cache[0] == epoch:
            return self._cache[1]
        rng = np.random.default_rng([self.seed, epoch])
        shards = rng.permutation(len(self.shard_rows))
        parts = []
        for i in range(0, len(shards), self.window):
            group = shards[i:i + self.window]
            rows = np.concatenate([np.arange(self.starts[s], self.starts[s] + self.shard_rows[s]) for s in group])
            parts.append(rng.permutation(rows))
        order = np.concatenate(parts)
        self._cache = (epoch, order)
        return order

    def rows(self, position, dp_rank):
        """Row ids of micro-batch ``position`` (micro-batches served so far) of ``dp_rank``."""
        epoch, step = divmod(position, self.steps_per_epoch)
        start = step * self.per_step + dp_rank * self.micro_batch
        return self.epoch(epoch)[start:start + self.micro_batch]

    def shard_of(self, rows):
        return np.searchsorted(self.starts, rows, side="right") - 1

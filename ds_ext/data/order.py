"""One deterministic global sample order per epoch, sharded over data-parallel ranks.

Epoch ``e``'s order is a seeded permutation of every packed row: the shards are
permuted, then the rows inside each window of ``window`` consecutive shards of that
order are permuted. Every row appears once per epoch, and a stretch of the order
touches only a few shards, which is what lets a hot tier of a few shards serve it.
The epochs, one after the other, make one endless stream of rows. A run that has
consumed ``start_row`` rows (DeepSpeed's ``global_samples``) takes, at micro-step
``m``, the next ``D*B`` rows of the stream, ``[start_row + m*D*B, start_row +
(m+1)*D*B)``; data-parallel rank ``r`` gets the ``r``-th block of ``B`` of them. A
resumed run with another data-parallel degree or micro-batch therefore continues at
exactly the next row: every row of an epoch once, none repeated (a step may span the
end of an epoch). The order depends only on (rows per shard, seed, epoch, window,
mixture), never on where the bytes are.

A mixture (several sources with weights): an epoch holds as many rows as all sources
together, ``weight / sum(weights)`` of them from each source. Each source walks its
own windowed permutation, epoch after epoch of its own (a small source repeats, a
large one continues where it stopped), and the sources are interleaved evenly (item
``j`` of source ``i`` sits at ``(j + 1/2) / count_i`` of the epoch), so every stretch
of the order keeps the proportions.
"""

import numpy as np


class SampleOrder:

    def __init__(self, shard_rows, *, seed, window, dp_size, micro_batch, sources=None, weights=None, start_row=0):
        self.shard_rows = np.asarray(shard_rows, dtype=np.int64)
        self.starts = np.concatenate([[0], np.cumsum(self.shard_rows)[:-1]])
        self.num_rows = int(self.shard_rows.sum())
        self.seed, self.window = seed, max(1, window)
        self.dp_size, self.micro_batch = dp_size, micro_batch
        self.per_step = dp_size * micro_batch
        self.start_row = start_row
        sources = np.zeros(len(self.shard_rows), dtype=np.int64) if sources is None else np.asarray(sources)
        self.num_sources = int(sources.max()) + 1
        self._source_shards = [np.flatnonzero(sources == i) for i in range(self.num_sources)]
        weights = [1.0] * self.num_sources if weights is None else list(weights)
        if self.num_sources == 1:
            self.counts = [self.num_rows]
        else:
            total = sum(weights)
            self.counts = [max(1, round(w / total * self.num_rows)) for w in weights]
        self.epoch_len = sum(self.counts)
        self.steps_per_epoch = self.epoch_len // self.per_step
        self._epochs = {}
        self._source_cache = {}

    def _windowed(self, shards, rng):
        shards = rng.permutation(shards)
        parts = []
        for i in range(0, len(shards), self.window):
            group = shards[i:i + self.window]
            rows = np.concatenate([np.arange(self.starts[s], self.starts[s] + self.shard_rows[s]) for s in group])
            parts.append(rng.permutation(rows))
        return np.concatenate(parts)

    def _source_epoch(self, source, k):
        key = (source, k)
        out = self._source_cache.get(key)
        if out is None:
            out = self._windowed(self._source_shards[source], np.random.default_rng([self.seed, source, k]))
            if len(self._source_cache) > 4 * self.num_sources:
                self._source_cache = {}
            self._source_cache[key] = out
        return out

    def _source_stream(self, source, start, stop):
        """Items [start, stop) of ``source``'s endless sequence of its own epochs."""
        n = int(self.shard_rows[self._source_shards[source]].sum())
        out = []
        while start < stop:
            k, off = divmod(start, n)
            take = min(stop - start, n - off)
            out.append(self._source_epoch(source, k)[off:off + take])
            start += take
        return np.concatenate(out)

    def epoch(self, epoch):
        """The global order of rows for ``epoch`` (int64 row ids)."""
        cached = self._epochs.get(epoch)       # the reader and its prefetcher look at two epochs
        if cached is not None:
            return cached
        if self.num_sources == 1:
            order = self._windowed(np.arange(len(self.shard_rows)), np.random.default_rng([self.seed, epoch]))
        else:
            rows, keys = [], []
            for i, c in enumerate(self.counts):
                rows.append(self._source_stream(i, epoch * c, (epoch + 1) * c))
                keys.append((np.arange(c) + 0.5) / c)
            order = np.concatenate(rows)[np.argsort(np.concatenate(keys), kind="stable")]
        self._epochs = {e: o for e, o in self._epochs.items() if epoch - 1 <= e <= epoch + 1} | {epoch: order}
        return order

    def at(self, offsets):
        """Row ids at ``offsets`` of the endless stream (epoch ``e`` at ``[e L, (e + 1) L)``)."""
        offsets = np.asarray(offsets, dtype=np.int64)
        epochs, index = np.divmod(offsets, self.epoch_len)
        out = np.empty_like(offsets)
        for e in np.unique(epochs):
            mask = epochs == e
            out[mask] = self.epoch(int(e))[index[mask]]
        return out

    def offsets(self, positions, dp_rank):
        """Stream offsets of micro-batches ``positions`` (micro-batches served since
        ``start_row``) of ``dp_rank``: shape ``positions.shape + (micro_batch,)``."""
        positions = np.asarray(positions, dtype=np.int64)
        return (self.start_row + positions[..., None] * self.per_step + dp_rank * self.micro_batch
                + np.arange(self.micro_batch))

    def rows(self, position, dp_rank):
        """Row ids of micro-batch ``position`` (micro-batches served since ``start_row``) of ``dp_rank``."""
        return self.at(self.offsets(position, dp_rank))

    def shard_of(self, rows):
        return np.searchsorted(self.starts, rows, side="right") - 1

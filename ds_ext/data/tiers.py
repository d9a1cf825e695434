"""Hot/cold tiers under the packed shards, and the micro-batch iterator over them.

Cold tier: where every shard lives (a slow shared path, or an fsspec URL). Hot tier:
a local fast directory holding at most ``budget`` bytes of shards, memory-mapped. A
background prefetcher walks this rank's known future order and copies the shards
it will need next from cold to hot; when the budget is full it evicts, with policy
``next-use``, the resident shard whose next use is farthest away (Belady's rule,
possible because the order is known), or, with ``lru``, the least recently used one.
Without a hot tier every row is read from the cold tier when it is needed. With
``data.hot_scope: node`` the readers of a node share one directory and one budget
(ds_ext/data/node_tier.py); HotTier here is one reader's own (``hot_scope: rank``).

None of this changes which rows a micro-batch holds: that is SampleOrder's alone.
"""

import collections
import os
import shutil
import threading
import time

import numpy as np
import torch

from ds_ext.errors import DataError
from ds_ext.fileio import atomic_open

from .node_tier import check_budget


class ColdTier:
    """Reads shards from ``root`` (a local path or an fsspec URL), retrying with
    exponential back-off before failing with an error that names the path.
    ``throttle_mb_s`` caps the read rate and ``latency_ms`` is added to every request
    (benchmarks: a slow shared store; this kernel's tc has no netem for latency)."""

    def __init__(self, root, *, retries=4, backoff_s=0.5, throttle_mb_s=None, latency_ms=0.0):
        self.root = str(root)
        self.latency_s = latency_ms / 1000.0
        self.retries, self.backoff_s = retries, backoff_s
        self.throttle = throttle_mb_s * 1e6 if throttle_mb_s else None
        self._lock = threading.Lock()
        self._next_free = time.monotonic()
        self.bytes_read = 0

    def _url(self, name):
        return f"{self.root.rstrip('/')}/{name}"

    def _open(self, name):
        if self.latency_s:
            time.sleep(self.latency_s)
        if "://" in self.root:
            import fsspec
            return fsspec.open(self._url(name), "rb").open()
        return open(os.path.join(self.root, name), "rb")

    def _pace(self, nbytes):
        """Hold the caller until ``nbytes`` fit under the throttle (one shared link)."""
        self.bytes_read += nbytes
        if self.throttle is None:
            return
        with self._lock:
            start = max(self._next_free, time.monotonic())
            self._next_free = start + nbytes / self.throttle
            wait = self._next_free - time.monotonic()
        if wait > 0:
            time.sleep(wait)

    def _retrying(self, what, fn):
        delay = self.backoff_s
        for attempt in range(self.retries + 1):
            try:
                return fn()
            except OSError as exc:
                if attempt == self.retries:
                    raise DataError(f"cold tier: cannot read {what} ({exc.__class__.__name__}: {exc}) after "
                                    f"{self.retries + 1} tries over {self.backoff_s * (2 ** self.retries - 1):.1f} s; "
                                    f"check that seekspeed.data.cache_dir is reachable") from None
                time.sleep(delay)
                delay *= 2

    def header(self, name):
        def go():
            with self._open(name) as f:
                return npy_header_bytes(f)
        return self._retrying(self._url(name), go)

    def read_rows(self, name, offsets, *, row_bytes, header):
        """Rows at ``offsets`` of shard ``name`` (direct reads, no hot tier)."""
        def go():
            with self._open(name) as f:
                out = []
                for i, off in enumerate(offsets):
                    if i and self.latency_s:       # every row is its own request
                        time.sleep(self.latency_s)
                    f.seek(header + int(off) * row_bytes)
                    data = f.read(row_bytes)
                    if len(data) != row_bytes:
                        raise OSError(f"{self._url(name)} ends early")
                    self._pace(row_bytes)
                    out.append(data)
                return out
        return self._retrying(self._url(name), go)

    def copy_to(self, name, dest, *, chunk=4 << 20):
        """Copy shard ``name`` to the local path ``dest`` (temporary file, then rename)."""
        def go():
            with self._open(name) as src, atomic_open(dest, "wb") as out:
                while True:
                    data = src.read(chunk)
                    if not data:
                        break
                    self._pace(len(data))
                    out.write(data)
        return self._retrying(self._url(name), go)


def npy_header_bytes(f):
    """Bytes before the array data of the .npy file open as ``f``."""
    import numpy.lib.format as npf
    version = npf.read_magic(f)
    if version == (1, 0):
        npf.read_array_header_1_0(f)
    elif version == (2, 0):
        npf.read_array_header_2_0(f)
    else:
        raise OSError(f"unsupported .npy version {version}")
    return f.tell()


class TierStats:

    def __init__(self):
        self.hits = self.misses = 0
        self.bytes_fetched = 0
        self.wait_s = 0.0          # time micro-batches waited for data
        self.batches = 0

    def figures(self):
        total = self.hits + self.misses
        return {"hit_rate": self.hits / total if total else None, "hits": self.hits, "misses": self.misses,
                "bytes_fetched": self.bytes_fetched, "wait_s": self.wait_s, "batches": self.batches}


class HotTier:
    """Shards copied from ``cold`` into ``directory`` under a byte ``budget``, one
    reader's own (``hot_scope: rank``)."""

    scope = "rank"

    def __init__(self, store, cold, directory, *, budget_bytes, policy, stats, min_shards=1):
        if policy not in ("next-use", "lru"):
            raise ValueError(f"unknown eviction policy {policy!r}")
        check_budget(store, budget_bytes, min_shards)
        self.store, self.cold, self.dir = store, cold, directory
        self.budget, self.policy, self.stats = budget_bytes, policy, stats
        shutil.rmtree(directory, ignore_errors=True)    # a hot tier is a cache: start empty
        os.makedirs(directory)
        self._resident = collections.OrderedDict()      # shard -> bytes, least recently used first
        # open memory maps, least recently read first: each holds a file descriptor (Python's
        # mmap keeps a duplicate), so a hot tier of thousands of shards would otherwise run
        # into the descriptor limit; a micro-batch reads at most 2 x min_shards of them
        self._arrays = collections.OrderedDict()
        self.max_open = max(8, 2 * min_shards)
        self._fetching = set()
        self._lock = threading.Condition()
        self._used = 0
        self.next_use = lambda shard: float("inf")      # set by the iterator (next-use policy)
        self.pinned = set()

    def _path(self, shard):
        return os.path.join(self.dir, self.store.shard_name(shard).replace("/", "__"))

    def resident(self, shard):
        with self._lock:
            return shard in self._resident

    def _victim(self, exclude):
        candidates = [s for s in self._resident if s not in self.pinned and s not in exclude]
        if not candidates:
            return None
        if self.policy == "lru":
            return candidates[0]
        return max(candidates, key=self.next_use)

    def fetch(self, shard, *, prefetch=False):
        """Make ``shard`` resident. A prefetch gives up (returns False) rather than
        evict a shard needed sooner than ``shard``."""
        size = self.store.shard_bytes(shard)
        with self._lock:
            while True:
                while shard in self._fetching:
                    self._lock.wait()
                if shard in self._resident:
                    return True
                if self._used + size <= self.budget:
                    break
                victim = self._victim({shard})
                if victim is None and not prefetch and self._fetching:
                    self._lock.wait()          # a prefetch in flight holds the room; it ends soon
                    continue
                if victim is None or (prefetch and self.next_use(victim) <= self.next_use(shard)):
                    return False
                self._evict(victim)
            self._fetching.add(shard)
            self._used += size
        try:
            self.cold.copy_to(self.store.shard_name(shard), self._path(shard))
        except BaseException:
            with self._lock:
                self._used -= size
                self._fetching.discard(shard)
                self._lock.notify_all()
            raise
        with self._lock:
            self._fetching.discard(shard)
            self._resident[shard] = size
            self.stats.bytes_fetched += size
            self._lock.notify_all()
        return True

    def _evict(self, shard):
        self._used -= self._resident.pop(shard)
        self._arrays.pop(shard, None)
        try:
            os.unlink(self._path(shard))     # a mapping still in use stays valid until dropped
        except FileNotFoundError:
            pass

    def array(self, shard):
        """The shard's rows, memory-mapped; fetched now (a miss) when not resident."""
        with self._lock:
            hit = shard in self._resident
            if hit:
                self._resident.move_to_end(shard)
        if hit:
            self.stats.hits += 1
        else:
            self.stats.misses += 1
            if not self.fetch(shard):
                raise DataError(f"hot tier {self.dir}: no room for shard {shard} next to the {len(self.pinned)} "
                                f"shards the current micro-batch uses; raise seekspeed.data.hot_budget_mb")
            with self._lock:
                self._resident.move_to_end(shard)
        with self._lock:
            arr = self._arrays.get(shard)
            if arr is None:
                arr = self._arrays[shard] = np.load(self._path(shard), mmap_mode="r")
                while len(self._arrays) > self.max_open:
                    self._arrays.popitem(last=False)      # its map (and descriptor) goes with its last reference
            else:
                self._arrays.move_to_end(shard)
        return arr


class TieredBatches:
    """Endless micro-batches ``(input_ids, labels)`` of one data-parallel rank in
    SampleOrder's order, read through the tiers. ``position`` counts micro-batches
    served since the order's ``start_row`` (``seek`` sets both on resume). The order is
    known, so the next use of every shard is too: the uses of ``node_dp_ranks`` (the
    data-parallel ranks whose readers share ``hot``; this rank alone by default) are
    tabulated per block of about an epoch's micro-steps (this block and the next),
    which the next-use policy and the prefetcher read. With a node tier the next use is
    looked up from ``pin_window`` micro-batches behind this reader's position, and the
    node's uses until ``pin_window`` ahead are protected from eviction: the node's
    readers are within about one optimizer step of each other."""

    def __init__(self, store, order, *, dp_rank, cold, hot=None, prefetch=True, prefetch_shards=None,
                 node_dp_ranks=None, pin_window=0, prefetch_batches=2):
        if order.steps_per_epoch == 0:
            raise DataError(f"{order.num_rows} packed sequences cannot fill one step of {order.dp_size} replicas x "
                            f"micro-batch {order.micro_batch}: add data or lower the batch")
        self.store, self.order, self.dp_rank = store, order, dp_rank
        self.node_dp_ranks = tuple(sorted(set(node_dp_ranks or ()) | {dp_rank}))
        self.pin_window = pin_window
        self.cold, self.hot = cold, hot
        self.stats = hot.stats if hot is not None else TierStats()
        self.row_bytes = store.row_len * store.dtype.itemsize
        self._header = {}
        self._uses_cache = {}
        self._uses_lock = threading.Lock()
        self._position = 0
        self._generation = 0           # bumped by seek and by setting position: plans and read-ahead start again
        self._wake = threading.Event()
        self._stop = False
        self._error = None
        self._thread = None
        # micro-batches assembled ahead of the consumer (DataLoader's prefetch_factor):
        # (generation, position) -> batch, and the ones being assembled now
        self.prefetch_batches = prefetch_batches if prefetch else 0
        self._ready, self._building, self._pins = {}, set(), {}
        self._ready_cv = threading.Condition()
        self._assembler = None
        if self.prefetch_batches:
            self._assembler = threading.Thread(target=self._read_ahead, name="seekspeed-read-ahead", daemon=True)
            self._assembler.start()
        if hot is not None:
            per_shard = max(store.shard_bytes(s) for s in range(len(store.shards)))
            # look as far ahead as the budget holds: a fetch never evicts a shard needed sooner
            self.prefetch_shards = min(prefetch_shards or max(1, hot.budget // per_shard), len(store.shards))
            hot.next_use = self.next_use
            hot.pin_until = lambda: self.position + self.pin_window
            if prefetch:
                self._thread = threading.Thread(target=self._prefetch, name="seekspeed-prefetch", daemon=True)
                self._thread.start()

    @property
    def position(self):
        """Micro-batches served since the order's ``start_row``."""
        return self._position

    @position.setter
    def position(self, value):
        with self._ready_cv:
            self._position = int(value)
            self._generation += 1
            self._ready.clear()
            self._ready_cv.notify_all()
        self._wake.set()

    def seek(self, start_row):
        """Continue at row ``start_row`` of the order's stream (the rows a resumed run has
        consumed), at any data-parallel degree or micro-batch."""
        with self._uses_lock:
            self.order.start_row = int(start_row)
            self._uses_cache = {}
        self.position = 0

    def _uses(self, block):
        """shard -> sorted positions (micro-batches) of ``block`` (positions [block S,
        (block + 1) S), S = steps_per_epoch) at which one of ``node_dp_ranks`` reads it."""
        return self._block(block)[1]

    def _block(self, block):
        """(the shards ``node_dp_ranks`` read at each position of ``block``: (S, ranks x
        micro_batch), in order of use; their uses, as ``_uses``)."""
        with self._uses_lock:
            if block in self._uses_cache:
                return self._uses_cache[block]
            o = self.order
            steps = np.arange(block * o.steps_per_epoch, (block + 1) * o.steps_per_epoch)
            shards = np.concatenate([o.shard_of(o.at(o.offsets(steps, r))) for r in self.node_dp_ranks],
                                    axis=1)                                  # (steps, ranks x micro_batch)
            pairs = np.unique(np.stack([shards.reshape(-1), np.repeat(steps, shards.shape[1])], axis=1), axis=0)
            uses = {}
            for shard, first, last in _runs(pairs[:, 0]):
                uses[int(shard)] = pairs[first:last, 1]
            self._uses_cache = {b: u for b, u in self._uses_cache.items() if b >= block - 1}
            self._uses_cache[block] = shards, uses
            return shards, uses

    def next_use(self, shard, position=None):
        position = max(0, self.position - self.pin_window) if position is None else position
        block = position // self.order.steps_per_epoch
        for e in (block, block + 1):
            arr = self._uses(e).get(shard)
            if arr is not None:
                i = np.searchsorted(arr, position)
                if i < len(arr):
                    return int(arr[i])
        return float("inf")

    def upcoming(self, count):
        """The next ``count`` distinct shards ``node_dp_ranks`` read, in order of first use."""
        per_block = self.order.steps_per_epoch
        seen, m, span = {}, self.position, 8
        limit = self.position + 2 * per_block
        while len(seen) < count and m < limit:
            # positions m .. m + span at once from the tabulated blocks, doubling the span:
            # the prefetcher asks after every micro-batch, so this must be cheap (it holds the GIL)
            stop = min(m + span, limit)
            parts = []
            for block in range(m // per_block, (stop - 1) // per_block + 1):
                lo, hi = max(m, block * per_block), min(stop, (block + 1) * per_block)
                parts.append(self._block(block)[0][lo - block * per_block:hi - block * per_block])
            flat = np.concatenate(parts).reshape(-1)
            _, first = np.unique(flat, return_index=True)
            for s in flat[np.sort(first)].tolist():
                seen.setdefault(s, None)
            m, span = stop, 2 * span
        return list(seen)[:count]

    def _prefetch(self):
        planned = None
        while not self._stop:
            try:
                if planned == (self._generation, self.position):     # nothing consumed since the last round
                    self._wake.wait(timeout=0.5)
                    self._wake.clear()
                    continue
                planned = (self._generation, self.position)
                for shard in self.upcoming(self.prefetch_shards):
                    if self._stop:
                        return
                    if not self.hot.resident(shard) and not self.hot.fetch(shard, prefetch=True):
                        break                      # the budget is full of shards needed sooner
            except Exception as exc:               # surfaced by the next __next__
                self._error = exc
                return
            self._wake.wait(timeout=0.5)
            self._wake.clear()

    def figures(self):
        """This reader's hits, misses, bytes it fetched from cold and time waited; the
        tier's ``scope`` and ``budget_bytes``; with a node tier, the node's (``node_*``)."""
        out = self.stats.figures()
        if self.hot is None:
            out["bytes_fetched"] = self.cold.bytes_read
            return out | {"scope": None, "budget_bytes": None}
        out |= {"scope": self.hot.scope, "budget_bytes": self.hot.budget}
        if self.hot.scope == "node":
            out |= self.hot.node_figures() | {"node_dp_ranks": list(self.node_dp_ranks)}
        return out

    def close(self):
        self._stop = True
        self._wake.set()
        with self._ready_cv:
            self._ready.clear()
            self._ready_cv.notify_all()

    def __iter__(self):
        return self

    def _header_of(self, shard):
        if shard not in self._header:
            self._header[shard] = self.cold.header(self.store.shard_name(shard))
        return self._header[shard]

    def _read_ahead(self):
        """Assemble the next ``prefetch_batches`` micro-batches while the consumer computes,
        so that a pull of a resident batch is a dictionary lookup, not a gather and two
        casts on the step's critical path."""
        while True:
            with self._ready_cv:
                while True:
                    if self._stop or self._error is not None:
                        return
                    key = next(((self._generation, p) for p in range(self._position,
                                                                     self._position + self.prefetch_batches)
                                if (self._generation, p) not in self._ready
                                and (self._generation, p) not in self._building), None)
                    if key is not None:
                        break
                    self._ready_cv.wait()
                self._building.add(key)
            try:
                batch = self._assemble(key[1])
            except Exception as exc:          # surfaced by the next __next__
                with self._ready_cv:
                    self._error = exc
                    self._building.discard(key)
                    self._ready_cv.notify_all()
                return
            with self._ready_cv:
                self._building.discard(key)
                if key[0] == self._generation and key[1] >= self._position:
                    self._ready[key] = batch
                self._ready_cv.notify_all()

    def _assemble(self, position):
        """Micro-batch ``position``'s ``(input_ids, labels)``, read through the tiers."""
        rows = self.order.rows(position, self.dp_rank)
        shards = self.order.shard_of(rows)
        offsets = rows - self.order.starts[shards]
        if self.hot is not None:
            with self._ready_cv:            # protected from eviction while any assembly reads them
                self._pins[position] = set(int(s) for s in np.unique(shards))
                self.hot.pinned = set().union(*self._pins.values())
        try:
            out = np.empty((len(rows), self.store.row_len), dtype=self.store.dtype)
            for s in np.unique(shards):
                mask = shards == s
                if self.hot is not None:
                    out[mask] = self.hot.array(int(s))[offsets[mask]]
                else:
                    raw = self.cold.read_rows(self.store.shard_name(int(s)), offsets[mask], row_bytes=self.row_bytes,
                                              header=self._header_of(int(s)))
                    out[mask] = np.frombuffer(b"".join(raw), dtype=self.store.dtype).reshape(-1, self.store.row_len)
        finally:
            if self.hot is not None:
                with self._ready_cv:
                    self._pins.pop(position, None)
        return torch.from_numpy(out[:, :-1].astype(np.int64)), torch.from_numpy(out[:, 1:].astype(np.int64))

    def __next__(self):
        start = time.perf_counter()
        batch = None
        with self._ready_cv:
            while True:
                if self._error is not None:
                    raise self._error
                key = (self._generation, self._position)
                batch = self._ready.pop(key, None)
                if batch is not None or key not in self._building:
                    break
                self._ready_cv.wait()          # the read-ahead is assembling this one
            if batch is None:
                self._building.add(key)
        if batch is None:
            try:
                batch = self._assemble(key[1])
            finally:
                with self._ready_cv:
                    self._building.discard(key)
        with self._ready_cv:
            if key[0] == self._generation:
                self._position += 1
            self._ready_cv.notify_all()        # the read-ahead moves on
        self.stats.batches += 1
        self.stats.wait_s += time.perf_counter() - start
        if self.hot is not None:
            # plan the next fetches now, while the step computes: a prefetcher woken earlier
            # takes the GIL from the read (numpy's casts release it)
            self._wake.set()
        return batch


def _runs(sorted_values):
    """(value, first index, end index) of each run of equal values."""
    if len(sorted_values) == 0:
        return []
    edges = np.flatnonzero(np.diff(sorted_values)) + 1
    starts = np.concatenate([[0], edges])
    ends = np.concatenate([edges, [len(sorted_values)]])
    return [(sorted_values[a], a, b) for a, b in zip(starts, ends)]

"""One hot tier shared by the data-reading ranks of a node (``data.hot_scope: node``).

Every reader process of the node opens a NodeHotTier on the same directory and the
same byte budget; each shard is copied from the cold tier once per node, whichever
reader needs it first. The directory, ``hot_dir/<store>-<hash of the shard list>``
(two stores never share one), holds:

    <shard>                  a resident shard (``/`` in its name as ``__``), exactly its index size
    .<shard>.<hex>.tmp       a copy in progress (fileio.atomic_open), renamed to <shard> when whole
    .<shard>.reserved        the budget an in-flight copy holds
    .counters.json           the node's bytes fetched, hits and misses (updated under .locks/.dir)
    .locks/<shard>           the shard's flock: exclusive to copy or evict it, shared to map it
    .locks/.dir              the directory's flock: the budget, reservations and evictions

The readers agree through these flocks rather than through a leader rank: the kernel
releases a lock when its holder dies, so a dead reader never leaves the others
waiting on a timeout or a missed message, readers need not start together or read at
the same pace, and no collective is needed among the ranks that read data (not every
rank does). A reader that dies mid-copy leaves a temporary file and a reservation
whose lock is free; the next reader to look at the directory (or to fetch that shard)
removes both. A resident file whose size disagrees with the index is removed.

The budget is never exceeded across the node: a copy first reserves its bytes under
the directory lock, after counting what is resident and reserved (a reservation
whose lock is free is a dead reader's and is dropped), evicting if needed. Eviction
uses the node's knowledge: the iterator's ``next_use`` covers all of the node's
data-parallel ranks from a little behind the current position (readers are
synchronous at step granularity, pipeline stages of one data rank read a micro-batch
at different times within a step), and ``pin_until`` protects what any of them uses
until a step ahead. A shard unlinked while another process has it mapped stays valid
for that process (POSIX); one unlinked before a reader mapped it is fetched again.
"""

import collections
import contextlib
import fcntl
import hashlib
import json
import os
import re
import threading
import time

import numpy as np

from ds_ext.errors import DataError


def node_directory(hot_dir, store):
    """The node's hot directory for ``store``: its root's name and a hash of its shard list."""
    listing = "\n".join(f"{sh['name']} {sh['bytes']}" for sh in store.shards)
    digest = hashlib.sha256(listing.encode()).hexdigest()[:12]
    return os.path.join(hot_dir, f"{os.path.basename(os.path.normpath(store.root))}-{digest}")


@contextlib.contextmanager
def _flock(path, mode, *, blocking=True):
    """Hold ``fcntl.flock(mode)`` on ``path`` for the block; yields False when
    ``blocking`` is off and another open file holds a conflicting lock."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
    try:
        try:
            fcntl.flock(fd, mode if blocking else mode | fcntl.LOCK_NB)
            held = True
        except BlockingIOError:
            held = False
        yield held
    finally:
        os.close(fd)         # closing the last descriptor of the open file releases the lock


def check_budget(store, budget_bytes, min_shards):
    """Refuse a hot-tier budget (a node's or a rank's) too small for one micro-batch."""
    biggest = max(store.shard_bytes(s) for s in range(len(store.shards)))
    # a micro-batch that straddles two shuffle windows touches up to 2 x min_shards shards
    if budget_bytes < (2 * min_shards + 1) * biggest:
        raise DataError(f"seekspeed.data.hot_budget_mb {budget_bytes / 1e6:.1f} MB holds fewer than "
                        f"{2 * min_shards + 1} shards of {biggest / 1e6:.1f} MB (a micro-batch can touch "
                        f"{2 * min_shards}: twice data.shuffle_window per source): raise it, or lower "
                        f"data.rows_per_shard")


class NodeHotTier:
    """Shards copied from ``cold`` into the node's ``directory`` under the node's byte
    ``budget``, shared with the node's other reader processes (see the module docstring)."""

    scope = "node"

    def __init__(self, store, cold, directory, *, budget_bytes, policy, stats, min_shards=1, poll_s=0.01):
        if policy not in ("next-use", "lru"):
            raise ValueError(f"unknown eviction policy {policy!r}")
        check_budget(store, budget_bytes, min_shards)
        self.store, self.cold, self.dir = store, cold, directory
        self.budget, self.policy, self.stats = budget_bytes, policy, stats
        self.poll_s = poll_s
        os.makedirs(os.path.join(directory, ".locks"), exist_ok=True)   # never wiped: other readers use it
        self._dir_lock = os.path.join(directory, ".locks", ".dir")
        self._shard_of_file = {self._file(s): s for s in range(len(store.shards))}
        self._temp = re.compile(r"^\.(.+)\.[0-9a-f]{8}\.tmp$")      # fileio.atomic_open's temporary name
        # open memory maps, least recently read first (each holds a descriptor; HotTier says why)
        self._arrays = collections.OrderedDict()
        self.max_open = max(8, 2 * min_shards)
        self._lock = threading.Lock()
        self._unflushed = {"bytes_fetched": 0, "hits": 0, "misses": 0}
        self.next_use = lambda shard: float("inf")      # set by the iterator: the node's next use
        self.pin_until = lambda: -1                     # set by the iterator: protect uses up to here
        self.pinned = set()                             # this reader's current micro-batch
        with _flock(self._dir_lock, fcntl.LOCK_EX):
            self._baseline = self._read_counters()

    # -- names

    def _file(self, shard):
        return self.store.shard_name(shard).replace("/", "__")

    def _path(self, shard):
        return os.path.join(self.dir, self._file(shard))

    def _lock_path(self, shard):
        return os.path.join(self.dir, ".locks", self._file(shard))

    def _reservation(self, shard):
        return os.path.join(self.dir, f".{self._file(shard)}.reserved")

    def _whole(self, shard):
        try:
            return os.stat(self._path(shard)).st_size == self.store.shard_bytes(shard)
        except FileNotFoundError:
            return False

    def resident(self, shard):
        return self._whole(shard)

    # -- the directory, under its lock

    def _scan(self):
        """(resident shard -> mtime, reserved shards) of the directory, holding the
        directory lock; drops what dead readers left and files of the wrong size."""
        resident, reserved, temps = {}, set(), []
        for name in os.listdir(self.dir):
            if name.startswith(".") and name.endswith(".reserved"):
                shard = self._shard_of_file.get(name[1:-len(".reserved")])
                if shard is not None:
                    reserved.add(shard)
            elif (m := self._temp.match(name)) and m.group(1) in self._shard_of_file:
                temps.append((self._shard_of_file[m.group(1)], name))
            elif name in self._shard_of_file:
                shard = self._shard_of_file[name]
                try:
                    st = os.stat(os.path.join(self.dir, name))
                except FileNotFoundError:
                    continue
                if st.st_size == self.store.shard_bytes(shard):
                    resident[shard] = st.st_mtime
                else:                                   # not one of ours: the index says otherwise
                    _unlink(os.path.join(self.dir, name))
        for shard in sorted(reserved | {s for s, _ in temps}):
            with _flock(self._lock_path(shard), fcntl.LOCK_EX, blocking=False) as free:
                if free:                                # its copier died: the kernel released the lock
                    self._drop_leftovers(shard)
                    reserved.discard(shard)
        return resident, reserved

    def _drop_leftovers(self, shard):
        """Remove ``shard``'s reservation and partial copies (the caller holds its lock
        exclusively, so they are a dead reader's)."""
        _unlink(self._reservation(shard))
        prefix = f".{self._file(shard)}."
        for name in os.listdir(self.dir):
            m = self._temp.match(name)
            if m and m.group(1) == self._file(shard) and name.startswith(prefix):
                _unlink(os.path.join(self.dir, name))

    def _read_counters(self):
        try:
            with open(os.path.join(self.dir, ".counters.json")) as f:
                return json.load(f)
        except (FileNotFoundError, json.JSONDecodeError):
            return {"bytes_fetched": 0, "hits": 0, "misses": 0}

    def _flush_counters(self):
        """Add this reader's counts since the last flush to the node's (directory lock held)."""
        with self._lock:
            delta, self._unflushed = self._unflushed, {k: 0 for k in self._unflushed}
        if not any(delta.values()):
            return self._read_counters()
        counters = self._read_counters()
        for k, v in delta.items():
            counters[k] = counters.get(k, 0) + v
        tmp = os.path.join(self.dir, f".counters.{os.getpid()}.{threading.get_ident()}")
        with open(tmp, "w") as f:
            json.dump(counters, f)
        os.replace(tmp, os.path.join(self.dir, ".counters.json"))
        return counters

    def _victims(self, resident, shard):
        """Resident shards in the order to evict them: none of this reader's current
        micro-batch; those no node reader uses before ``pin_until`` first."""
        cands = [s for s in resident if s not in self.pinned and s != shard]
        horizon = self.pin_until()
        if self.policy == "lru":
            key = lambda s: (self.next_use(s) > horizon, -resident[s])
        else:
            key = lambda s: (self.next_use(s) > horizon, self.next_use(s))
        return sorted(cands, key=key, reverse=True)

    def _reserve(self, shard, *, prefetch):
        """Hold ``shard``'s bytes against the node budget, evicting for room. A prefetch
        gives up (False) rather than evict a shard needed sooner or wait for room."""
        size = self.store.shard_bytes(shard)
        while True:
            with _flock(self._dir_lock, fcntl.LOCK_EX):
                resident, reserved = self._scan()
                sizes = self.store.shard_bytes
                used = sum(sizes(s) for s in set(resident) | reserved)
                busy = bool(reserved)
                for victim in self._victims(resident, shard):
                    if used + size <= self.budget:
                        break
                    if prefetch and self.next_use(victim) <= self.next_use(shard):
                        return False
                    with _flock(self._lock_path(victim), fcntl.LOCK_EX, blocking=False) as free:
                        if not free:                    # being copied or mapped: not now
                            busy = True
                            continue
                        _unlink(self._path(victim))
                    with self._lock:
                        self._arrays.pop(victim, None)
                    if victim not in reserved:
                        used -= sizes(victim)
                if used + size <= self.budget:
                    with open(self._reservation(shard), "w") as f:
                        f.write(f"{size} bytes, pid {os.getpid()}\n")
                    return True
            if prefetch:
                return False
            if not busy:
                raise DataError(f"hot tier {self.dir}: no room for shard {shard} next to the {len(self.pinned)} "
                                f"shards the current micro-batch uses; raise seekspeed.data.hot_budget_mb")
            time.sleep(self.poll_s)                     # another reader's copy holds the room; it ends soon

    def _copy(self, shard, *, prefetch):
        """Copy ``shard`` from cold (its lock held exclusively); False when a prefetch
        found no room."""
        self._drop_leftovers(shard)                     # a dead reader's partial copy of it
        if self._whole(shard):
            return True
        _unlink(self._path(shard))                      # a file of the wrong size
        if not self._reserve(shard, prefetch=prefetch):
            return False
        done = False
        try:
            self.cold.copy_to(self.store.shard_name(shard), self._path(shard))
            done = True
        finally:
            size = self.store.shard_bytes(shard)
            with self._lock:
                if done:
                    self.stats.bytes_fetched += size
                    self._unflushed["bytes_fetched"] += size
            with _flock(self._dir_lock, fcntl.LOCK_EX):
                _unlink(self._reservation(shard))
                self._flush_counters()
        return True

    # -- what the iterator calls

    def fetch(self, shard, *, prefetch=False):
        """Make ``shard`` resident in the node's directory. A prefetch returns True at
        once when another reader is copying it, and False rather than evict a shard
        needed sooner."""
        with _flock(self._lock_path(shard), fcntl.LOCK_EX, blocking=not prefetch) as held:
            if not held:
                return True                            # another reader of the node has it in hand
            return self._copy(shard, prefetch=prefetch)

    def array(self, shard):
        """The shard's rows, memory-mapped; fetched now (a miss) when not in the node's
        directory, or waited for when another reader is copying it."""
        with self._lock:
            arr = self._arrays.get(shard)
            if arr is not None:
                self._arrays.move_to_end(shard)
        hit = arr is not None
        if arr is None:
            with _flock(self._lock_path(shard), fcntl.LOCK_SH, blocking=False) as held:
                if held and self._whole(shard):
                    arr = np.load(self._path(shard), mmap_mode="r")
                    hit = True
        if arr is None:
            with _flock(self._lock_path(shard), fcntl.LOCK_EX):
                self._copy(shard, prefetch=False)
                arr = np.load(self._path(shard), mmap_mode="r")   # mapped before an evictor can take the lock
        with self._lock:
            if hit:
                self.stats.hits += 1
                self._unflushed["hits"] += 1
            else:
                self.stats.misses += 1
                self._unflushed["misses"] += 1
            if shard not in self._arrays:
                self._arrays[shard] = arr
                while len(self._arrays) > self.max_open:
                    self._arrays.popitem(last=False)
        if self.policy == "lru":
            with contextlib.suppress(FileNotFoundError):
                os.utime(self._path(shard))             # the node's recency, for every reader's LRU
        return arr

    def node_figures(self):
        """The node's figures since this reader opened its tier (every reader's fetches
        and accesses, flushed at each fetch and here), and what the directory holds now."""
        with _flock(self._dir_lock, fcntl.LOCK_EX):
            counters = self._flush_counters()
            resident, reserved = self._scan()
        node = {k: counters.get(k, 0) - self._baseline.get(k, 0) for k in ("bytes_fetched", "hits", "misses")}
        total = node["hits"] + node["misses"]
        return {"node_bytes_fetched": node["bytes_fetched"], "node_hits": node["hits"],
                "node_misses": node["misses"], "node_hit_rate": node["hits"] / total if total else None,
                "node_resident_bytes": sum(self.store.shard_bytes(s) for s in resident),
                "node_reserved_bytes": sum(self.store.shard_bytes(s) for s in reserved)}


def _unlink(path):
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)

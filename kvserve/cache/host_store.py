"""Host memory for the prefix cache: pages' KV rows and checkpoint blobs under one byte budget.

Entries are keyed by what they belong to (a page tree node, a checkpoint), never by request, so a
prefix that many conversations share is one entry, stored once.

Invariants:
- `bytes_used` is the sum of the sizes of the entries held and never exceeds `budget_bytes`; a `put`
  that would not fit after evicting every unlocked entry is refused and evicts nothing;
- a locked entry (lock count > 0) is never evicted. Owners lock what a live session reads; a tree
  locks a parent once for each child it stores, so only leaves go and chains shrink from the tail;
- eviction order: lower `rank` first (a checkpoint cache ranks openings above conversations), then
  cold (never hit by `get`) before hot, then least recently used first;
- `on_evict(key)` runs once for each entry the store evicts on its own, after the entry is gone (it
  may unlock others; it must not lock or put); `discard`, the owner's own removal, does not call it.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass
from typing import Callable, Generic, Hashable, Protocol, TypeVar, runtime_checkable

from kvserve.cache.page_tree import tick
from kvserve.config import default_budget_mb  # noqa: F401  (the store's default)


@runtime_checkable
class HasNbytes(Protocol):
    @property
    def nbytes(self) -> int: ...


K = TypeVar("K", bound=Hashable)
V = TypeVar("V", bound="bytes | HasNbytes")


def size_of(value: bytes | HasNbytes) -> int:
    return value.nbytes if isinstance(value, HasNbytes) else len(value)


@dataclass(frozen=True)
class HostStoreStats:
    bytes: int
    entries: int
    budget_bytes: int
    locked_entries: int
    evictions: int  # entries the store evicted on its own, since it was made
    evicted_bytes: int


@dataclass(eq=False)
class _Entry(Generic[V]):
    value: V
    nbytes: int
    rank: int
    locks: int = 0
    hits: int = 0
    last_access: int = 0
    stamp: int = 0  # bumped when its eviction key changes: heap items of an older stamp are stale


class HostStore(Generic[K, V]):
    """A byte-budgeted map from page or checkpoint identity to its blob. One thread, like the context."""

    def __init__(self, budget_bytes: int, on_evict: Callable[[K], None] | None = None) -> None:
        if budget_bytes < 0:
            raise ValueError("budget_bytes must be >= 0")
        self.budget_bytes = budget_bytes
        self.on_evict = on_evict
        self.bytes_used = 0
        self._locked_bytes = 0
        self._entries: dict[K, _Entry[V]] = {}
        self._heap: list[tuple[int, bool, int, int, int, K]] = []  # eviction key, serial, stamp, key
        self._serial = itertools.count()
        self._evictions = 0
        self._evicted_bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: K) -> bool:
        return key in self._entries

    # -- storing and reading ------------------------------------------------------------------------

    def fits(self, nbytes: int) -> bool:
        """Whether a `put` of `nbytes` would succeed now (by evicting unlocked entries if need be)."""
        return nbytes <= self.budget_bytes - self._locked_bytes

    def put(self, key: K, value: V, *, rank: int = 0, lock: bool = False) -> bool:
        """Store `value` under a new `key` (locked once, if `lock`); False, evicting nothing, if it cannot fit."""
        if key in self._entries:
            raise KeyError("already stored: an entry is stored once")
        nbytes = size_of(value)
        if not self.fits(nbytes):
            return False
        self.evict(self.bytes_used + nbytes - self.budget_bytes)
        if self.bytes_used + nbytes > self.budget_bytes:  # only if `on_evict` locked what was to go
            return False
        entry = _Entry(value, nbytes, rank, last_access=tick())
        self._entries[key] = entry
        self.bytes_used += nbytes
        if lock:
            self.lock(key)
        else:
            self._push(key, entry)
        return True

    def replace(self, key: K, value: V) -> bool:
        """Hold `value` in place of a locked entry's (its locks, rank, hits and recency kept), evicting
        others if it is larger; False, changing nothing, if it cannot fit."""
        entry = self._entries[key]
        if not entry.locks:
            raise ValueError("replace needs a locked entry: it must not be evicted to make its own room")
        grow = size_of(value) - entry.nbytes
        if grow > 0:
            if not self.fits(grow):
                return False
            self.evict(self.bytes_used + grow - self.budget_bytes)
            if self.bytes_used + grow > self.budget_bytes:
                return False
        entry.value = value
        entry.nbytes += grow
        self.bytes_used += grow
        self._locked_bytes += grow
        return True

    def get(self, key: K) -> V | None:
        """The value, counted as a hit (the entry turns hot) and as its latest use."""
        entry = self._entries.get(key)
        if entry is None:
            return None
        entry.hits += 1
        self._touch(key, entry)
        return entry.value

    def peek(self, key: K) -> V | None:
        """The value; changes nothing."""
        entry = self._entries.get(key)
        return None if entry is None else entry.value

    def size(self, key: K) -> int:
        """The bytes `key`'s value takes (0 when absent); changes nothing."""
        entry = self._entries.get(key)
        return 0 if entry is None else entry.nbytes

    def touch(self, key: K) -> None:
        """Count a use of `key` for recency, not as a hit."""
        self._touch(key, self._entries[key])

    def _touch(self, key: K, entry: _Entry[V]) -> None:
        entry.last_access = tick()
        if not entry.locks:
            self._push(key, entry)

    # -- locks --------------------------------------------------------------------------------------

    def lock(self, key: K) -> None:
        entry = self._entries[key]
        if not entry.locks:
            self._locked_bytes += entry.nbytes
        entry.locks += 1

    def unlock(self, key: K) -> None:
        entry = self._entries[key]
        if entry.locks <= 0:
            raise ValueError("unlock without a lock")
        entry.locks -= 1
        if not entry.locks:
            self._locked_bytes -= entry.nbytes
            self._push(key, entry)

    def locks(self, key: K) -> int:
        return self._entries[key].locks

    def rerank(self, key: K, rank: int) -> None:
        """Give `key` another eviction rank (a checkpoint that turns out to be an opening)."""
        entry = self._entries[key]
        entry.rank = rank
        if not entry.locks:
            self._push(key, entry)

    # -- removal --------------------------------------------------------------------------------------

    def discard(self, key: K) -> bool:
        """The owner's removal of an unlocked entry (no `on_evict`); False if it was not stored."""
        entry = self._entries.get(key)
        if entry is None:
            return False
        if entry.locks:
            raise ValueError("a locked entry cannot be discarded")
        self._remove(key, entry)
        return True

    def evict(self, nbytes: int) -> int:
        """Evict unlocked entries in eviction order until `nbytes` are freed or none is left; the bytes freed."""
        freed = 0
        while freed < nbytes and self._heap:
            item = heapq.heappop(self._heap)
            if not self._live(item):
                continue
            key = item[-1]
            entry = self._entries[key]
            self._remove(key, entry)
            freed += entry.nbytes
            self._evictions += 1
            self._evicted_bytes += entry.nbytes
            if self.on_evict is not None:
                self.on_evict(key)
        return freed

    def clear(self) -> None:
        """Discard every entry; none may be locked."""
        if self._locked_bytes:
            raise RuntimeError("entries still locked: release their readers first")
        self._entries.clear()
        self._heap.clear()
        self.bytes_used = 0

    def _remove(self, key: K, entry: _Entry[V]) -> None:
        del self._entries[key]
        self.bytes_used -= entry.nbytes
        entry.stamp += 1

    # -- the eviction heap: lazy, an entry's latest item is its only live one ------------------------

    def _push(self, key: K, entry: _Entry[V]) -> None:
        entry.stamp += 1
        item = (entry.rank, entry.hits > 0, entry.last_access, next(self._serial), entry.stamp, key)
        heapq.heappush(self._heap, item)
        if len(self._heap) > 2 * len(self._entries) + 64:
            self._compact()

    def _compact(self) -> None:
        self._heap = [item for item in self._heap if self._live(item)]
        heapq.heapify(self._heap)

    def _live(self, item: tuple[int, bool, int, int, int, K]) -> bool:
        entry = self._entries.get(item[-1])
        return entry is not None and not entry.locks and entry.stamp == item[-2]

    # -- what metrics read ----------------------------------------------------------------------------

    def stats(self) -> HostStoreStats:
        return HostStoreStats(
            bytes=self.bytes_used, entries=len(self._entries), budget_bytes=self.budget_bytes,
            locked_entries=sum(e.locks > 0 for e in self._entries.values()),
            evictions=self._evictions, evicted_bytes=self._evicted_bytes,
        )

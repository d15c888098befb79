"""The disk tier of the prefix cache: pages' payloads in files that outlive the process, under one
byte budget, written behind the engine thread and verified on every read.

The store knows nothing of llama.cpp: a page is its key (`page_key`), its parent's key, its
namespace seed, its tokens, a free-text tag and opaque payload bytes. Layout under `directory`:

    lock                                   held with flock(LOCK_EX) for the store's life; our pid in it
    pages/<2 hex>/<64 hex key>.page        one page: header, payload, checksum
    pages/<2 hex>/<64 hex key>.page.tmp    a page being written (renamed when complete; removed at start)

A page file, integers little-endian:

    magic b"KVSPAGE\\0" | u32 version | key, parent, seed (32 bytes each) | u32 n_tokens |
    n_tokens x i32 tokens | u16 tag length | tag (utf-8) | u64 payload length | payload |
    u64 XXH3-64 of everything before it

Invariants:
- budget: the indexed files' sizes plus the size of the one file the writer is writing (reserved
  before its first byte, its temporary name included) never exceed `budget_bytes`, so neither do the
  apparent sizes of the files under `pages/` while the store is open (the writer evicts before it
  writes; a page larger than the whole budget is never written). A budget that shrank across a
  restart is enforced by evicting at start;
- crash safety: a file under a final name is complete: it was written under a temporary name,
  fsynced, then renamed (`os.replace`). A kill at any moment leaves at most a temporary file, removed
  at the next start. Directories are fsynced when the writer runs out of work (or every 5 s while
  it is busy), so a power loss may forget the newest renames, never expose a partial file;
- nothing is trusted: the start scan drops a file whose header does not parse, whose name is not its
  key or whose size is not what its header says; `get` checks magic, version, key, sizes and the
  checksum before returning a payload, and removes a file that fails (counted in `refused`);
- the index is the files: at every moment outside the store's lock, a key is indexed exactly when its
  final file exists (renames and unlinks happen under the lock), and `bytes` is their sizes' sum;
- eviction order: only pages none of whose children are indexed (leaves: chains shrink from their
  tail, so a page on disk keeps its parent there; nor the parent of the page being written, a leaf
  until that page is indexed), cold (never hit by `get` since the store opened)
  before hot, then least recently used first. Recency across a restart comes from the files' mtimes
  (set by the write, by each hit and by `touch`); hotness does not survive a restart: every page
  starts cold. A forged cycle of parents, which no SHA-256 chain makes, falls back to plain cold/LRU
  order;
- callbacks: `on_stored(entry)` runs on the writer thread once per file written and renamed into
  place (a replacement too: the key stays announced); `on_removed(entry)` runs once per key that
  leaves the index (eviction on the writer thread; a failed `get` or `discard` on the caller's). Files
  dropped or evicted while the store opens were never announced and call nothing. Callbacks run outside the lock (they
  may call `contains`, `entry`, `stats`), one at a time, each right after its change of the index and
  before any other change that calls back, so a key's callbacks come in the order of its changes
  whichever threads made them (a refused read's removal never overtakes the write it removes);
- the engine thread never waits on disk writes: `put` only enqueues (a full queue drops the write,
  counted in `dropped_writes`); `payload()` runs on the writer thread;
- the queue's memory: the estimated bytes of its waiting writes whose payloads only the queue keeps
  stay within `queue_bytes`. A `held` write's payload is memory its caller keeps anyway (a page in
  host memory), so it is queued whatever the queue holds and counts only once the caller lets it go
  (`release`), or is dropped then (counted) where it would pass `queue_bytes`.
"""

from __future__ import annotations

import collections
import errno
import fcntl
import heapq
import itertools
import logging
import os
import struct
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Sequence

import numpy as np
import xxhash

_log = logging.getLogger("kvserve.cache")

MAGIC = b"KVSPAGE\0"
VERSION = 2  # 2: the checksum is XXH3-64 (a CRC-32 in 1)
KEY_BYTES = 32
MAX_TAG_BYTES = 255
TAG_PARTS = "\x1f"  # in a tag, between its owner's name and what follows it (page_events: the adapters)
SUFFIX = ".page"
TMP_SUFFIX = ".page.tmp"
CLOSE_WAIT_S = 30.0  # the most a close (or a stopping server) waits for the queued writes

_FIXED = struct.Struct("<8sI32s32s32sI")  # magic, version, key, parent, seed, n_tokens
_TAG_LEN = struct.Struct("<H")
_PAYLOAD_LEN = struct.Struct("<Q")
_SUM = struct.Struct("<Q")
_HEAD_READ = 4096  # bytes read at once to parse a header (more only for pages of over ~950 tokens)
_DIR_SYNC_SECONDS = 5.0  # most time between directory fsyncs while the writer is busy (each costs a journal commit)

Payload = Sequence["bytes | bytearray | memoryview | np.ndarray"]


class DiskLocked(RuntimeError):
    """Another live server holds the folder."""


@dataclass(frozen=True)
class DiskEntry:
    """What the index knows of a page file (from its header); no payload."""

    key: bytes
    parent: bytes  # the parent page's key, or the namespace seed for a first page
    seed: bytes  # the namespace seed (root key) of the page's chain
    tokens: tuple[int, ...]
    tag: str  # who wrote it (the model's name): free text, at most 255 bytes of utf-8
    nbytes: int  # payload bytes

    @property
    def file_bytes(self) -> int:
        """The whole file's size: header, payload and checksum."""
        return header_size(len(self.tokens), len(self.tag.encode())) + self.nbytes + _SUM.size


@dataclass(frozen=True)
class DiskStats:
    bytes: int  # sizes of the indexed files
    pages: int
    budget_bytes: int
    hits: int
    misses: int  # `get`s that returned None: not indexed, or refused
    writes: int  # files written, replacements included
    written_bytes: int
    read_seconds: float  # time in `get`
    write_seconds: float  # time writing files (open to rename), not in `payload()`
    refused: int  # files found corrupt, truncated or foreign and removed (at start or by `get`)
    dropped_writes: int  # `put`s dropped because the queue was full
    evictions: int
    evicted_bytes: int
    queued: int  # writes waiting or in progress
    queued_bytes: int  # their estimated sizes
    too_big: int  # pages larger than the whole budget, never written
    failed_writes: int  # `payload()` raised, or the file system refused (ENOSPC, EIO)


def header_size(n_tokens: int, tag_bytes: int) -> int:
    return _FIXED.size + 4 * n_tokens + _TAG_LEN.size + tag_bytes + _PAYLOAD_LEN.size


def encode_header(entry: DiskEntry) -> bytes:
    tag = entry.tag.encode()
    return b"".join((
        _FIXED.pack(MAGIC, VERSION, entry.key, entry.parent, entry.seed, len(entry.tokens)),
        np.asarray(entry.tokens, dtype="<i4").tobytes(),
        _TAG_LEN.pack(len(tag)), tag, _PAYLOAD_LEN.pack(entry.nbytes),
    ))


class _BadFile(ValueError):
    pass


def decode_header(data: bytes | memoryview) -> tuple[DiskEntry, int]:
    """The entry a file's first bytes describe and the header's length; `_BadFile` if they do not parse
    (`data` may hold more than the header; too few bytes raise `_BadFile` too)."""
    if len(data) < _FIXED.size:
        raise _BadFile("shorter than a header")
    magic, version, key, parent, seed, n_tokens = _FIXED.unpack_from(data, 0)
    if magic != MAGIC:
        raise _BadFile("not a page file (magic)")
    if version != VERSION:
        raise _BadFile(f"format version {version}, not {VERSION}")
    at = _FIXED.size
    if len(data) < at + 4 * n_tokens + _TAG_LEN.size:
        raise _BadFile("header cut short (tokens)")
    tokens = tuple(np.frombuffer(data, dtype="<i4", count=n_tokens, offset=at).tolist())
    at += 4 * n_tokens
    (tag_len,) = _TAG_LEN.unpack_from(data, at)
    at += _TAG_LEN.size
    if tag_len > MAX_TAG_BYTES:
        raise _BadFile("tag too long")
    if len(data) < at + tag_len + _PAYLOAD_LEN.size:
        raise _BadFile("header cut short (tag)")
    try:
        tag = bytes(data[at : at + tag_len]).decode()
    except UnicodeDecodeError:
        raise _BadFile("tag is not utf-8") from None
    at += tag_len
    (nbytes,) = _PAYLOAD_LEN.unpack_from(data, at)
    at += _PAYLOAD_LEN.size
    return DiskEntry(key=key, parent=parent, seed=seed, tokens=tokens, tag=tag, nbytes=nbytes), at


def _buffers(parts: object) -> list[memoryview]:
    """`payload()`'s result as flat byte views (one bytes-like or array, or a sequence of them)."""
    if isinstance(parts, (bytes, bytearray, memoryview, np.ndarray)):
        parts = [parts]
    views = []
    for part in parts:  # type: ignore[attr-defined]
        view = memoryview(part)
        if not view.c_contiguous:
            view = memoryview(np.ascontiguousarray(part))
        views.append(view.cast("B") if view.ndim != 1 or view.format != "B" else view)
    return views


@dataclass(eq=False)
class _Item:
    entry: DiskEntry
    size: int  # file bytes
    hits: int = 0
    last_access: int = 0
    children: int = 0  # indexed entries whose parent is this one
    stamp: int = 0  # bumped when its eviction key changes: heap items of an older stamp are stale


@dataclass(eq=False)
class _Job:
    entry: DiskEntry  # nbytes 0 until `payload()` ran
    payload: Callable[[], Payload]
    replace: bool
    estimate: int
    held: bool = False  # the caller keeps the payload's memory: not in `_queued_bytes` (`release`)
    dropped: bool = False  # released past the queue's bytes: done, the writer skips it


def _dropped_payload() -> Payload:
    raise AssertionError("a dropped write's payload is never asked for")


class DiskStore:
    """Prefix-cache pages in files under `directory`, at most `budget_bytes` of them (or as many as
    `budget_bytes(found)` says, given the bytes of the pages the start scan found); one server per folder."""

    def __init__(self, directory: Path, budget_bytes: int | Callable[[int], int], *, queue_bytes: int = 256 << 20,
                 on_stored: Callable[[DiskEntry], None] | None = None,
                 on_removed: Callable[[DiskEntry], None] | None = None) -> None:
        self.directory = Path(directory)
        self.pages_dir = self.directory / "pages"
        self._pages = str(self.pages_dir)
        self.budget_bytes = 0  # set once the start scan found what the folder holds
        self.queue_bytes = queue_bytes
        self.on_stored = on_stored
        self.on_removed = on_removed

        self._lock = threading.Lock()  # the index, the heap, the queue and the counters
        # held around each change of the index and its callback, so a key's callbacks run in the
        # order of its changes whichever threads make them (taken before `_lock`, never inside it)
        self._announcing = threading.RLock()
        self._work = threading.Condition(self._lock)  # the writer waits for jobs; `flush` for an empty queue
        self._index: dict[bytes, _Item] = {}
        self._children: dict[bytes, int] = {}  # parent key -> indexed children (parents not yet indexed too)
        self._heap: list[tuple[bool, int, int, int, bytes]] = []  # hot, last access, serial, stamp, key
        self._serial = itertools.count()
        self._clock = itertools.count(1)
        self._bytes = 0
        self._reserved = 0  # the file being written
        self._queue: collections.deque[_Job] = collections.deque()
        self._queued: dict[bytes, _Job] = {}  # waiting jobs by key (not the one in progress)
        self._queued_bytes = 0
        self._busy = 0  # jobs waiting or in progress
        self._closing = False
        self._closed = False
        self._abandon = False  # close's wait ran out: the writer skips what is still queued
        self._release_by_writer = False  # close gave up waiting: the writer releases the folder when it ends
        self._writer_done = False
        self._dirty_dirs: set[str] = set()
        self._last_dir_sync = time.monotonic()
        self._payload_bytes = 0  # written so far: their mean estimates a `put` given no size
        self._hits = self._misses = self._writes = self._written_bytes = 0
        self._refused = self._dropped = self._evictions = self._evicted_bytes = 0
        self._too_big = self._failed = 0
        self._read_seconds = self._write_seconds = 0.0

        self.directory.mkdir(parents=True, exist_ok=True)
        self._lock_fd = self._take_lock()
        try:
            self._make_dirs()
            self._scan()
            self.budget_bytes = budget_bytes(self._bytes) if callable(budget_bytes) else budget_bytes
            if self.budget_bytes < 0:
                raise ValueError("budget_bytes must be >= 0")
            removed = self._evict_locked(self._bytes - self.budget_bytes, keep=())
            if removed:
                _log.info("disk tier %s: evicted %d pages down to the budget of %d bytes",
                          self.directory, len(removed), self.budget_bytes)
        except BaseException:
            self._release_lock()
            raise
        self._writer = threading.Thread(target=self._write_loop, name="kvserve-disk-writer", daemon=True)
        self._writer.start()

    # -- the folder's lock ------------------------------------------------------------------------------

    def _take_lock(self) -> int:
        path = self.directory / "lock"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                os.close(fd)
                raise
            try:
                holder = os.pread(fd, 64, 0).decode(errors="replace").strip()
            except OSError:
                holder = ""
            os.close(fd)
            who = f" (pid {holder})" if holder.isdigit() else ""
            raise DiskLocked(f"the disk tier folder {self.directory} is in use by another kvserve server{who}; "
                             "give each server its own folder") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        return fd

    def _release_lock(self) -> None:
        if self._lock_fd < 0:
            return
        try:
            os.ftruncate(self._lock_fd, 0)
        except OSError:
            pass
        os.close(self._lock_fd)  # closing the last descriptor releases the flock
        self._lock_fd = -1

    def _make_dirs(self) -> None:
        """pages/ and its 256 subfolders, made once (a folder made per write costs a journal commit)."""
        made = not self.pages_dir.is_dir()
        self.pages_dir.mkdir(exist_ok=True)
        for i in range(256):
            sub = self.pages_dir / f"{i:02x}"
            if not sub.is_dir():
                sub.mkdir()
                made = True
        if made:  # their names outlive a power loss before any page's does
            fsync_dir(self.pages_dir)
            fsync_dir(self.directory)

    # -- the start scan ---------------------------------------------------------------------------------

    def _scan(self) -> None:
        found: list[tuple[int, DiskEntry, int]] = []  # mtime, entry, size
        for sub in sorted(os.scandir(self.pages_dir), key=lambda d: d.name):
            if not sub.is_dir(follow_symlinks=False) or len(sub.name) != 2:
                continue
            for file in os.scandir(sub.path):
                name = file.name
                if name.endswith(TMP_SUFFIX):
                    remove_file(file.path)  # a write that never finished: we hold the lock, no one else writes
                    continue
                if not name.endswith(SUFFIX):
                    continue  # not ours: left alone
                try:
                    entry, size, mtime = self._read_header(file.path)
                    if name != entry.key.hex() + SUFFIX or sub.name != name[:2]:
                        raise _BadFile("the file's name is not its key")
                except (_BadFile, OSError) as exc:
                    _log.warning("disk tier: removing %s: %s", file.path, exc)
                    remove_file(file.path)
                    self._refused += 1
                    continue
                found.append((mtime, entry, size))
        found.sort(key=lambda f: (f[0], f[1].key))
        for _mtime, entry, size in found:
            self._add(entry, size)

    @staticmethod
    def _read_header(path: str) -> tuple[DiskEntry, int, int]:
        with open(path, "rb", buffering=0) as f:
            st = os.fstat(f.fileno())
            entry, _head, _hlen = _read_head(f, st.st_size)
        return entry, st.st_size, st.st_mtime_ns

    # -- reading ----------------------------------------------------------------------------------------

    def contains(self, key: bytes) -> bool:
        """Whether `key` is on disk now (no IO; changes nothing)."""
        return key in self._index

    def __contains__(self, key: bytes) -> bool:
        return key in self._index

    def __len__(self) -> int:
        return len(self._index)

    def entry(self, key: bytes) -> DiskEntry | None:
        item = self._index.get(key)
        return None if item is None else item.entry

    def run_bytes(self, tag: str) -> int:
        """The payload bytes of the longest chain of pages tagged `tag` (alone, or before `TAG_PARTS`),
        from one whose parent is not on disk: what restoring the longest prefix on disk reads."""
        total: dict[bytes, int] = {}
        for entry in self.entries():  # parents first
            if entry.tag.partition(TAG_PARTS)[0] == tag:
                total[entry.key] = total.get(entry.parent, 0) + entry.nbytes
        return max(total.values(), default=0)

    def entries(self) -> list[DiskEntry]:
        """Every indexed page, each after its parent when that is indexed too (for announcing at start)."""
        with self._lock:
            items = [item.entry for item in self._index.values()]
        by_parent: dict[bytes, list[DiskEntry]] = {}
        keys = {e.key for e in items}
        roots = []
        for e in items:
            if e.parent in keys and e.parent != e.key:
                by_parent.setdefault(e.parent, []).append(e)
            else:
                roots.append(e)
        ordered: list[DiskEntry] = []
        stack = roots[::-1]
        while stack:
            e = stack.pop()
            ordered.append(e)
            stack.extend(reversed(by_parent.pop(e.key, ())))
        for rest in by_parent.values():  # a forged cycle: never reached from a root
            ordered.extend(rest)
        return ordered

    def get(self, key: bytes, into: np.ndarray | None = None, touch: bool = True) -> bytes | memoryview | None:
        """The page's payload, verified (a hit: the page turns hot and most recently used); None if it is
        not on disk, or if its file fails a check (then the file is removed and counted as refused).
        With `into` (bytes, at least the payload's length), the payload is read into its start and a
        view of it is returned: a reader of many pages reuses one buffer, warm, for all of them.
        `touch` sets the file's mtime, the recency a restart finds (a reader that gets the page again
        soon may leave it to that read). Safe on several threads at once."""
        start = time.perf_counter()
        try:
            with self._lock:
                item = self._index.get(key) if not self._closed else None
                if item is None:
                    self._misses += 1
                    return None
            path = self._path(key)
            try:
                payload = _read_expected(path, item.entry, into)
                if payload is None:  # not the file the index describes: read it again, with every check
                    payload = self._read_verified(path, key, into)
            except FileNotFoundError:
                payload, problem = None, "the file is gone"
            except (_BadFile, OSError) as exc:
                payload, problem = None, str(exc)
            if payload is None:
                self._refuse(key, item, path, problem)
                return None
            with self._lock:
                current = self._index.get(key)
                if current is not None:
                    current.hits += 1
                    current.last_access = next(self._clock)
                    self._push(key, current)
                self._hits += 1
            if touch:
                set_mtime(path)
            return payload
        finally:
            elapsed = time.perf_counter() - start
            with self._lock:
                self._read_seconds += elapsed

    @staticmethod
    def _read_verified(path: str, key: bytes, into: np.ndarray | None = None) -> bytes | memoryview:
        with open(path, "rb", buffering=0) as f:
            entry, head, hlen = _read_head(f, os.fstat(f.fileno()).st_size)
            if entry.key != key:
                raise _BadFile("the header names another key")
            f.seek(hlen)
            if into is not None and into.nbytes >= entry.nbytes:
                payload: bytes | memoryview = memoryview(into).cast("B")[: entry.nbytes]
                _read_into(f, payload)
            else:
                payload = _read_exact(f, entry.nbytes)
            tail = _read_exact(f, _SUM.size)
        digest = xxhash.xxh3_64(memoryview(head)[:hlen])
        digest.update(payload)
        if _SUM.unpack(tail)[0] != digest.intdigest():
            raise _BadFile("checksum mismatch")
        return payload

    def _refuse(self, key: bytes, item: _Item, path: str, problem: str) -> None:
        with self._announcing:
            with self._lock:
                if self._index.get(key) is not item:  # evicted or replaced meanwhile: not this file's fault
                    self._misses += 1
                    return
                _log.warning("disk tier: removing %s: %s", path, problem)
                self._remove(key, item)
                remove_file(path)
                self._refused += 1
                self._misses += 1
            _call(self.on_removed, item.entry)

    # -- writing ----------------------------------------------------------------------------------------

    def put(self, key: bytes, parent: bytes, seed: bytes, tokens: Sequence[int],
            payload: Callable[[], Payload], tag: str = "", *, replace: bool = False,
            nbytes: int | None = None, held: bool = False) -> bool:
        """Queue a page's write and return at once; `payload()` runs later on the writer thread and returns
        the bytes (a bytes-like or array, or a sequence of them, written one after the other). `nbytes`
        estimates the payload's size for the queue's budget (default: the mean payload written so far).
        False, queuing nothing, if the page is on disk or queued already (unless `replace`: a page that
        gained rows is rewritten), if the queue's estimated bytes would pass `queue_bytes` (the write is
        dropped and counted), or once the store is closing. `held`: the payload is memory the caller
        keeps anyway until it calls `release(key)`; the write is queued whatever the queue's bytes
        (one prompt of 16k tokens donates 470 MB of a 1.5B's pages at once, all in host memory: a
        256 MiB queue counting them dropped the second half)."""
        for name, value in (("key", key), ("parent", parent), ("seed", seed)):
            if len(value) != KEY_BYTES:
                raise ValueError(f"{name} must be {KEY_BYTES} bytes")
        if len(tag.encode()) > MAX_TAG_BYTES:
            raise ValueError(f"tag must be at most {MAX_TAG_BYTES} bytes of utf-8")
        tokens = tuple(int(t) for t in tokens)
        entry = DiskEntry(key=bytes(key), parent=bytes(parent), seed=bytes(seed), tokens=tokens, tag=tag, nbytes=0)
        with self._lock:
            if self._closing:
                return False
            if nbytes is None:
                nbytes = self._payload_bytes // self._writes if self._writes else 0
            estimate = header_size(len(tokens), len(tag.encode())) + nbytes + _SUM.size
            waiting = self._queued.get(entry.key)
            if not replace and (waiting is not None or entry.key in self._index):
                return False
            counted = 0 if waiting is None or waiting.held else waiting.estimate  # what it replaces
            if not held and self._queued_bytes - counted + estimate > self.queue_bytes:
                self._dropped += 1  # a waiting write keeps its older rows
                return False
            if waiting is not None:  # the latest rows win
                waiting.entry, waiting.payload, waiting.replace = entry, payload, True
                waiting.estimate, waiting.held = estimate, held
                self._queued_bytes += (0 if held else estimate) - counted
                return True
            job = _Job(entry, payload, replace, estimate, held)
            self._queue.append(job)
            self._queued[entry.key] = job
            self._queued_bytes += 0 if held else estimate
            self._busy += 1
            self._work.notify_all()
        return True

    def release(self, key: bytes) -> None:
        """The caller no longer keeps the payload of `key`'s waiting `held` write (its page left host
        memory): the write counts against `queue_bytes` from now, or is dropped (counted, its payload
        let go) where it would pass them."""
        with self._lock:
            job = self._queued.get(key)
            if job is None or not job.held:
                return
            if self._queued_bytes + job.estimate > self.queue_bytes:
                del self._queued[key]
                job.dropped, job.payload = True, _dropped_payload
                self._dropped += 1
                self._busy -= 1
                if self._busy == 0:
                    self._work.notify_all()
                return
            job.held = False
            self._queued_bytes += job.estimate

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued write is done (or `timeout` seconds pass); whether it is."""
        with self._work:
            return self._work.wait_for(lambda: self._busy == 0, timeout)

    def _write_loop(self) -> None:
        while True:
            with self._work:
                while not self._queue and not self._closing:
                    if self._dirty_dirs:
                        break
                    self._work.wait()
                if not self._queue:
                    if self._closing:
                        break
                    job = None
                else:
                    job = self._queue.popleft()
                    if job.dropped:  # `release` counted it done
                        continue
                    del self._queued[job.entry.key]
                    self._queued_bytes -= 0 if job.held else job.estimate
            if job is None:
                self._sync_dirs()  # ran out of work: make the newest renames durable
                continue
            try:
                self._write(job)
            except Exception:  # noqa: BLE001  (a callback's or an unexpected bug: the writer must go on)
                _log.exception("disk tier: writing page %s", job.entry.key.hex())
            finally:
                with self._work:
                    self._busy -= 1
                    if self._busy == 0:
                        self._work.notify_all()
            if time.monotonic() - self._last_dir_sync > _DIR_SYNC_SECONDS:
                self._sync_dirs()
        self._sync_dirs()
        with self._lock:
            self._writer_done = True
            release = self._release_by_writer
        if release:
            self._release_lock()

    def _write(self, job: _Job) -> None:
        key = job.entry.key
        with self._lock:
            if self._closing and self._abandon:
                return
            if key in self._index and not job.replace:
                return
        try:
            views = _buffers(job.payload())
        except Exception:  # noqa: BLE001
            _log.exception("disk tier: the payload of page %s", key.hex())
            with self._lock:
                self._failed += 1
            return
        nbytes = sum(v.nbytes for v in views)
        entry = DiskEntry(key=key, parent=job.entry.parent, seed=job.entry.seed, tokens=job.entry.tokens,
                          tag=job.entry.tag, nbytes=nbytes)
        size = entry.file_bytes
        with self._announcing:
            with self._lock:
                if size > self.budget_bytes:
                    self._too_big += 1
                    return
                # never the page itself, nor its parent: a leaf until this page is indexed, and the page
                # is unreachable on disk without it
                evicted = self._evict_locked(self._bytes + self._reserved + size - self.budget_bytes,
                                             keep=(key, job.entry.parent))
                if self._bytes + self._reserved + size > self.budget_bytes:
                    # a replacement whose old and new files do not fit together, or a budget the
                    # parent alone fills: they go too
                    evicted += self._evict_locked(self._bytes + self._reserved + size - self.budget_bytes, keep=())
                self._reserved = size
            self._announce_removed(evicted)

        start = time.perf_counter()
        final = self._path(key)
        tmp = final[: -len(SUFFIX)] + TMP_SUFFIX
        try:
            header = encode_header(entry)  # raises on a token outside int32
            digest = xxhash.xxh3_64(header)
            with open(tmp, "wb") as f:
                f.write(header)
                for view in views:
                    f.write(view)
                    digest.update(view)
                f.write(_SUM.pack(digest.intdigest()))
                f.flush()
                os.fsync(f.fileno())
            with self._announcing:  # indexed and announced before any removal of it is
                with self._lock:
                    os.replace(tmp, final)
                    old = self._index.get(key)
                    if old is not None:
                        self._remove(key, old)
                    self._add(entry, size)
                    self._reserved = 0
                    self._writes += 1
                    self._written_bytes += size
                    self._payload_bytes += nbytes
                    self._write_seconds += time.perf_counter() - start
                    self._dirty_dirs.add(os.path.dirname(final))
                _call(self.on_stored, entry)
        except Exception as exc:  # noqa: BLE001  (ENOSPC, EIO, a folder removed by hand, a bad token)
            _log.warning("disk tier: could not write %s: %s", final, exc)
            remove_file(tmp)
            with self._lock:
                self._reserved = 0
                self._failed += 1

    def _sync_dirs(self) -> None:
        with self._lock:
            dirty, self._dirty_dirs = self._dirty_dirs, set()
        for name in dirty:
            fsync_dir(Path(name))
        self._last_dir_sync = time.monotonic()

    def touch(self, keys: Iterable[bytes]) -> None:
        """Mark the pages of `keys` on disk used now, in memory and in their files' mtimes, as a hit
        of `get` does, without reading them (a reader that took them some other way)."""
        paths = []
        with self._lock:
            for key in keys:
                if (item := self._index.get(key)) is not None and not self._closed:
                    item.last_access = next(self._clock)
                    self._push(key, item)
                    paths.append(self._path(key))
        for path in paths:
            set_mtime(path)

    # -- removal ----------------------------------------------------------------------------------------

    def discard(self, key: bytes) -> None:
        """Remove a page's file (its owner found the payload unusable); `on_removed` runs if it was indexed."""
        with self._announcing:
            with self._lock:
                item = self._index.get(key)
                if item is None or self._closed:
                    return
                self._remove(key, item)
                remove_file(self._path(key))
            _call(self.on_removed, item.entry)

    def _evict_locked(self, nbytes: int, keep: tuple[bytes, ...]) -> list[DiskEntry]:
        """Under the lock: remove pages in eviction order (never those of `keep`) until `nbytes` are
        freed; the removed."""
        removed: list[DiskEntry] = []
        freed = 0
        skipped = []
        while freed < nbytes and self._heap:
            item_key = heapq.heappop(self._heap)
            key = item_key[-1]
            item = self._index.get(key)
            if item is None or item.stamp != item_key[-2] or item.children:
                continue  # stale, or not a leaf (pushed again when its last child goes)
            if key in keep:
                skipped.append(item_key)
                continue
            freed += self._evict_one(key, item, removed)
        for item_key in skipped:
            heapq.heappush(self._heap, item_key)
        if freed < nbytes and not skipped:  # no leaf left to free bytes: only a forged cycle of parents does this
            rest = sorted((k for k in self._index if k not in keep),
                          key=lambda k: (self._index[k].hits > 0, self._index[k].last_access))
            for key in rest:
                if freed >= nbytes:
                    break
                freed += self._evict_one(key, self._index[key], removed)
        return removed

    def _evict_one(self, key: bytes, item: _Item, removed: list[DiskEntry]) -> int:
        self._remove(key, item)
        remove_file(self._path(key))
        self._evictions += 1
        self._evicted_bytes += item.size
        removed.append(item.entry)
        return item.size

    def _announce_removed(self, removed: Iterable[DiskEntry]) -> None:
        for entry in removed:
            _call(self.on_removed, entry)

    # -- the index (under the lock) ---------------------------------------------------------------------

    def _add(self, entry: DiskEntry, size: int) -> None:
        item = _Item(entry, size, last_access=next(self._clock), children=self._children.get(entry.key, 0))
        self._index[entry.key] = item
        self._bytes += size
        if entry.parent != entry.key:
            self._children[entry.parent] = self._children.get(entry.parent, 0) + 1
            parent = self._index.get(entry.parent)
            if parent is not None:
                parent.children += 1
        self._push(entry.key, item)

    def _remove(self, key: bytes, item: _Item) -> None:
        del self._index[key]
        self._bytes -= item.size
        item.stamp += 1
        parent_key = item.entry.parent
        if parent_key != key:
            left = self._children[parent_key] - 1
            if left:
                self._children[parent_key] = left
            else:
                del self._children[parent_key]
            parent = self._index.get(parent_key)
            if parent is not None:
                parent.children -= 1
                if not parent.children:
                    self._push(parent_key, parent)  # a leaf now: it may go

    def _push(self, key: bytes, item: _Item) -> None:
        item.stamp += 1
        heapq.heappush(self._heap, (item.hits > 0, item.last_access, next(self._serial), item.stamp, key))
        if len(self._heap) > 2 * len(self._index) + 64:
            self._heap = [h for h in self._heap if (i := self._index.get(h[-1])) is not None and i.stamp == h[-2]]
            heapq.heapify(self._heap)

    def _path(self, key: bytes) -> str:
        name = key.hex()
        return f"{self._pages}/{name[:2]}/{name}{SUFFIX}"  # a str: a Path took 6 us of each page's read

    # -- closing and metrics ----------------------------------------------------------------------------

    def close(self, timeout: float = CLOSE_WAIT_S) -> None:
        """Finish the queued writes (waiting at most `timeout` seconds; what is left then is abandoned),
        stop the writer and release the folder's lock. If the writer is still inside a write then, it
        releases the lock itself when that ends, so no other server opens the folder under a live writer."""
        with self._work:
            if self._closing:
                return
            self._closing = True
            self._work.notify_all()
        self._writer.join(timeout)
        with self._work:
            self._abandon = True
            self._closed = True
            alive = not self._writer_done
            self._release_by_writer = alive
        if alive:
            _log.warning("disk tier %s: the writer is still busy after %.0f s; it releases the folder when done",
                         self.directory, timeout)
        else:
            self._release_lock()

    def __enter__(self) -> "DiskStore":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def stats(self) -> DiskStats:
        with self._lock:
            return DiskStats(
                bytes=self._bytes, pages=len(self._index), budget_bytes=self.budget_bytes,
                hits=self._hits, misses=self._misses, writes=self._writes, written_bytes=self._written_bytes,
                read_seconds=self._read_seconds, write_seconds=self._write_seconds, refused=self._refused,
                dropped_writes=self._dropped, evictions=self._evictions, evicted_bytes=self._evicted_bytes,
                queued=self._busy, queued_bytes=self._queued_bytes, too_big=self._too_big,
                failed_writes=self._failed,
            )


def _read_head(f, size: int) -> tuple[DiskEntry, bytes, int]:  # type: ignore[no-untyped-def]
    """Parse the header of the open page file `f` of `size` bytes: its entry, the bytes read from the
    start (the header and maybe more) and the header's length; `_BadFile` unless the size is the header's."""
    head = f.read(min(size, _HEAD_READ))
    try:
        entry, hlen = decode_header(head)
    except _BadFile:
        if len(head) < _HEAD_READ or len(head) < _FIXED.size:
            raise
        n_tokens = _FIXED.unpack_from(head, 0)[-1]  # a long header: many tokens
        f.seek(0)
        head = f.read(min(size, header_size(n_tokens, MAX_TAG_BYTES)))
        entry, hlen = decode_header(head)
    expected = hlen + entry.nbytes + _SUM.size
    if size != expected:
        raise _BadFile(f"{size} bytes where the header says {expected}")
    return entry, head, hlen


def _read_expected(path: str, entry: DiskEntry, into: np.ndarray | None) -> memoryview | None:
    """The payload of the file at `path` where the file is, byte for byte, the one `entry` describes:
    its header exactly `entry`'s, its length the header's, its checksum right. One system call reads
    it (into `into` where that is large enough). None where anything differs: `_read_verified` then
    reads it with every check, and says what is wrong (or reads a page replaced since `entry`)."""
    head = encode_header(entry)
    if into is not None and into.nbytes >= entry.nbytes:
        payload = memoryview(into).cast("B")[: entry.nbytes]
    else:
        payload = memoryview(bytearray(entry.nbytes))
    found, tail, beyond = bytearray(len(head)), bytearray(_SUM.size), bytearray(1)
    fd = os.open(path, os.O_RDONLY)
    try:
        n = os.preadv(fd, [found, payload, tail, beyond], 0)  # a byte beyond the end is a file too long
    finally:
        os.close(fd)
    if n != len(head) + entry.nbytes + _SUM.size or found != head:
        return None
    digest = xxhash.xxh3_64(found)
    digest.update(payload)
    return payload if _SUM.unpack(tail)[0] == digest.intdigest() else None


def set_mtime(path: str) -> None:
    """Recency that outlives the process (a few microseconds); a file gone meanwhile has none."""
    try:
        os.utime(path)
    except OSError:
        pass


def _read_exact(f, n: int) -> bytes:  # type: ignore[no-untyped-def]
    data = f.read(n)
    if len(data) != n:  # FileIO.read of a regular file returns less only at its end
        parts = [data]
        got = len(data)
        while got < n:
            more = f.read(n - got)
            if not more:
                raise _BadFile("file cut short")
            parts.append(more)
            got += len(more)
        data = b"".join(parts)
    return data


def _read_into(f, view: memoryview) -> None:  # type: ignore[no-untyped-def]
    got = 0
    while got < len(view):
        n = f.readinto(view[got:])
        if not n:
            raise _BadFile("file cut short")
        got += n


def _call(callback: Callable[[DiskEntry], None] | None, entry: DiskEntry) -> None:
    """Run an owner's callback; one that raises is logged and does not break the store."""
    if callback is None:
        return
    try:
        callback(entry)
    except Exception:  # noqa: BLE001
        _log.exception("disk tier: a callback for page %s", entry.key.hex())


def remove_file(path: str | Path) -> None:
    """Remove a file of the tier; one already gone is no matter, any other failure is logged."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as exc:
        _log.warning("disk tier: could not remove %s: %s", path, exc)


def fsync_dir(path: Path) -> None:
    """Make the names in a folder outlive a power loss (best effort: a failure is not an error here)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)

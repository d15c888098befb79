"""Runs: a long chain of pages kept a second time on disk, whole, in one file that llama.cpp reads
itself (`Context.load_seq_file`: a layer at a time, straight into the cache), so a restart restores
a long prompt in one pass instead of one read per page into a blob and a copy of the blob. At 8,192
tokens of a 1.5B that is 40-44 ms, the checksum included, against 60-90 ms from 512 page files.

The page files stay the truth: a run is used only for pages the disk tier matched. It is named by
the key of its last page and lists every page's key (page keys chain, so a key names every page
before it, their tokens and their namespace): a prompt whose matched pages end inside a run (the
same document, another question) restores the run and cuts it there. The store knows nothing of
llama.cpp: a run's body is the bytes its writer was given.

Layout under `directory` (the disk tier's folder's `runs/`, under the disk tier's lock):

    <64 hex key>.run        the body, its pages' keys, then the trailer
    <64 hex key>.run.tmp    a run being written (removed at start)

After the body, integers little-endian: n_pages keys (32 bytes each, the last is the run's name),
then the trailer: magic b"KVSRUN\\0\\0" | u32 version | key (32 bytes) | layout (32 bytes) | u32 n_pages |
u64 body bytes | u64 XXH3-64 of everything before it. The layout names what the body's format depends on
beyond the pages' keys (for llama.cpp: the context's stream count and V's orientation): `find` only
returns runs of the layout asked for, so a restart with other settings leaves the others alone.

Invariants:
- budget: the runs' files and the one being written never exceed `budget_bytes`; the writer evicts
  the least recently used runs first, and a run larger than the budget is not written;
- crash safety: a run is written under a temporary name, fsynced, then renamed, and the folder
  fsynced; a kill leaves at most a temporary file, removed at the next start;
- nothing trusted: the start scan drops a file whose trailer does not parse, whose name is not its
  key, whose last listed key is not its name or whose size is not its trailer's; `open` checks the trailer again, `Opened.verify` the
  checksum of the open file (`Opened.path` names the open descriptor, so llama.cpp reads the very
  inode checked, even if a newer run replaces the name), and `refuse` removes a file found wrong
  (counted in `refused`);
- a checksum read once: where `warm` read a run whole and its checksum was right, the file's identity
  (device, inode, size, modification and change times) stands for it while that is unchanged; any
  write to the file, or a new file under its name, changes it. `verify` then reads nothing (a restart's
  first restore of 8,192 tokens waited 5-8 ms for the check, which competed with llama.cpp's read);
- a run written for the pages `keys` removes the runs named by their earlier keys: those pages are
  its prefix (a conversation keeps one run, its latest);
- at start, `warm` reads the newest runs that fit a budget into the page cache, off the engine's
  thread, hashing them as it reads; `open` checks each run's trailer again when it is used;
- staged: the newest of them, where it is no larger than `warm`'s `stage_bytes`, is read into memory
  of its own and hashed there; found right, its body is kept (`take_staged`), at most one run, until
  its first restore takes it, the run leaves the index, or `drop_staged` (the host tier wants the
  memory). A restore from it is one copy into the cache, not a read and a copy (2,048 tokens of a
  1.5B: 8 ms against 13 ms for llama.cpp's read of the file, page cache warm);
- the engine never waits on a write: `put` queues at most `QUEUE` runs (a newer one drops the oldest
  waiting, counted), and their bodies are built on the writer thread.
"""

from __future__ import annotations

import collections
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

from kvserve.cache.disk_store import CLOSE_WAIT_S, fsync_dir, remove_file, set_mtime

_log = logging.getLogger("kvserve.cache")

MAGIC = b"KVSRUN\0\0"
VERSION = 1
SUFFIX = ".run"
TMP_SUFFIX = ".run.tmp"
BACKGROUND_NICE = 10  # the niceness of the writer's and the warming threads (Linux: per thread)
QUEUE = 2  # runs waiting to be written: each holds its pages' memory until it is
MIN_TOKENS = 1024  # a shorter prompt reads its few pages as fast as a run (2,048 tokens: 1.19x llama-server)
_TRAILER = struct.Struct("<8sI32s32sIQ")  # magic, version, key, layout, n_pages, body bytes
_SUM = struct.Struct("<Q")
TRAILER_BYTES = _TRAILER.size + _SUM.size
KEY_BYTES = 32
READ_CHUNK = 4 << 20  # what `verify` and `warm` read at once: the pages stay in the CPU's cache for the hash
# a file's change time moves in the kernel's coarse ticks (10 ms at most): a check begun this long
# after the file last changed sees any later write as a new change time
SETTLED_NS = 50_000_000

Body = Iterable["bytes | bytearray | memoryview | np.ndarray"]


@dataclass(eq=False)
class _Run:
    keys: tuple[bytes, ...]  # its pages' keys: the last is its name
    layout: bytes
    size: int  # file bytes
    last_access: int

    @property
    def key(self) -> bytes:
        return self.keys[-1]


@dataclass(eq=False)
class _Job:
    keys: tuple[bytes, ...]  # every page's key, in order: the run is named by the last
    layout: bytes
    nbytes: int  # the body's
    body: Callable[[], Body]


@dataclass(frozen=True)
class RunStats:
    runs: int
    bytes: int
    budget_bytes: int
    hits: int
    writes: int
    written_bytes: int
    write_seconds: float
    refused: int
    dropped_writes: int
    evictions: int
    staged_bytes: int  # the run staged in memory at start, until a restore takes it
    staged_hits: int  # restores from it


class Opened:
    """A run's file, open. `path` names the open descriptor: what llama.cpp reads through it is
    what `verify` checks."""

    def __init__(self, fd: int, checked: int, checksum: int, read_right: bool = False) -> None:
        self._fd, self._checked, self._checksum = fd, checked, checksum
        self.read_right = read_right  # this very file was read whole and its checksum was right (`warm`)

    @property
    def path(self) -> str:
        return f"/proc/self/fd/{self._fd}"

    def verify(self) -> bool:
        """Whether the file's checksum is right (everything before it), read through a small buffer.
        Safe on another thread while llama.cpp reads the file. (A mapping cost more than the hash: a
        run just written sits in 4 KiB pages of the page cache, and mapping 224 MB of them took 14-17
        ms, unmapping 6-7 ms more; the engine then waited for the check after the load.)"""
        try:
            return self.read_right or _sums_to(self._fd, self._checked, self._checksum)
        except OSError:
            return False

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> "Opened":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class RunStore:
    """Runs in files under `directory`, at most `budget_bytes` of them; `min_tokens`: the shortest
    run worth a file of its own."""

    def __init__(self, directory: Path, budget_bytes: int, min_tokens: int | None = None) -> None:
        self.directory = Path(directory)
        self.budget_bytes = budget_bytes
        self.min_tokens = MIN_TOKENS if min_tokens is None else min_tokens
        self._lock = threading.Lock()
        self._work = threading.Condition(self._lock)
        self._runs: dict[bytes, _Run] = {}
        self._holding: dict[bytes, set[bytes]] = {}  # a page's key -> the runs that hold it
        self._read_right: dict[bytes, tuple[int, ...]] = {}  # a run -> its file's identity, read whole and right
        self._staged: tuple[bytes, np.ndarray] | None = None  # a run's name and body, read and found right
        self._clock = 0
        self._bytes = 0
        self._queue: collections.deque[_Job] = collections.deque()
        self._busy = 0
        self._closing = False
        self._hits = self._writes = self._written_bytes = self._refused = self._dropped = self._evictions = 0
        self._staged_hits = 0
        self._write_seconds = 0.0
        self.directory.mkdir(parents=True, exist_ok=True)
        self._scan()
        self._evict(self._bytes - budget_bytes)
        self._writer = threading.Thread(target=self._write_loop, name="kvserve-run-writer", daemon=True)
        self._writer.start()

    def _scan(self) -> None:
        found = []
        for file in os.scandir(self.directory):
            if file.name.endswith(TMP_SUFFIX):
                remove_file(file.path)
            elif file.name.endswith(SUFFIX):
                try:
                    with open(file.path, "rb", buffering=0) as f:
                        st = os.fstat(f.fileno())
                        keys, layout, _ = _listed(f.fileno(), st.st_size)
                    if file.name != keys[-1].hex() + SUFFIX:
                        raise RunFileError("the file's name is not its key")
                except (RunFileError, OSError) as exc:
                    _log.warning("runs: removing %s: %s", file.path, exc)
                    remove_file(file.path)
                    self._refused += 1
                    continue
                found.append((st.st_mtime_ns, keys, layout, st.st_size))
        for _mtime, keys, layout, size in sorted(found):
            self._add(keys, layout, size)

    # -- reading --------------------------------------------------------------------------------------

    def find(self, page: bytes, layout: bytes) -> tuple[bytes, int] | None:
        """The shortest run of `layout` holding the page keyed `page`: its name and page count; or None
        (no IO)."""
        with self._lock:
            runs = [run for name in self._holding.get(page, ()) if (run := self._runs[name]).layout == layout]
        if not runs:
            return None
        run = min(runs, key=lambda r: len(r.keys))
        return run.key, len(run.keys)

    def open(self, key: bytes) -> Opened | None:
        """The run named `key`, open with its trailer and keys checked against the index, or None:
        not there, or refused (then removed)."""
        with self._lock:
            run = self._runs.get(key)
        if run is None:
            return None
        path = self._path(key)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            self._forget(key)
            return None
        try:
            st = os.fstat(fd)
            size = st.st_size
            keys, layout, checksum = _listed(fd, size)
            if keys != run.keys or layout != run.layout:
                raise RunFileError("the file lists other pages than its name's")
        except (RunFileError, OSError) as exc:
            os.close(fd)
            self.refuse(key, str(exc))
            return None
        with self._lock:
            read_right = self._read_right.get(key) == _identity(st)
        return Opened(fd, size - _SUM.size, checksum, read_right)

    def warm(self, budget_bytes: int, stage_bytes: int = 0) -> threading.Thread:
        """Read the most recently used runs that fit in `budget_bytes`, newest first, into the
        kernel's page cache, on a thread of its own, while the model loads: a restarted server's
        first requests then restore from memory, not from the disk (a run of 8,192 tokens of a 1.5B,
        224 MB, loaded in 150-540 ms once evicted from the page cache, against 25-35 ms cached;
        `posix_fadvise(WILLNEED)` read 8 MB of it). Each is hashed as it is read: a run found right
        is not read again to be verified while its file is unchanged. A run removed meanwhile is
        passed over. The newest, where it is at most `stage_bytes`, is staged (`take_staged`)."""
        with self._lock:
            newest = sorted(self._runs.values(), key=lambda run: run.last_access, reverse=True)
        keys, total = [], 0
        for run in newest:
            if total + run.size <= budget_bytes:
                keys.append(run.key)
                total += run.size
        stage = newest[0].key if newest and newest[0].size <= min(stage_bytes, budget_bytes) else None
        thread = threading.Thread(target=self._read_ahead, args=(keys, stage), name="kvserve-run-warm", daemon=True)
        thread.start()
        return thread

    def _read_ahead(self, keys: list[bytes], stage: bytes | None = None) -> None:
        """Each run's file read whole, and so in the page cache (the run named `stage` into memory of
        its own); the identity of each whose checksum was right, where it had not changed for
        `SETTLED_NS` when the read began (a write in the same tick as the file's last change would keep
        its change time)."""
        _lower_priority()
        for key in keys:
            began = time.time_ns()
            try:
                fd = os.open(self._path(key), os.O_RDONLY | os.O_CLOEXEC)
            except OSError:
                continue
            try:
                before = os.fstat(fd)
                checked = before.st_size - _SUM.size
                staged = _read_whole(fd, before.st_size) if key == stage else None
                listed, _, checksum = _listed(fd, before.st_size)
                if staged is not None:
                    right = xxhash.xxh3_64_intdigest(staged[:checked]) == checksum
                else:
                    right = _sums_to(fd, checked, checksum)
                if right and _identity(os.fstat(fd)) == _identity(before) and began - before.st_ctime_ns >= SETTLED_NS:
                    with self._lock:
                        if (run := self._runs.get(key)) is not None:
                            self._read_right[key] = _identity(before)
                            if staged is not None and listed == run.keys and not self._hits:  # none restored yet
                                self._staged = key, staged[: checked - len(run.keys) * KEY_BYTES - _TRAILER.size]
            except (OSError, RunFileError, ValueError):
                pass  # `open` and `verify` judge it when it is used
            finally:
                os.close(fd)

    def take_staged(self, key: bytes) -> np.ndarray | None:
        """The body of the run named `key` where it is the one staged (it then stops being), else None."""
        with self._lock:
            if self._staged is None or self._staged[0] != key:
                return None
            body, self._staged = self._staged[1], None
            return body

    @property
    def staged_bytes(self) -> int:
        with self._lock:
            return self._staged_nbytes()

    def _staged_nbytes(self) -> int:
        return self._staged[1].nbytes if self._staged is not None else 0

    def drop_staged(self) -> None:
        with self._lock:
            self._staged = None

    def restored(self, key: bytes, staged: bool = False) -> None:
        """The run named `key` restored a prompt (`staged`: from memory): a hit, and it turns most
        recently used."""
        with self._lock:
            if (run := self._runs.get(key)) is None:
                return
            self._hits += 1
            self._staged_hits += staged
            if self._staged is not None and self._staged[0] == key:
                self._staged = None  # its pages come into host memory now
            self._clock += 1
            run.last_access = self._clock
        set_mtime(self._path(key))

    def refuse(self, key: bytes, problem: str) -> None:
        """The run named `key` was found wrong: remove it, and count it."""
        _log.warning("runs: refusing %s: %s", key.hex(), problem)
        with self._lock:
            self._refused += 1
        self._forget(key)

    def _forget(self, key: bytes) -> None:
        with self._lock:
            self._drop(key)
        remove_file(self._path(key))

    # -- writing --------------------------------------------------------------------------------------

    def put(self, keys: Sequence[bytes], layout: bytes, nbytes: int, body: Callable[[], Body]) -> None:
        """Queue the run of the pages `keys` in `layout`: a body of `nbytes`, made on the writer thread
        by `body()`, in parts written as they come."""
        with self._lock:
            if self._closing:
                return
            if len(self._queue) >= QUEUE:
                self._queue.popleft()
                self._busy -= 1
                self._dropped += 1
            self._queue.append(_Job(tuple(keys), layout, nbytes, body))
            self._busy += 1
            self._work.notify_all()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued run is written; False if `timeout` ran out first."""
        with self._lock:
            return self._work.wait_for(lambda: self._busy == 0, timeout)

    def _write_loop(self) -> None:
        _lower_priority()  # a run is an accelerator: on a busy box the decode threads go first
        while True:
            with self._lock:
                self._work.wait_for(lambda: self._queue or self._closing)
                if not self._queue:
                    return
                job = self._queue.popleft()
            try:
                self._write(job)
            except Exception:  # noqa: BLE001
                _log.exception("runs: writing %s", job.keys[-1].hex())
            finally:
                with self._lock:
                    self._busy -= 1
                    self._work.notify_all()

    def _write(self, job: _Job) -> None:
        key = job.keys[-1]
        for earlier in job.keys[:-1]:  # a prefix of this run: superseded
            if earlier in self._runs:
                self._forget(earlier)  # superseded
        start = time.perf_counter()
        body = job.nbytes
        size = body + len(job.keys) * KEY_BYTES + TRAILER_BYTES
        if size > self.budget_bytes:
            return
        with self._lock:
            old = self._runs.get(key)
        self._evict(self._bytes - (old.size if old else 0) + size - self.budget_bytes, keep=key)
        final = self._path(key)
        tmp = final[: -len(SUFFIX)] + TMP_SUFFIX
        try:
            trailer = _TRAILER.pack(MAGIC, VERSION, key, job.layout, len(job.keys), body)
            digest, written = xxhash.xxh3_64(), 0
            with open(tmp, "wb") as f:
                for part in job.body():
                    view = memoryview(np.ascontiguousarray(part) if isinstance(part, np.ndarray) else part).cast("B")
                    f.write(view)
                    digest.update(view)
                    written += view.nbytes
                if written != body:
                    raise RunFileError(f"a body of {written} bytes where {body} were announced")
                for part in (b"".join(job.keys), trailer):
                    f.write(part)
                    digest.update(part)
                f.write(_SUM.pack(digest.intdigest()))
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, final)
            fsync_dir(self.directory)
        except Exception as exc:  # noqa: BLE001  (ENOSPC, EIO, a body that raised or lied about its size)
            _log.warning("runs: could not write %s: %s", final, exc)
            remove_file(tmp)
            return
        with self._lock:
            if old is not None and self._runs.get(key) is old:
                self._drop(key)
            self._add(job.keys, job.layout, size)
            self._writes += 1
            self._written_bytes += size
            self._write_seconds += time.perf_counter() - start

    def _evict(self, nbytes: int, keep: bytes = b"") -> None:
        """Remove the least recently used runs (never `keep`) until `nbytes` are freed."""
        while nbytes > 0:
            with self._lock:
                others = [run for run in self._runs.values() if run.key != keep]
                if not others:
                    return
                run = min(others, key=lambda r: r.last_access)
                self._drop(run.key)
                self._evictions += 1
            remove_file(self._path(run.key))
            nbytes -= run.size

    def _add(self, keys: tuple[bytes, ...], layout: bytes, size: int) -> None:
        self._clock += 1
        self._runs[keys[-1]] = _Run(keys, layout, size, self._clock)
        self._bytes += size
        for page in keys:
            self._holding.setdefault(page, set()).add(keys[-1])

    def _drop(self, key: bytes) -> None:
        """Take the run named `key` out of the index (under the lock)."""
        run = self._runs.pop(key, None)
        self._read_right.pop(key, None)
        if self._staged is not None and self._staged[0] == key:
            self._staged = None
        if run is None:
            return
        self._bytes -= run.size
        for page in run.keys:
            held = self._holding.get(page)
            if held is not None:
                held.discard(key)
                if not held:
                    del self._holding[page]

    def _path(self, key: bytes) -> str:
        return str(self.directory / (key.hex() + SUFFIX))

    def close(self, timeout: float = CLOSE_WAIT_S) -> None:
        """Write what is queued (up to `timeout`), then stop the writer."""
        self.flush(timeout)
        with self._lock:
            self._closing = True
            self._queue.clear()
            self._work.notify_all()
        self._writer.join(timeout)

    def stats(self) -> RunStats:
        with self._lock:
            return RunStats(runs=len(self._runs), bytes=self._bytes, budget_bytes=self.budget_bytes, hits=self._hits,
                            writes=self._writes, written_bytes=self._written_bytes,
                            write_seconds=self._write_seconds, refused=self._refused, dropped_writes=self._dropped,
                            evictions=self._evictions, staged_bytes=self._staged_nbytes(),
                            staged_hits=self._staged_hits)


def _identity(st: os.stat_result) -> tuple[int, ...]:
    """What any write to a file, or another file under its name, changes."""
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


def _sums_to(fd: int, nbytes: int, checksum: int) -> bool:
    """Whether the file's first `nbytes`, read through `_read_through`, hash to `checksum` (False where
    the file ends first)."""
    digest = xxhash.xxh3_64()
    return _read_through(fd, nbytes, digest.update) and digest.intdigest() == checksum


def _read_whole(fd: int, size: int) -> np.ndarray | None:
    """The file's `size` bytes in memory of their own, or None where it ends first."""
    out = np.empty(size, np.uint8)
    view, at = memoryview(out), 0
    while at < size:
        n = os.preadv(fd, [view[at : min(size, at + READ_CHUNK)]], at)
        if n <= 0:
            return None
        at += n
    return out


def _read_through(fd: int, nbytes: int, each: Callable[[memoryview], object]) -> bool:
    """The file's first `nbytes` read in order through one buffer of `READ_CHUNK` bytes, each
    piece given to `each`; False where the file ends first."""
    buffer = memoryview(bytearray(min(READ_CHUNK, nbytes)))
    at = 0
    while at < nbytes:
        n = os.preadv(fd, [buffer[: min(len(buffer), nbytes - at)]], at)
        if n <= 0:
            return False
        each(buffer[:n])
        at += n
    return True


def _lower_priority() -> None:
    """This thread at `BACKGROUND_NICE` (Linux sets niceness per thread)."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), BACKGROUND_NICE)
    except (OSError, AttributeError):
        pass


class RunFileError(Exception):
    """A run's file is not what its name and trailer say."""


def _listed(fd: int, size: int) -> tuple[tuple[bytes, ...], bytes, int]:
    """The page keys a run file lists, its layout and its checksum; RunFileError unless its trailer parses, the
    last key listed is the trailer's, and the file's size is what the trailer says."""
    if size < TRAILER_BYTES:
        raise RunFileError("shorter than a trailer")
    data = os.pread(fd, TRAILER_BYTES, size - TRAILER_BYTES)
    if len(data) != TRAILER_BYTES:
        raise RunFileError("the trailer could not be read")
    magic, version, key, layout, n_pages, body = _TRAILER.unpack_from(data)
    if magic != MAGIC or version != VERSION:
        raise RunFileError("not a run file of this version")
    expected = body + n_pages * KEY_BYTES + TRAILER_BYTES
    if expected != size or n_pages < 1:
        raise RunFileError(f"{size} bytes where the trailer says {expected}")
    listed = os.pread(fd, n_pages * KEY_BYTES, body)
    keys = tuple(listed[i : i + KEY_BYTES] for i in range(0, len(listed), KEY_BYTES))
    if len(keys) != n_pages or keys[-1] != key:
        raise RunFileError("its last page's key is not the trailer's")
    return keys, layout, _SUM.unpack_from(data, _TRAILER.size)[0]

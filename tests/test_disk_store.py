"""The disk tier: round trips, one server per folder (across processes too), files that lie, the
byte budget on the real files, eviction order, a full queue, and a kill -9 in the middle of writes."""

from __future__ import annotations

import hashlib
import os
import random
import shutil
import signal
import subprocess
import sys
import struct
import threading
import time
import types
import zlib
from pathlib import Path

import numpy as np
import pytest
import xxhash

from kvserve.cache.disk_store import (
    MAGIC, SUFFIX, TMP_SUFFIX, VERSION, DiskEntry, DiskLocked, DiskStore, decode_header, encode_header, header_size,
)
from kvserve.cache.page_events import announce_start
from kvserve.config import ServerSettings
from kvserve.server import persistence

REPO = Path(__file__).resolve().parent.parent
SEED = hashlib.sha256(b"namespace").digest()


def key_of(parent: bytes, tokens: list[int]) -> bytes:
    return hashlib.sha256(parent + np.asarray(tokens, dtype="<i4").tobytes()).digest()


def page(i: int, parent: bytes = SEED) -> tuple[bytes, bytes, list[int]]:
    tokens = [i, i + 1, i + 2, i + 3]
    return key_of(parent, tokens), parent, tokens


def put(store: DiskStore, i: int, payload: bytes, parent: bytes = SEED, **kw: object) -> bytes:
    key, parent, tokens = page(i, parent)
    assert store.put(key, parent, SEED, tokens, lambda: payload, tag="model-a", **kw)  # type: ignore[arg-type]
    return key


PAGE_FILE = DiskEntry(SEED, SEED, SEED, (0, 1, 2, 3), "model-a", 1000).file_bytes  # what `put` writes of 1000 bytes


def files_on_disk(directory: Path) -> dict[str, int]:
    """Every file under pages/ (the store's 256 folders), by name, with its size."""
    files = {}
    with os.scandir(directory / "pages") as subs:
        for sub in subs:
            with os.scandir(sub.path) as names:
                files.update((f.name, f.stat().st_size) for f in names if f.is_file())
    return files


def path_of(directory: Path, key: bytes) -> Path:
    return directory / "pages" / key.hex()[:2] / (key.hex() + SUFFIX)


def assert_index_is_the_files(store: DiskStore) -> None:
    files = files_on_disk(store.directory)
    assert not [name for name in files if name.endswith(TMP_SUFFIX)]
    assert {e.key.hex() + SUFFIX for e in store.entries()} == set(files)
    assert store.stats().bytes == sum(files.values()) == sum(e.file_bytes for e in store.entries())


class Recorder:
    """The callbacks, and the set of keys an event consumer would believe are on disk (the store logs
    and swallows what a callback raises, so what goes wrong is kept in `errors`)."""

    def __init__(self) -> None:
        self.stored: list[DiskEntry] = []
        self.removed: list[DiskEntry] = []
        self.announced: set[bytes] = set()
        self.errors: list[str] = []

    def on_stored(self, entry: DiskEntry) -> None:
        self.stored.append(entry)
        self.announced.add(entry.key)

    def on_removed(self, entry: DiskEntry) -> None:
        if entry.key not in self.announced:
            self.errors.append(f"{entry.key.hex()} removed without having been stored")
        self.removed.append(entry)
        self.announced.discard(entry.key)

    def check(self, store: DiskStore) -> None:
        """What the callbacks announced is what is on disk."""
        assert not self.errors
        assert self.announced == {e.key for e in store.entries()}

    def open(self, directory: Path, budget: int, queue_bytes: int = 256 << 20) -> DiskStore:
        return DiskStore(directory, budget, queue_bytes=queue_bytes, on_stored=self.on_stored,
                         on_removed=self.on_removed)


# -- round trips ------------------------------------------------------------------------------------------


def test_put_flush_get_round_trip(tmp_path: Path) -> None:
    rec = Recorder()
    with rec.open(tmp_path, 1 << 20) as store:
        key, parent, tokens = page(1)
        rows = np.arange(1000, dtype=np.float16).reshape(10, 100)
        parts = lambda: [b"head", memoryview(b"-mid-"), rows, rows[:, ::2]]  # noqa: E731  (a strided view too)
        assert store.put(key, parent, SEED, tokens, parts, tag="smollm2")
        assert store.flush(5)
        expected = b"head-mid-" + rows.tobytes() + np.ascontiguousarray(rows[:, ::2]).tobytes()
        assert store.get(key) == expected
        entry = store.entry(key)
        assert entry == DiskEntry(key, parent, SEED, tuple(tokens), "smollm2", len(expected))
        assert store.contains(key) and key in store and len(store) == 1
        assert rec.stored == [entry] and rec.removed == []
        # on disk already and not replaced: no second write
        assert not store.put(key, parent, SEED, tokens, lambda: b"other")
        missing = page(2)[0]
        assert store.get(missing) is None and not store.contains(missing) and store.entry(missing) is None
        stats = store.stats()
        assert (stats.hits, stats.misses, stats.writes, stats.pages, stats.refused) == (1, 1, 1, 1, 0)
        assert stats.bytes == stats.written_bytes == path_of(tmp_path, key).stat().st_size == entry.file_bytes
        assert stats.read_seconds > 0 and stats.write_seconds > 0 and stats.queued == 0
        assert_index_is_the_files(store)
        rec.check(store)


def test_replace_rewrites_a_page_that_gained_rows(tmp_path: Path) -> None:
    rec = Recorder()
    with rec.open(tmp_path, 1 << 20) as store:
        key = put(store, 1, b"a" * 100)
        store.flush(5)
        assert put(store, 1, b"b" * 300, replace=True)
        store.flush(5)
        assert store.get(key) == b"b" * 300 and store.entry(key).nbytes == 300  # type: ignore[union-attr]
        # the key stayed on disk throughout: stored twice, never removed
        assert [e.nbytes for e in rec.stored] == [100, 300] and rec.removed == []
        assert store.stats().writes == 2
        assert_index_is_the_files(store)
        rec.check(store)


def test_a_replacement_too_big_to_sit_beside_its_old_file_takes_its_place(tmp_path: Path) -> None:
    rec = Recorder()
    with rec.open(tmp_path, 1000) as store:
        key = put(store, 1, b"a" * 500)
        store.flush(5)
        assert put(store, 1, b"b" * 700, replace=True)
        store.flush(5)
        assert store.get(key) == b"b" * 700 and [e.nbytes for e in rec.removed] == [500]
        assert_index_is_the_files(store)
        rec.check(store)


def test_a_raising_callback_does_not_break_the_store(tmp_path: Path) -> None:
    def boom(entry: DiskEntry) -> None:
        raise RuntimeError("the owner's bug")

    with DiskStore(tmp_path, 3 * PAGE_FILE, on_stored=boom, on_removed=boom) as store:
        keys = [put(store, i, b"." * 1000) for i in range(5)]
        store.flush(5)
        store.discard(keys[4])
        assert store.stats().writes == 5 and store.stats().evictions == 2 and len(store) == 2
        assert store.get(keys[3]) == b"." * 1000
        assert_index_is_the_files(store)


def test_survives_close_and_reopen(tmp_path: Path) -> None:
    with DiskStore(tmp_path, 1 << 20) as store:
        keys = [put(store, i, bytes([i]) * (100 + i)) for i in range(20)]
        store.get(keys[0])
    with DiskStore(tmp_path, 1 << 20) as store:  # close finished the queued writes
        assert sorted(e.key for e in store.entries()) == sorted(keys)
        assert all(store.get(k) == bytes([i]) * (100 + i) for i, k in enumerate(keys))
        stats = store.stats()
        assert stats.hits == 20 and stats.writes == 0 and stats.refused == 0
        assert store.entry(keys[3]).tag == "model-a"  # type: ignore[union-attr]
        assert_index_is_the_files(store)


def test_entries_list_parents_before_children(tmp_path: Path) -> None:
    with DiskStore(tmp_path, 1 << 20) as store:
        chain = [SEED]
        for i in range(6):  # written leaf first, so the scan's mtime order is the wrong one
            chain.append(page(i, chain[-1])[0])
        for i in reversed(range(6)):
            put(store, i, b"x" * 10, parent=chain[i])
    with DiskStore(tmp_path, 1 << 20) as store:
        assert [e.key for e in store.entries()] == chain[1:]


def test_bad_arguments(tmp_path: Path) -> None:
    with DiskStore(tmp_path, 1 << 20) as store:
        key, parent, tokens = page(1)
        with pytest.raises(ValueError, match="key"):
            store.put(key[:31], parent, SEED, tokens, lambda: b"")
        with pytest.raises(ValueError, match="tag"):
            store.put(key, parent, SEED, tokens, lambda: b"", tag="é" * 128)
        with pytest.raises(ValueError, match="budget"):
            DiskStore(tmp_path / "other", -1)


def test_a_failing_payload_is_counted_and_the_writer_goes_on(tmp_path: Path) -> None:
    with DiskStore(tmp_path, 1 << 20) as store:
        key, parent, tokens = page(1)
        assert store.put(key, parent, SEED, tokens, lambda: 1 / 0)
        second = put(store, 2, b"fine")
        assert store.flush(5)
        assert store.stats().failed_writes == 1 and not store.contains(key) and store.get(second) == b"fine"
        assert_index_is_the_files(store)


def test_closed_store_refuses_puts_and_answers_no_gets(tmp_path: Path) -> None:
    store = DiskStore(tmp_path, 1 << 20)
    key = put(store, 1, b"x")
    store.close()
    store.close()  # twice is fine
    k2, parent, tokens = page(2)
    assert not store.put(k2, parent, SEED, tokens, lambda: b"y")
    assert store.get(key) is None


# -- one server per folder ------------------------------------------------------------------------------


def test_second_store_on_the_folder_is_locked_out(tmp_path: Path) -> None:
    first = DiskStore(tmp_path, 1 << 20)
    with pytest.raises(DiskLocked, match=f"{tmp_path}.*pid {os.getpid()}"):
        DiskStore(tmp_path, 1 << 20)
    first.close()
    DiskStore(tmp_path, 1 << 20).close()  # released on close


OPEN_IN_CHILD = """
import sys
from pathlib import Path
from kvserve.cache.disk_store import DiskLocked, DiskStore
try:
    store = DiskStore(Path(sys.argv[1]), 1 << 20)
except DiskLocked as exc:
    print("LOCKED", exc, flush=True)
    sys.exit(3)
print("OPEN", flush=True)
sys.stdin.readline()  # hold the folder until told
store.close()
"""


def python(code: str, *args: str, **kw: object) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.Popen([sys.executable, "-c", code, *args], env=env, text=True,  # type: ignore[call-overload]
                            stdout=subprocess.PIPE, stdin=subprocess.PIPE, **kw)


def test_the_lock_holds_across_processes(tmp_path: Path) -> None:
    with DiskStore(tmp_path, 1 << 20):
        child = python(OPEN_IN_CHILD, str(tmp_path))
        out, _ = child.communicate(timeout=60)
        assert child.returncode == 3 and "LOCKED" in out and f"pid {os.getpid()}" in out
    # and the other way round: a live child holds it, this process is locked out, then gets it
    child = python(OPEN_IN_CHILD, str(tmp_path))
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "OPEN"
        with pytest.raises(DiskLocked, match=f"pid {child.pid}"):
            DiskStore(tmp_path, 1 << 20)
    finally:
        child.communicate("\n", timeout=60)
    assert child.returncode == 0
    DiskStore(tmp_path, 1 << 20).close()


def test_run_bytes_is_the_longest_chain_of_a_models_pages(tmp_path: Path) -> None:
    with DiskStore(tmp_path, 1 << 20) as store:
        a = put(store, 1, b"a" * 100)
        b = put(store, 2, b"b" * 200, parent=a)
        put(store, 3, b"c" * 300, parent=b)
        put(store, 4, b"d" * 550, parent=a)  # a branch: a + d is 650, a + b + c 600
        key, parent, tokens = page(5)
        assert store.put(key, parent, SEED, tokens, lambda: b"e" * 900, tag="model-b")
        assert store.flush(5)
        assert store.run_bytes("model-a") == 650 and store.run_bytes("model-b") == 900
        assert store.run_bytes("model-c") == 0
        key, parent, tokens = page(6)  # a page computed under an adapter is its model's too
        assert store.put(key, parent, SEED, tokens, lambda: b"f" * 1000, tag="model-c\x1fA*1.0")
        assert store.flush(5) and store.run_bytes("model-c") == 1000 and store.run_bytes("model-c\x1fA*1.0") == 0


# -- files that lie -------------------------------------------------------------------------------------


def test_a_flipped_payload_byte_is_refused_and_removed(tmp_path: Path) -> None:
    rec = Recorder()
    with rec.open(tmp_path, 1 << 20) as store:
        key = put(store, 1, bytes(range(256)) * 4)
        store.flush(5)
        path = path_of(tmp_path, key)
        data = bytearray(path.read_bytes())
        data[len(data) - 100] ^= 0x01  # inside the payload: only the checksum can tell
        path.write_bytes(bytes(data))
        assert store.get(key) is None
        stats = store.stats()
        assert (stats.refused, stats.hits, stats.misses, stats.pages, stats.bytes) == (1, 0, 1, 0, 0)
        assert not path.exists() and not store.contains(key)
        assert [e.key for e in rec.removed] == [key] and rec.announced == set()
        assert store.get(key) is None and store.stats().refused == 1  # now just a miss
        rec.check(store)


def test_a_flipped_header_byte_is_refused(tmp_path: Path) -> None:
    with DiskStore(tmp_path, 1 << 20) as store:
        key = put(store, 1, b"p" * 1000)
        store.flush(5)
        path = path_of(tmp_path, key)
        data = bytearray(path.read_bytes())
        data[8 + 4 + 32 + 5] ^= 0x80  # a byte of the parent's key
        path.write_bytes(bytes(data))
        assert store.get(key) is None and store.stats().refused == 1 and not path.exists()


@pytest.mark.parametrize("when", ["at reopen", "at get"])
def test_a_truncated_file_is_refused(tmp_path: Path, when: str) -> None:
    store = DiskStore(tmp_path, 1 << 20)
    keep, cut = put(store, 1, b"k" * 500), put(store, 2, b"c" * 500)
    store.flush(5)
    path = path_of(tmp_path, cut)
    os.truncate(path, path.stat().st_size - 1)
    if when == "at reopen":
        store.close()
        store = DiskStore(tmp_path, 1 << 20)
        assert store.stats().refused == 1 and not store.contains(cut)
    else:
        assert store.get(cut) is None and store.stats().refused == 1
    assert not path.exists() and store.get(keep) == b"k" * 500
    assert_index_is_the_files(store)
    store.close()


def test_a_file_grown_by_a_byte_is_refused_at_get(tmp_path: Path) -> None:
    """One read takes the header, payload and checksum the index expects, and one byte more: a file
    longer than its header says is caught by that byte."""
    with DiskStore(tmp_path, 1 << 20) as store:
        key = put(store, 1, b"g" * 500)
        store.flush(5)
        with open(path_of(tmp_path, key), "ab") as f:
            f.write(b"\0")
        buffer = np.empty(1000, np.uint8)
        assert store.get(key, into=buffer) is None and store.stats().refused == 1
        assert not path_of(tmp_path, key).exists()


def test_a_page_replaced_since_it_was_indexed_is_read_not_refused(tmp_path: Path) -> None:
    """The index expects one file; a valid file of the same key with another payload (a page rewritten
    with more rows, as the writer replaces it) stands there: read and returned, not refused."""
    with DiskStore(tmp_path / "a", 1 << 20) as store, DiskStore(tmp_path / "b", 1 << 20) as other:
        key = put(store, 1, b"o" * 500)
        assert put(other, 1, b"n" * 700) == key
        store.flush(5)
        other.flush(5)
        path_of(tmp_path / "a", key).write_bytes(path_of(tmp_path / "b", key).read_bytes())
        for into in (None, np.empty(1000, np.uint8)):
            assert bytes(store.get(key, into=into)) == b"n" * 700  # type: ignore[arg-type]
        assert store.stats().refused == 0


def test_swapped_file_names_are_refused(tmp_path: Path) -> None:
    with DiskStore(tmp_path, 1 << 20) as store:
        a, b = put(store, 1, b"a" * 64), put(store, 2, b"b" * 64)
    pa, pb = path_of(tmp_path, a), path_of(tmp_path, b)
    data_a, data_b = pa.read_bytes(), pb.read_bytes()
    pa.write_bytes(data_b)
    pb.write_bytes(data_a)
    with DiskStore(tmp_path, 1 << 20) as store:  # the scan checks each name against its header's key
        assert store.stats().refused == 2 and len(store) == 0 and files_on_disk(tmp_path) == {}


def test_a_file_naming_another_key_is_refused_at_get(tmp_path: Path) -> None:
    """Swapped while the store is open: the index knows `a`, the file now says `b` (checksum valid)."""
    rec = Recorder()
    with rec.open(tmp_path, 1 << 20) as store:
        a, b = put(store, 1, b"a" * 64), put(store, 2, b"b" * 64)
        store.flush(5)
        path_of(tmp_path, a).write_bytes(path_of(tmp_path, b).read_bytes())
        assert store.get(a) is None and store.stats().refused == 1
        assert store.get(b) == b"b" * 64 and [e.key for e in rec.removed] == [a]
        assert_index_is_the_files(store)
        rec.check(store)


def test_a_valid_file_under_a_foreign_name_is_refused_at_scan(tmp_path: Path) -> None:
    with DiskStore(tmp_path, 1 << 20) as store:
        a = put(store, 1, b"a" * 64)
    other = page(9)[0]
    path_of(tmp_path, other).parent.mkdir(parents=True, exist_ok=True)
    path_of(tmp_path, a).rename(path_of(tmp_path, other))
    with DiskStore(tmp_path, 1 << 20) as store:
        assert store.stats().refused == 1 and len(store) == 0 and files_on_disk(tmp_path) == {}


def raw_file(key: bytes, payload: bytes, *, version: int = VERSION, tag: bytes = b"", parent: bytes = SEED) -> bytes:
    """A page file written by hand, checksum right, with what the store would never write."""
    body = b"".join((MAGIC, struct.pack("<I32s32s32sI", version, key, parent, SEED, 2), struct.pack("<2i", 7, 8),
                     struct.pack("<H", len(tag)), tag, struct.pack("<Q", len(payload)), payload))
    if version == 1:  # the first format's checksum
        return body + struct.pack("<I", zlib.crc32(body))
    return body + struct.pack("<Q", xxhash.xxh3_64_intdigest(body))


def test_the_scan_drops_junk_and_leftovers(tmp_path: Path) -> None:
    with DiskStore(tmp_path, 1 << 20) as store:
        good = put(store, 1, b"g" * 64)
    folder = path_of(tmp_path, good).parent
    junk = {
        "random": lambda key: os.urandom(300),
        "empty": lambda key: b"",
        "magic only": lambda key: MAGIC,
        "the next version": lambda key: raw_file(key, b"payload", version=VERSION + 1),
        "version 1, its CRC-32 right": lambda key: raw_file(key, b"payload", version=1),
        "tag not utf-8": lambda key: raw_file(key, b"payload", tag=b"\xff\xfe"),
        "one byte more": lambda key: raw_file(key, b"payload") + b"\0",
    }
    ok = page(99)[0]
    path_of(tmp_path, ok).parent.mkdir(parents=True, exist_ok=True)
    path_of(tmp_path, ok).write_bytes(raw_file(ok, b"payload"))  # the control: by hand, but right
    for i, make in enumerate(junk.values()):
        key = page(100 + i)[0]
        path_of(tmp_path, key).parent.mkdir(parents=True, exist_ok=True)
        path_of(tmp_path, key).write_bytes(make(key))
    (folder / (good.hex() + TMP_SUFFIX)).write_bytes(b"half a write")  # a write killed midway
    (folder / "notes.txt").write_text("not ours")
    with DiskStore(tmp_path, 1 << 20) as store:
        assert store.stats().refused == len(junk) and {e.key for e in store.entries()} == {good, ok}
        assert set(files_on_disk(tmp_path)) == {good.hex() + SUFFIX, ok.hex() + SUFFIX, "notes.txt"}  # not ours: left
        assert store.get(good) == b"g" * 64 and store.get(ok) == b"payload"


def test_a_forged_cycle_of_parents_can_still_be_evicted(tmp_path: Path) -> None:
    """No SHA-256 chain makes a cycle, but files are not trusted: a cycle has no leaf, yet the budget holds."""
    a, b = page(1)[0], page(2)[0]
    for key, parent in ((a, b), (b, a)):
        path_of(tmp_path, key).parent.mkdir(parents=True, exist_ok=True)
        path_of(tmp_path, key).write_bytes(raw_file(key, b"x" * 100, parent=parent))
    size = path_of(tmp_path, a).stat().st_size
    with DiskStore(tmp_path, size) as store:
        assert len(store) == 1 and store.stats().bytes == size and len(store.entries()) == 1
        put(store, 3, b"y" * 10)
        store.flush(5)
        assert [e.key for e in store.entries()] == [page(3)[0]]
        assert_index_is_the_files(store)


def test_pages_are_announced_at_start_parents_first_even_with_a_forged_cycle(tmp_path: Path) -> None:
    """`announce_start` clears each model served or on disk, then announces each page once, after its
    parent; a forged cycle (each file the other's parent) ends it too (the walk up parents it
    replaced never did)."""
    a, b = page(1)[0], page(2)[0]
    for key, parent in ((a, b), (b, a)):
        path_of(tmp_path, key).parent.mkdir(parents=True, exist_ok=True)
        path_of(tmp_path, key).write_bytes(raw_file(key, b"x" * 100, parent=parent))
    with DiskStore(tmp_path, 1 << 20) as store:
        chain = [SEED]
        for i in range(3, 6):
            chain.append(put(store, i, b"y", parent=chain[-1]))
        store.flush(5)
    announced: list[bytes] = []
    cleared: list[str] = []
    with DiskStore(tmp_path, 1 << 20, on_stored=lambda e: announced.append(e.key)) as store:
        done = threading.Event()
        publisher = types.SimpleNamespace(cleared=cleared.append)
        threading.Thread(target=lambda: (announce_start(publisher, store, ["served"]), done.set()), daemon=True).start()
        assert done.wait(10)
        assert cleared == ["model-a", "served"]
        assert sorted(announced) == sorted([a, b] + chain[1:])
        assert [k for k in announced if k in chain] == chain[1:]


def test_the_default_budget_counts_the_tiers_own_files_as_free(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A quarter of the free space, where the pages already on disk count as free: a restart of a
    full tier gets the budget it had (a mutation counting free space alone shrinks it each restart
    and evicts at start)."""
    disk = 400 * PAGE_FILE  # a file system that holds the store alone

    def usage(_path: object) -> shutil._ntuple_diskusage:
        used = sum(files_on_disk(tmp_path).values()) if (tmp_path / "pages").exists() else 0
        return shutil._ntuple_diskusage(disk, used, disk - used)

    monkeypatch.setattr(persistence.shutil, "disk_usage", usage)
    settings = ServerSettings(prefix_disk_dir=tmp_path)
    with DiskStore(tmp_path, persistence.disk_budget(settings)) as store:
        assert store.budget_bytes == disk // 4
        for i in range(100):
            put(store, i, b"." * 1000)
        store.flush(10)
        held = store.stats().bytes
        assert held > disk // 4 - PAGE_FILE
    with DiskStore(tmp_path, persistence.disk_budget(settings)) as store:
        assert store.budget_bytes == disk // 4 and store.stats().bytes == held and store.stats().evictions == 0


def test_header_codec_round_trip() -> None:
    entry = DiskEntry(page(1)[0], SEED, SEED, tuple(range(-3, 2000)), "héllo", 12345)
    header = encode_header(entry)
    assert decode_header(header + b"payload") == (entry, len(header))


def test_a_long_header_is_read_at_scan_and_get(tmp_path: Path) -> None:
    tokens = list(range(3000))  # a 12 KB header: past the first read
    key = key_of(SEED, tokens)
    with DiskStore(tmp_path, 1 << 20) as store:
        assert store.put(key, SEED, SEED, tokens, lambda: b"rows")
    with DiskStore(tmp_path, 1 << 20) as store:
        assert store.entry(key).tokens == tuple(tokens) and store.get(key) == b"rows"  # type: ignore[union-attr]


# -- the budget and eviction ----------------------------------------------------------------------------


def test_budget_holds_on_disk_over_many_random_puts(tmp_path: Path) -> None:
    rec = Recorder()
    budget = 200_000
    rng = random.Random(7)
    over: list[int] = []

    def on_stored(entry: DiskEntry) -> None:  # the writer is between files: what is on disk is all indexed
        rec.on_stored(entry)
        total = sum(files_on_disk(tmp_path).values())
        if total > budget:
            over.append(total)

    store = DiskStore(tmp_path, budget, on_stored=on_stored, on_removed=rec.on_removed)
    keys: list[bytes] = []
    for i in range(400):
        size = rng.choice([10, 1000, 9000, 30000, 60000])
        parent = rng.choice(keys) if keys and rng.random() < 0.5 else SEED  # chains and single pages
        keys.append(put(store, i, bytes([i % 256]) * size, parent=parent))
        if rng.random() < 0.1:
            store.get(rng.choice(keys))
        if rng.random() < 0.05:
            store.discard(rng.choice(keys))
        if rng.random() < 0.2:
            store.flush(10)
            assert sum(files_on_disk(tmp_path).values()) <= budget
    key, parent, tokens = page(999)
    assert store.put(key, parent, SEED, tokens, lambda: b"x" * budget)  # larger than the whole budget with its header
    assert store.flush(30)
    stats = store.stats()
    assert not over and stats.too_big == 1 and not store.contains(key)
    assert 0 < stats.bytes <= budget and stats.evictions > 100
    assert_index_is_the_files(store)
    rec.check(store)
    assert len(rec.stored) == stats.writes and len(rec.removed) == len(rec.stored) - stats.pages
    store.close()
    with DiskStore(tmp_path, budget // 2) as smaller:  # the budget shrank across a restart
        assert smaller.stats().bytes <= budget // 2 and smaller.stats().evictions > 0
        assert_index_is_the_files(smaller)


def test_evicts_cold_before_hot_then_least_recently_used(tmp_path: Path) -> None:
    rec = Recorder()
    payload = b"." * 1000
    with rec.open(tmp_path, 4 * PAGE_FILE) as store:
        a, b, c, d = (put(store, i, payload) for i in range(1, 5))
        store.flush(5)
        assert store.get(c) and store.get(a)  # hot now, a the latest used
        e = put(store, 5, payload)
        store.flush(5)
        assert [x.key for x in rec.removed] == [b]  # the older of the two cold pages left of the first four
        f = put(store, 6, payload)
        store.flush(5)
        assert [x.key for x in rec.removed] == [b, d]
        g = put(store, 7, payload)
        store.flush(5)
        assert [x.key for x in rec.removed] == [b, d, e]  # cold e, although newer than the hot ones
        assert store.get(f)  # f turns hot: g is the only cold page
        h = put(store, 8, payload)
        store.flush(5)
        assert [x.key for x in rec.removed] == [b, d, e, g] and store.get(h)  # every page hot now
        i = put(store, 9, payload)
        store.flush(5)
        assert [x.key for x in rec.removed] == [b, d, e, g, c]  # then the least recently used: c, not a
        assert {x.key for x in store.entries()} == {a, f, h, i} and store.stats().evictions == 5
        rec.check(store)


def test_chains_shrink_from_their_tail(tmp_path: Path) -> None:
    rec = Recorder()
    payload = b"." * 1000
    with rec.open(tmp_path, 4 * PAGE_FILE) as store:
        chain = [SEED]
        for i in range(4):
            chain.append(put(store, i, payload, parent=chain[-1]))
        store.flush(5)
        for key in chain[1:]:  # a prompt attaches its chain root first: the root is the least recent
            assert store.get(key)
        other = put(store, 10, payload)
        store.flush(5)
        assert [x.key for x in rec.removed] == [chain[4]]  # the only leaf, though the root is older
        assert store.get(other)
        put(store, 11, payload)
        store.flush(5)
        assert [x.key for x in rec.removed] == [chain[4], chain[3]]  # the tail goes, the root stays
        rec.check(store)


def test_a_page_written_never_evicts_its_own_parent(tmp_path: Path) -> None:
    """A conversation's next turn extends a chain whose tail is the oldest leaf on a full disk (its
    turns were attached from host memory, which leaves their files' recency alone): writing the new
    page must evict another chain's tail, not its parent, which a restart needs to reach it. A
    mutation that keeps only the page itself evicts the parent of each new page in turn."""
    rec = Recorder()
    payload = b"." * 1000
    with rec.open(tmp_path, 6 * PAGE_FILE) as store:
        turn = [SEED]
        for i in range(3):  # the conversation's first turn: the oldest pages
            turn.append(put(store, i, payload, parent=turn[-1]))
        store.flush(5)
        other = [SEED]
        for i in range(10, 13):  # newer traffic fills the disk
            other.append(put(store, i, payload, parent=other[-1]))
        store.flush(5)
        for i in range(20, 22):  # the next turn, after the first
            turn.append(put(store, i, payload, parent=turn[-1]))
            store.flush(5)
        assert all(store.contains(key) for key in turn[1:])  # a whole run from the root
        assert [x.key for x in rec.removed] == [other[3], other[2]]
        assert_index_is_the_files(store)
        rec.check(store)


def test_a_removal_is_never_announced_before_the_write_it_removes(tmp_path: Path) -> None:
    """The writer announces a page it indexed; a reader that refuses that file at once (or a `discard`)
    announces its removal. However the threads interleave, the removal comes second: an event
    consumer last told `stored` believes a page on disk that is not there."""
    events: list[str] = []
    in_callback = threading.Event()

    def slow_stored(entry: DiskEntry) -> None:
        in_callback.set()
        time.sleep(0.3)  # the writer preempted between indexing the page and announcing it
        events.append("stored")

    with DiskStore(tmp_path, 1 << 20, on_stored=slow_stored, on_removed=lambda e: events.append("removed")) as store:
        key = put(store, 1, b"x" * 100)
        assert in_callback.wait(10)
        store.discard(key)
        store.flush(5)
        assert events == ["stored", "removed"] and not store.contains(key)


def test_lru_order_survives_a_restart_through_mtimes(tmp_path: Path) -> None:
    with DiskStore(tmp_path, 1 << 20) as store:
        keys = [put(store, i, b"." * 1000) for i in range(4)]
    now = time.time()
    for age, key in zip((10, 40, 30, 20), keys):  # keys[1] the least recently used, then keys[2]
        os.utime(path_of(tmp_path, key), (now - age, now - age))
    size = path_of(tmp_path, keys[0]).stat().st_size
    rec = Recorder()
    with rec.open(tmp_path, 2 * size) as store:  # the budget shrank: two go at start, announcing nothing
        assert {e.key for e in store.entries()} == {keys[0], keys[3]} and rec.removed == []
        assert store.get(keys[0]) and os.path.getmtime(path_of(tmp_path, keys[0])) > now - 5  # a hit sets the mtime


def block_writer(store: DiskStore) -> tuple[bytes, threading.Event]:
    """Page 0 queued with a payload that waits for the returned event: once this returns, the writer
    is inside it and the queue is empty again. Its key, and the event."""
    release = threading.Event()
    started = threading.Event()

    def blocked() -> bytes:
        started.set()
        assert release.wait(30)
        return b"first"

    k0, parent, tokens = page(0)
    assert store.put(k0, parent, SEED, tokens, blocked, nbytes=5)
    assert started.wait(10)
    return k0, release


def test_full_queue_drops_writes(tmp_path: Path) -> None:
    with DiskStore(tmp_path, 1 << 20, queue_bytes=10_000) as store:
        k0, release = block_writer(store)
        accepted, t0 = [], time.perf_counter()
        for i in range(1, 20):
            k, parent, tokens = page(i)
            if store.put(k, parent, SEED, tokens, lambda i=i: bytes([i]) * 3000, nbytes=3000):
                accepted.append(k)
        assert time.perf_counter() - t0 < 1  # never waited on the writer
        stats = store.stats()
        assert len(accepted) == 3 and stats.dropped_writes == 16 and stats.queued == 4
        assert stats.queued_bytes == sum(3000 + store_header(4) for _ in accepted)
        assert not store.flush(0.1)
        release.set()
        assert store.flush(10)
        assert store.get(k0) == b"first" and all(store.get(k) for k in accepted) and len(store) == 4
        assert store.stats().queued_bytes == 0


def test_held_writes_count_against_the_queue_only_once_let_go(tmp_path: Path) -> None:
    """A `held` write's payload is memory its caller keeps (a page in host memory): it is queued
    whatever the queue holds (a mutation that counts it drops 16 of these 19), and counts once the
    caller lets it go (`release`): charged while the queue has room, else dropped, its payload let
    go and never written."""
    calls: list[int] = []

    def payload(i: int) -> bytes:
        calls.append(i)
        return bytes([i]) * 3000

    with DiskStore(tmp_path, 1 << 20, queue_bytes=10_000) as store:
        _, release = block_writer(store)
        keys = []
        for i in range(1, 20):
            k, parent, tokens = page(i)
            assert store.put(k, parent, SEED, tokens, lambda i=i: payload(i), nbytes=3000, held=True)
            keys.append(k)
        assert store.stats().queued == 20 and store.stats().queued_bytes == 0  # and the one being written
        for k in keys[:4]:
            store.release(k)  # the first three fit the queue's 10,000 bytes; the fourth is dropped
        stats = store.stats()
        assert stats.queued_bytes == 3 * (3000 + store_header(4)) and stats.dropped_writes == 1
        assert stats.queued == 19
        store.release(keys[0])  # released already: nothing changes
        assert store.stats().queued_bytes == stats.queued_bytes
        release.set()
        assert store.flush(10)
        assert len(store) == 19 and keys[3] not in store and 4 not in calls
        assert all(store.get(k) == bytes([i + 1]) * 3000 for i, k in enumerate(keys) if i != 3)
        assert store.stats().queued_bytes == 0
        k, parent, tokens = page(4)
        assert store.put(k, parent, SEED, tokens, lambda: b"again", held=True)  # dropped: it may come again
        assert store.flush(10) and store.get(k) == b"again"


def test_a_replaced_waiting_write_counts_its_new_size(tmp_path: Path) -> None:
    """A waiting write replaced by a larger one (a page that gained rows) counts the larger size, both
    when it is released and when it is queued as it is; a mutation keeping the first estimate lets
    the queue pass `queue_bytes`."""
    with DiskStore(tmp_path, 1 << 20, queue_bytes=10_000) as store:
        _, release = block_writer(store)
        k, parent, tokens = page(1)
        assert store.put(k, parent, SEED, tokens, lambda: b"a", nbytes=100, held=True)
        assert store.put(k, parent, SEED, tokens, lambda: b"b" * 9000, nbytes=9000, held=True, replace=True)
        store.release(k)
        assert store.stats().queued_bytes == 9000 + store_header(4)
        k2, parent2, tokens2 = page(2)
        assert store.put(k2, parent2, SEED, tokens2, lambda: b"c", nbytes=100)
        assert not store.put(k2, parent2, SEED, tokens2, lambda: b"d" * 5000, nbytes=5000, replace=True)
        stats = store.stats()
        assert stats.queued_bytes == 9100 + 2 * store_header(4) <= store.queue_bytes and stats.dropped_writes == 1
        release.set()
        assert store.flush(10)
        assert store.get(k) == b"b" * 9000 and store.get(k2) == b"c"  # the refused replacement kept the older rows
        assert store.stats().queued_bytes == 0


def store_header(n_tokens: int) -> int:
    return header_size(n_tokens, 0) + 8  # a page without a tag: its header and checksum (u64)


def test_a_queued_page_is_written_once_and_replace_takes_the_latest(tmp_path: Path) -> None:
    release = threading.Event()
    with DiskStore(tmp_path, 1 << 20) as store:
        k0, parent, tokens = page(0)
        store.put(k0, parent, SEED, tokens, lambda: release.wait(30) and b"0")
        k, parent, tokens = page(1)
        assert store.put(k, parent, SEED, tokens, lambda: b"old")
        assert not store.put(k, parent, SEED, tokens, lambda: b"dup")
        assert store.put(k, parent, SEED, tokens, lambda: b"new", replace=True)
        release.set()
        store.flush(10)
        assert store.get(k) == b"new" and store.stats().writes == 2


def test_close_gives_up_on_a_stuck_writer_but_keeps_the_folder_locked(tmp_path: Path) -> None:
    release = threading.Event()
    store = DiskStore(tmp_path, 1 << 20)
    k0, parent, tokens = page(0)
    store.put(k0, parent, SEED, tokens, lambda: release.wait(30) and b"stuck")
    later = put(store, 1, b"later")
    t0 = time.perf_counter()
    store.close(timeout=0.2)
    assert time.perf_counter() - t0 < 5
    with pytest.raises(DiskLocked):  # the writer is still inside a write: no one else may open the folder
        DiskStore(tmp_path, 1 << 20)
    release.set()
    store._writer.join(10)
    with DiskStore(tmp_path, 1 << 20) as again:  # released by the writer; the queued write was abandoned
        assert again.contains(k0) and not again.contains(later)


def test_close_finishes_queued_writes(tmp_path: Path) -> None:
    store = DiskStore(tmp_path, 1 << 20)
    keys = [put(store, i, bytes(1000)) for i in range(50)]
    store.close()
    with DiskStore(tmp_path, 1 << 20) as again:
        assert {e.key for e in again.entries()} == set(keys)


def test_reads_race_writes_evictions_and_replacements(tmp_path: Path) -> None:
    """A reader on its own thread, as the engine, while the writer evicts and replaces: every payload it
    gets is one that was put under that key, and no race passes for a corrupt file."""
    keys = [page(i)[0] for i in range(40)]
    stop = threading.Event()
    got: list[int] = []
    wrong: list[bytes] = []

    def reader() -> None:
        rng = random.Random(1)
        while not stop.is_set():
            key = rng.choice(keys)
            data = store.get(key)
            if data is not None:
                got.append(1)
                if data[:32] != key:
                    wrong.append(key)

    with DiskStore(tmp_path, 20 * 20_000) as store:  # room for about half the pages
        thread = threading.Thread(target=reader)
        thread.start()
        rng = random.Random(2)
        for round_ in range(300):
            i = rng.randrange(len(keys))
            key, parent, tokens = page(i)
            body = key + bytes([round_ % 256]) * rng.choice([1000, 10_000, 19_000])
            store.put(key, parent, SEED, tokens, lambda body=body: body, replace=rng.random() < 0.5)
            if round_ % 50 == 49:
                store.flush(10)
        store.flush(10)
        stop.set()
        thread.join(10)
        stats = store.stats()
        assert not wrong and got and stats.refused == 0 and stats.evictions > 0 and stats.bytes <= 20 * 20_000
        assert_index_is_the_files(store)


# -- kill -9 in the middle of writes -------------------------------------------------------------------------


WRITE_FOREVER = """
import hashlib, os, random, stat, sys, time
from pathlib import Path
from kvserve.cache.disk_store import DiskStore
store = DiskStore(Path(sys.argv[1]), int(sys.argv[2]), queue_bytes=1 << 30)
seed = hashlib.sha256(b"namespace").digest()
rng = random.Random(int(sys.argv[3]))
stall_at = int(sys.argv[4])
real_fsync = os.fsync

def stalling_fsync(fd):
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        return real_fsync(fd)  # a folder's
    print("STALL", flush=True)  # the writer holds a complete temporary file it has not renamed yet
    time.sleep(60)

parent = seed
for i in range(1_000_000):
    if i == stall_at:
        os.fsync = stalling_fsync
    key = hashlib.sha256(parent + i.to_bytes(8, "little") + sys.argv[3].encode()).digest()
    size = rng.choice([1, 4096, 100_000, 700_000])
    store.put(key, parent, seed, [i], lambda size=size, i=i: [bytes([i % 256]) * size, os.urandom(64)])
    parent = key if rng.random() < 0.7 else seed
    if i % 8 == 7:
        store.flush()
        print(store.stats().writes, flush=True)
"""


def test_kill_9_mid_write_leaves_only_complete_files(tmp_path: Path) -> None:
    """Kills at random moments (about a third land inside a write), then one certainly inside a write."""
    budget = 8 << 20  # small: evictions run too
    rng = random.Random(3)
    for round_ in range(4):
        stall = round_ == 3
        child = python(WRITE_FOREVER, str(tmp_path), str(budget), str(round_), "20" if stall else "-1")
        try:
            assert child.stdout is not None
            if stall:
                while (line := child.stdout.readline().strip()) != "STALL":
                    assert line, "the writer died"
            else:
                for _ in range(rng.randint(2, 6)):  # some batches written, then a kill at a random moment
                    assert child.stdout.readline(), "the writer died"
                time.sleep(rng.random() * 0.05)
        finally:
            child.send_signal(signal.SIGKILL)
            child.wait(30)
        if stall:
            assert [name for name in files_on_disk(tmp_path) if name.endswith(TMP_SUFFIX)]
        rec = Recorder()
        with rec.open(tmp_path, budget) as store:
            assert store.stats().refused == 0  # a kill never leaves a partial file under a final name
            entries = store.entries()
            assert entries and all(store.get(e.key) is not None for e in entries)
            assert store.stats().refused == 0 and store.stats().bytes <= budget
            assert_index_is_the_files(store)  # no temporary file left either

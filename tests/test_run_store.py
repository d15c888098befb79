"""The run store alone (no llama.cpp): runs written behind, found again after a restart, checked by
trailer and checksum, kept within their budget, superseded by longer runs of the same chain, and a
writer that never holds up `put`."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

from kvserve.cache import run_store
from kvserve.cache.run_store import KEY_BYTES, QUEUE, SUFFIX, TMP_SUFFIX, TRAILER_BYTES, RunStore


SIZE = 1000 + KEY_BYTES + TRAILER_BYTES  # a one-page run of the bodies below
LAYOUT = b"L" * 32


def key(i: int) -> bytes:
    return bytes([i]) * 32


def body(size: int, fill: int = 7) -> list[bytes]:
    return [bytes([fill]) * (size // 2), bytes([fill + 1]) * (size - size // 2)]


def file_of(store: RunStore, k: bytes) -> Path:
    return store.directory / (k.hex() + SUFFIX)


def written(store: RunStore, keys: list[bytes], size: int = 1000, fill: int = 7, layout: bytes = LAYOUT) -> None:
    store.put(keys, layout, size, lambda: body(size, fill))
    assert store.flush(10)


def test_a_run_is_written_found_opened_and_verified(tmp_path: Path) -> None:
    store = RunStore(tmp_path, 1 << 20)
    try:
        written(store, [key(1), key(2), key(3)])
        # every page it holds finds it; a page of no run finds nothing
        assert [store.find(key(i), LAYOUT) for i in (1, 2, 3, 4)] == [(key(3), 3)] * 3 + [None]
        assert file_of(store, key(3)).stat().st_size == SIZE + 2 * KEY_BYTES
        with store.open(key(3)) as opened:
            assert opened.verify()
            assert Path(opened.path).read_bytes()[:1000] == b"".join(body(1000))
        assert store.open(key(2)) is None  # a page of it, not its name
        assert store.stats().hits == 0  # opened is not restored
        store.restored(key(3))
        stats = store.stats()
        assert (stats.runs, stats.bytes, stats.writes, stats.hits) == (1, SIZE + 2 * KEY_BYTES, 1, 1)
    finally:
        store.close()


def test_a_restart_finds_the_runs_and_drops_what_is_not_one(tmp_path: Path) -> None:
    store = RunStore(tmp_path, 1 << 20)
    written(store, [key(1)])
    written(store, [key(2), key(4)])
    store.close()
    (tmp_path / (key(9).hex() + TMP_SUFFIX)).write_bytes(b"half a run")
    misnamed = tmp_path / (key(5).hex() + SUFFIX)
    misnamed.write_bytes(file_of(store, key(1)).read_bytes())  # a run under another's name
    cut = file_of(store, key(4))
    cut.write_bytes(cut.read_bytes()[:-3])
    (tmp_path / "notes.txt").write_text("not ours")
    again = RunStore(tmp_path, 1 << 20)
    try:
        assert again.find(key(1), LAYOUT) == (key(1), 1) and again.find(key(4), LAYOUT) is None and again.find(key(5), LAYOUT) is None
        assert again.stats().refused == 2
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted([key(1).hex() + SUFFIX, "notes.txt"])
    finally:
        again.close()


def test_a_flipped_byte_fails_the_checksum_and_refuse_removes_the_file(tmp_path: Path) -> None:
    store = RunStore(tmp_path, 1 << 20)
    try:
        written(store, [key(1), key(2)])
        path = file_of(store, key(2))
        data = bytearray(path.read_bytes())
        data[10] ^= 0x01
        path.write_bytes(bytes(data))
        with store.open(key(2)) as opened:
            assert not opened.verify()
        store.refuse(key(2), "checksum mismatch")
        assert not path.exists() and store.find(key(1), LAYOUT) is None and store.stats().refused == 1
    finally:
        store.close()


def test_a_trailer_naming_another_run_is_refused_at_open(tmp_path: Path) -> None:
    store = RunStore(tmp_path, 1 << 20)
    try:
        written(store, [key(1)])
        written(store, [key(2)], fill=9)
        file_of(store, key(2)).write_bytes(file_of(store, key(1)).read_bytes())  # swapped in while serving
        assert store.open(key(2)) is None
        assert store.stats().refused == 1 and not file_of(store, key(2)).exists()
    finally:
        store.close()


def test_the_open_file_is_what_verify_reads_even_once_replaced(tmp_path: Path) -> None:
    store = RunStore(tmp_path, 1 << 20)
    try:
        written(store, [key(1)])
        with store.open(key(1)) as opened:
            os.replace(_forged(tmp_path, store), file_of(store, key(1)))
            assert opened.verify()  # the inode opened, not the name
    finally:
        store.close()


def _forged(tmp_path: Path, store: RunStore) -> Path:
    other = tmp_path / "forged"
    data = bytearray(file_of(store, key(1)).read_bytes())
    data[0] ^= 0xFF
    other.write_bytes(bytes(data))
    return other


def test_the_budget_evicts_the_least_recently_used_and_skips_a_run_too_large(tmp_path: Path) -> None:
    size = SIZE
    store = RunStore(tmp_path, 3 * size)
    try:
        for i in (1, 2, 3):
            written(store, [key(i)])
        store.restored(key(1))  # used: now the most recent
        written(store, [key(4)])
        assert [store.find(key(i), LAYOUT) for i in (1, 2, 3, 4)] == [(key(1), 1), None, (key(3), 1), (key(4), 1)]
        assert store.stats().bytes == 3 * size and store.stats().evictions == 1
        written(store, [key(5)], size=4 * size)
        assert store.find(key(5), LAYOUT) is None and store.stats().bytes <= store.budget_bytes
        assert sum(p.stat().st_size for p in tmp_path.iterdir()) <= store.budget_bytes
    finally:
        store.close()


def test_warm_reads_ahead_the_newest_runs_that_fit_its_budget(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    read: list[list[bytes]] = []
    monkeypatch.setattr(RunStore, "_read_ahead", lambda self, keys, stage=None: read.append(keys))
    store = RunStore(tmp_path, 1 << 20)
    try:
        written(store, [key(1)])
        written(store, [key(2)], size=3000)
        written(store, [key(3)])
        store.restored(key(1))  # newest first: 1, 3, then 2 (too large for what is left), none after
        store.warm(3 * SIZE).join(10)
        assert read == [[key(1), key(3)]]
        store.warm(0).join(10)
        assert read[-1] == []
    finally:
        store.close()


def test_read_ahead_passes_over_a_run_removed_meanwhile(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    read, failed = [], []
    real = run_store._read_through
    monkeypatch.setattr(run_store, "_read_through",
                        lambda fd, n, each: (read.append((os.readlink(f"/proc/self/fd/{fd}"), n)), real(fd, n, each))[1])
    monkeypatch.setattr(threading, "excepthook", failed.append)
    store = RunStore(tmp_path, 1 << 20)
    try:
        written(store, [key(2)])
        written(store, [key(1)])
        file_of(store, key(1)).unlink()  # the newest, read first
        warming = store.warm(1 << 20)
        warming.join(10)
        assert not warming.is_alive() and not failed
        assert read == [(str(file_of(store, key(2))), SIZE - 8)]  # the other one, whole but its checksum
    finally:
        store.close()


def settled(store: RunStore, keys: list[bytes]) -> None:
    """Runs written, then left unchanged longer than a change time could hide a write."""
    for k in keys:
        written(store, [k])
    time.sleep(run_store.SETTLED_NS / 1e9 + 0.02)


def reads(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The bytes each `_read_through` reads, from now on."""
    read: list[int] = []
    real = run_store._read_through
    monkeypatch.setattr(run_store, "_read_through", lambda fd, n, each: (read.append(n), real(fd, n, each))[1])
    return read


def test_a_run_read_ahead_and_found_right_is_not_read_again_to_be_verified(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = RunStore(tmp_path, 1 << 20)
    try:
        settled(store, [key(1)])
        store.warm(1 << 20).join(10)
        read = reads(monkeypatch)
        with store.open(key(1)) as opened:
            assert opened.read_right and opened.verify()
        assert read == []
    finally:
        store.close()


def test_a_run_changed_after_its_read_ahead_is_verified_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = RunStore(tmp_path, 1 << 20)
    try:
        settled(store, [key(1), key(2)])
        store.warm(1 << 20).join(10)
        with open(file_of(store, key(1)), "r+b") as f:  # a flipped byte, in place
            f.seek(10)
            f.write(bytes([f.read(1)[0] ^ 1]))
        replaced = tmp_path / "other"  # another file under the name, the same bytes
        replaced.write_bytes(file_of(store, key(2)).read_bytes())
        os.replace(replaced, file_of(store, key(2)))
        read = reads(monkeypatch)
        with store.open(key(1)) as opened:
            assert not opened.read_right and not opened.verify()
        with store.open(key(2)) as opened:
            assert not opened.read_right and opened.verify()
        assert read == [SIZE - 8, SIZE - 8]
    finally:
        store.close()


def test_a_run_read_ahead_just_after_it_changed_is_verified_when_used(tmp_path: Path) -> None:
    """A write in the same tick as the file's last change would keep its change time: too recent a
    file is not taken as read."""
    store = RunStore(tmp_path, 1 << 20)
    try:
        written(store, [key(1)])
        store.warm(1 << 20).join(10)
        with store.open(key(1)) as opened:
            assert not opened.read_right and opened.verify()
    finally:
        store.close()


def test_a_restart_with_a_smaller_budget_evicts_down_to_it(tmp_path: Path) -> None:
    store = RunStore(tmp_path, 1 << 20)
    for i in (1, 2, 3):
        written(store, [key(i)])
    store.close()
    again = RunStore(tmp_path, 2 * SIZE)
    try:
        assert again.stats().runs == 2 and again.find(key(1), LAYOUT) is None
    finally:
        again.close()


def test_a_longer_run_of_the_same_chain_supersedes_the_shorter(tmp_path: Path) -> None:
    store = RunStore(tmp_path, 1 << 20)
    try:
        written(store, [key(1), key(2)])
        written(store, [key(7)])
        written(store, [key(1), key(2), key(3)])
        assert store.find(key(2), LAYOUT) == (key(3), 3) and store.find(key(7), LAYOUT) == (key(7), 1)
        assert not file_of(store, key(2)).exists() and store.stats().runs == 2
    finally:
        store.close()


def test_put_never_waits_for_the_writer_and_the_queue_is_bounded(tmp_path: Path) -> None:
    store = RunStore(tmp_path, 1 << 20)
    started, gate = threading.Event(), threading.Event()
    try:
        store.put([key(1)], LAYOUT, 100, lambda: (started.set(), gate.wait(10), body(100))[2])
        assert started.wait(10)  # the writer is busy with that one
        for i in range(2, 3 + QUEUE + 2):
            store.put([key(i)], LAYOUT, 100, lambda: body(100))
        assert store.stats().dropped_writes == 3
        gate.set()
        assert store.flush(10)
        assert store.stats().runs == 1 + QUEUE
    finally:
        gate.set()
        store.close()


def test_a_body_that_raises_writes_nothing_and_the_writer_goes_on(tmp_path: Path) -> None:
    store = RunStore(tmp_path, 1 << 20)
    try:
        store.put([key(1)], LAYOUT, 100, lambda: 1 / 0)
        store.put([key(3)], LAYOUT, 101, lambda: body(100))  # a body shorter than announced
        written(store, [key(2)])
        assert store.find(key(1), LAYOUT) is None and store.find(key(3), LAYOUT) is None and store.find(key(2), LAYOUT) == (key(2), 1)
        assert not any(p.name.endswith(TMP_SUFFIX) for p in tmp_path.iterdir())
    finally:
        store.close()


@pytest.mark.parametrize("size", [0, TRAILER_BYTES - 1])
def test_a_file_shorter_than_a_trailer_is_refused(tmp_path: Path, size: int) -> None:
    (tmp_path / (key(1).hex() + SUFFIX)).write_bytes(b"x" * size)
    store = RunStore(tmp_path, 1 << 20)
    try:
        assert store.find(key(1), LAYOUT) is None and store.stats().refused == 1
    finally:
        store.close()


def test_find_returns_only_runs_of_the_layout_asked_for(tmp_path: Path) -> None:
    """Another context's run (another stream count, V the other way) is left alone, not refused."""
    store = RunStore(tmp_path, 1 << 20)
    try:
        written(store, [key(1), key(2)], layout=b"M" * 32)
        assert store.find(key(2), LAYOUT) is None and store.find(key(2), b"M" * 32) == (key(2), 2)
        store.close()
        store = RunStore(tmp_path, 1 << 20)
        assert store.find(key(1), b"M" * 32) == (key(2), 2) and store.stats().refused == 0
    finally:
        store.close()

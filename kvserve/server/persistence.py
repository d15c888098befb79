"""What outlives one model's engine: the server's disk tier of prefix-cache pages and its KV event
publisher, opened once at start and shared by every model it loads.

Invariants:
- one server per `--prefix-disk-dir`: a second one on the same folder refuses to start (the disk
  store's lock), saying which process holds it;
- a model's pages are written and announced under its served name; at start each model served, and
  each with pages on disk, is announced cleared, then every page on disk once, parents first, before
  any model serves;
- the disk budget is split: runs (run_store.py) take `1 / RUN_SHARE` of it, the pages the rest, so
  their files together never pass it;
- `close` finishes queued run writes and disk writes (bounded), then the publisher's queue, then
  releases them.
"""

from __future__ import annotations

import logging
import os
import shutil
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from kvserve.cache.page_events import ModelEvents, announce_start, disk_listeners
from kvserve.cache.tiers import Tiers
from kvserve.config import ServerSettings
from kvserve.llama.seq_state import mapped
from kvserve.server.namespace import adapters_of

_log = logging.getLogger("kvserve.persistence")
MIB = 1024 * 1024
RUN_SHARE = 4  # runs (whole long chains again, run_store.py) take at most a quarter of the disk budget
STAGE_SHARE = 4  # the newest run, staged in memory at start (run_store.py), is at most a quarter of the host budget


@dataclass
class Persistence:
    disk: "object | None" = None  # DiskStore
    publisher: "object | None" = None  # KvEventPublisher
    runs: "object | None" = None  # RunStore, beside the disk store
    _mapping: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(1, thread_name_prefix="kvserve-map"))

    @classmethod
    def open(cls, settings: ServerSettings, models: Iterable[str] = ()) -> "Persistence":
        """The disk tier and the publisher `settings` ask for; `models`: the names the server serves,
        each announced cleared before the disk's pages (`announce_start`)."""
        publisher = None
        if settings.kv_events:
            from kvserve.cache.kv_events import KvEventPublisher

            publisher = KvEventPublisher(settings.kv_events, settings.kv_events_replay, settings.kv_events_topic)
        try:
            disk, runs = _open_disk(settings, publisher)
        except BaseException:
            if publisher is not None:
                publisher.close()
            raise
        if publisher is not None:
            announce_start(publisher, disk, models)
        return cls(disk, publisher, runs)

    def tiers(self, model: str, page_rows: int) -> Tiers:
        """`model`'s tiers; where the disk holds its pages, a thread maps the buffer its first restore
        needs while it loads (a restarted 1.5B's first request waited up to 0.34 s for that mapping
        when it began once the model had loaded)."""
        events = ModelEvents(self.publisher, model, page_rows, adapters_of) if self.publisher is not None else None
        scratch = None
        if self.disk is not None and (nbytes := self.disk.run_bytes(model)):
            scratch = self._mapping.submit(mapped, nbytes)
        return Tiers(disk=self.disk, events=events, tag=model, scratch=scratch, lora_of=adapters_of, runs=self.runs)

    def flush(self, timeout: float) -> bool:
        """Wait up to `timeout` seconds for the disk tier's queued page writes; whether they are done.
        A stopping server calls it before its caches let their pages go: a page that leaves host
        memory with its write still queued counts against the queue's bound from then, and past it
        is lost (a 16k-token answer of a 1.5B, stopped right after, kept 3,056 of its tokens)."""
        return self.disk is None or self.disk.flush(timeout)

    def close(self) -> None:
        self._mapping.shutdown(wait=False, cancel_futures=True)
        if self.runs is not None:
            self.runs.close()
        if self.disk is not None:
            self.disk.close()
        if self.publisher is not None:
            self.publisher.close()


def disk_budget(settings: ServerSettings) -> int | Callable[[int], int]:
    """`--prefix-disk-mb`, or a quarter of the folder's free space at start, counting the pages the
    tier already holds there as free (its own files must not shrink the budget of each restart)."""
    if settings.prefix_disk_mb:
        return int(settings.prefix_disk_mb * MIB)
    folder = settings.prefix_disk_dir
    return lambda held: (shutil.disk_usage(folder).free + held) // 4


def _open_disk(settings: ServerSettings, publisher) -> "tuple[object | None, object | None]":
    """The disk store and its runs (RUN_SHARE of the budget), or neither."""
    if settings.prefix_disk_dir is None:
        return None, None
    from kvserve.cache.disk_store import DiskStore
    from kvserve.cache.run_store import RunStore

    settings.prefix_disk_dir.mkdir(parents=True, exist_ok=True)
    on_stored = on_removed = None
    if publisher is not None:
        on_stored, on_removed = disk_listeners(publisher)
    total, runs_dir, split = disk_budget(settings), settings.prefix_disk_dir / "runs", {}

    def pages_budget(held: int) -> int:  # the runs' files count as held: they are the tier's own
        whole = total(held + _file_bytes(runs_dir)) if callable(total) else total
        split["runs"] = whole // RUN_SHARE
        return whole - split["runs"]

    disk = DiskStore(settings.prefix_disk_dir, pages_budget, on_stored=on_stored, on_removed=on_removed)
    try:
        runs = RunStore(runs_dir, split["runs"])  # under the disk store's lock on the folder
    except BaseException:
        disk.close()
        raise
    # what the host tier may hold, read ahead while the model loads; the newest run staged in a quarter of it
    runs.warm(int(settings.prefix_state_mb * MIB), int(settings.prefix_state_mb * MIB) // STAGE_SHARE)
    stats, run_stats = disk.stats(), runs.stats()
    _log.info("disk tier: %s, %d pages (%.0f MiB) of %.0f MiB, %d runs (%.0f MiB) of %.0f MiB, %d files refused "
              "at start", settings.prefix_disk_dir, stats.pages, stats.bytes / MIB, stats.budget_bytes / MIB,
              run_stats.runs, run_stats.bytes / MIB, run_stats.budget_bytes / MIB, stats.refused + run_stats.refused)
    return disk, runs


def _file_bytes(folder: Path) -> int:
    try:
        return sum(entry.stat().st_size for entry in os.scandir(folder) if entry.is_file())
    except FileNotFoundError:
        return 0

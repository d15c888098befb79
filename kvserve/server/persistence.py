"""What outlives one model's engine: the server's disk tier of prefix-cache pages and its KV event
publisher, opened once at start and shared by every model it loads.

Invariants:
- one server per `--prefix-disk-dir`: a second one on the same folder refuses to start (the disk
  store's lock), saying which process holds it;
- a model's pages are written and announced under its served name; at start each model served, and
  each with pages on disk, is announced cleared, then every page on disk once, parents first, before
  any model serves;
- `close` finishes queued disk writes (bounded), then the publisher's queue, then releases both.
"""

from __future__ import annotations

import logging
import shutil
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterable
from dataclasses import dataclass, field

from kvserve.cache.page_events import ModelEvents, announce_start, disk_listeners
from kvserve.cache.tiers import Tiers
from kvserve.config import ServerSettings
from kvserve.llama.seq_state import mapped
from kvserve.server.namespace import adapters_of

_log = logging.getLogger("kvserve.persistence")
MIB = 1024 * 1024


@dataclass
class Persistence:
    disk: "object | None" = None  # DiskStore
    publisher: "object | None" = None  # KvEventPublisher
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
            disk = _open_disk(settings, publisher)
        except BaseException:
            if publisher is not None:
                publisher.close()
            raise
        if publisher is not None:
            announce_start(publisher, disk, models)
        return cls(disk, publisher)

    def tiers(self, model: str, page_rows: int) -> Tiers:
        """`model`'s tiers; where the disk holds its pages, a thread maps the buffer its first restore
        needs while it loads (a restarted 1.5B's first request waited up to 0.34 s for that mapping
        when it began once the model had loaded)."""
        events = ModelEvents(self.publisher, model, page_rows, adapters_of) if self.publisher is not None else None
        scratch = None
        if self.disk is not None and (nbytes := self.disk.run_bytes(model)):
            scratch = self._mapping.submit(mapped, nbytes)
        return Tiers(disk=self.disk, events=events, tag=model, scratch=scratch, lora_of=adapters_of)

    def close(self) -> None:
        self._mapping.shutdown(wait=False, cancel_futures=True)
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


def _open_disk(settings: ServerSettings, publisher) -> "object | None":
    if settings.prefix_disk_dir is None:
        return None
    from kvserve.cache.disk_store import DiskStore

    settings.prefix_disk_dir.mkdir(parents=True, exist_ok=True)
    on_stored = on_removed = None
    if publisher is not None:
        on_stored, on_removed = disk_listeners(publisher)
    disk = DiskStore(settings.prefix_disk_dir, disk_budget(settings), on_stored=on_stored, on_removed=on_removed)
    stats = disk.stats()
    _log.info("disk tier: %s, %d pages (%.0f MiB) of %.0f MiB, %d files refused at start",
              settings.prefix_disk_dir, stats.pages, stats.bytes / MIB, stats.budget_bytes / MIB, stats.refused)
    return disk

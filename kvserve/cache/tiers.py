"""Where a model's pages go beyond its host memory, and who hears of them: one disk store and one
event publisher per server, shared by its models (a page's key names its model, so one folder holds
them all), the name the model's files and events carry, and a buffer mapped while the model loads
for its first restore from disk, and the runs beside the pages (run_store.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from concurrent.futures import Future

    import numpy as np

    from kvserve.cache.disk_store import DiskStore
    from kvserve.cache.page_events import ModelEvents
    from kvserve.cache.run_store import RunStore


@dataclass(frozen=True)
class Tiers:
    disk: "DiskStore | None" = None
    events: "ModelEvents | None" = None
    tag: str = ""  # the model's name, written into each of its page files
    lora_of: Callable[[str], "str | None"] = lambda namespace: None  # a namespace's adapter set (its files' tags)
    scratch: "Future[np.ndarray] | None" = None  # `seq_state.mapped` for the longest run of its pages on disk
    runs: "RunStore | None" = None  # long chains of pages again, each in one file llama.cpp reads itself

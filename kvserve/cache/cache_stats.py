"""What a prefix cache reports for metrics and dashboards, whatever it keeps."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class CacheStats:
    """Counters since the cache was made, and what it holds now. A field
    a cache has no use for stays 0 (a page cache keeps no states)."""

    queried_tokens: int = 0  # prompt tokens looked up by `attach`
    hit_tokens: int = 0  # of those, attached from the cache
    evicted_pages: int = 0  # cells given back, in pages
    state_hits: int = 0  # prompts restored from a checkpoint
    state_evictions: int = 0  # checkpoints evicted
    held_pages: int = 0  # pages the cache keeps
    held_bytes: int = 0  # host memory its pages and states take
    locked_entries: int = 0  # pages or checkpoints a live session reads: 0 whenever no request is open
    state_bytes: int = 0  # recurrent states kept
    opening_checkpoints: int = 0
    conversation_checkpoints: int = 0
    namespaces: int = 0  # namespaces that hold cached rows (pages, checkpoints, an idle stream's)
    # prompt tokens of started requests, and of those not evaluated, by namespace kind ("shared",
    # "tenant", "tenant+salt", ...: never a namespace itself)
    kind_queried: dict[str, int] = field(default_factory=dict)
    kind_hits: dict[str, int] = field(default_factory=dict)

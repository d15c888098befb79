"""A read-only picture of the engine, published by the engine thread after each step so that other
threads (the metrics scrape) never read structures while the engine mutates them. /v1/cache, which
needs more, runs its reads on the engine thread instead."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvserve.cache.cache_stats import CacheStats


@dataclass(frozen=True)
class EngineSnapshot:
    running: int = 0
    waiting: int = 0
    kv_cells: int = 0
    kv_used: int = 0
    free_streams: int = 0
    live_sessions: int = 0  # streams running a sequence: 0 whenever no request is open
    inplace_reuses: int = 0  # sequences started in a stream that still held their prefix
    inplace_tokens: int = 0  # prompt tokens those kept in place instead of evaluating
    cache: CacheStats = field(default_factory=CacheStats)
    preemptions: int = 0
    live_samplers: int = 0  # native sampler chains not yet freed: 0 whenever no request is open
    # per drafter: (verified drafts, drafted tokens, accepted tokens)
    speculation: dict[str, tuple[int, int, int]] = field(default_factory=dict)

    @property
    def kv_usage(self) -> float:
        return self.kv_used / self.kv_cells if self.kv_cells else 0.0

"""The prefix cache of a server run without one: it keeps nothing, so every prompt is prefilled whole."""

from __future__ import annotations

from kvserve.cache.cache_stats import CacheStats
from kvserve.cache.chat_marks import MarkKind
from kvserve.cache.kv_pool import Session
from kvserve.cache.prefix_cache import InsertAt, PrefixCache
from kvserve.cache.prefix_key import PrefixKey


class NoCache(PrefixCache):
    keeps = "none"
    donates_prompt = False

    def match_len(self, key: PrefixKey) -> int:
        return 0

    def attach(self, session: Session, key: PrefixKey) -> list[int]:
        return []

    def gains_from_waiting(self, shared: int, cached: int) -> bool:
        return False  # a running prefill leaves nothing here

    def insert(self, session: Session, tokens: list[int], preview: str = "",
               kind: MarkKind = MarkKind.CONVERSATION, at: InsertAt = InsertAt.EVALUATED) -> None:
        return None

    def unlock(self, session: Session) -> None:
        pass

    def release(self) -> None:
        pass

    def rebind(self, ctx: object) -> bool:
        return True

    def stats(self) -> CacheStats:
        return CacheStats()

    def view(self, namespace: str) -> dict:
        return {"enabled": False, "held_pages": 0, "chains": []}

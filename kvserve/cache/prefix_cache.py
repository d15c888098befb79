"""The one interface the scheduler and the routes use for a prefix cache, whatever it keeps: whole
KV pages (`PageCache`), checkpoints of a recurrent state (`StateCache`) or nothing (`NoCache`).

Every lookup is by `PrefixKey`; what a session inserts belongs to its own namespace.

Invariants every cache keeps:
- a key matches only what was inserted under its namespace: rows never cross namespaces;
- what it keeps lives in host memory, never in a stream: attach copies it into the session's;
- `match_len` touches nothing (no hit count, no recency): it is what `attach` would attach now;
- what `attach` and `insert` used for a session stays locked (never evicted) until
  `unlock(session)`; the locks are the cache's own, keyed by session;
- `release` gives back everything it keeps.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from typing import ClassVar

from kvserve.cache.cache_stats import CacheStats
from kvserve.cache.chat_marks import MarkKind
from kvserve.cache.kv_pool import Session
from kvserve.cache.prefix_key import PrefixKey
from kvserve.llama.context import Context


class InsertAt(enum.Enum):
    """When a session inserts, which says what the insert may cost then."""

    EVALUATED = "evaluated"  # a prompt or a mark just evaluated: requests may wait on it, its first token does
    PREFILL = "prefill"  # a long prompt part way (`donates_prefill`), beside the minutes its prefill takes
    ENDING = "ending"  # the session's last insert, as it ends: work it can wait for is done here


class PrefixCache(ABC):
    keeps: ClassVar[str]  # "pages", "checkpoints" or "none": the `kind` /server_info reports
    # Insert a prompt as soon as it is evaluated, so requests waiting on the same prefix attach it.
    donates_prompt: ClassVar[bool]
    # Insert a prompt's whole pages while it is still evaluated, too (`KvManager.donate_prefill_progress`):
    # only where that costs a copy of the new rows and keeps something a restart can attach.
    donates_prefill: bool = False

    def caps(self) -> dict:
        """The limits it keeps to, as /server_info reports them."""
        return {}

    @abstractmethod
    def match_len(self, key: PrefixKey) -> int:
        """Leading tokens of `key` that `attach` would attach now. Touches nothing."""

    @abstractmethod
    def attach(self, session: Session, key: PrefixKey) -> list[int]:
        """Set the longest cached prefix of `key` into an empty session's stream, of its namespace,
        leaving at least one token to evaluate; returns the tokens it restored, which the caller
        (`KvManager.attach`) records as the session's."""

    @staticmethod
    def check_attachable(session: Session, key: PrefixKey) -> None:
        """`attach` takes an empty session of the key's namespace."""
        if session.tokens:
            raise ValueError("attach needs an empty session")
        if session.namespace != key.namespace:
            raise ValueError("a session attaches only rows of its own namespace")

    def checkpoint_at(self, session: Session, tokens: list[int], matched: int, mark: int) -> int:
        """Where to stop the prefill of `tokens` for `mark` so that `insert` can record it there,
        or 0 when a stop buys nothing (always, for a cache whose pages are already what it keeps)."""
        return 0

    @abstractmethod
    def gains_from_waiting(self, shared: int, cached: int) -> bool:
        """Whether a prompt that shares `shared` leading tokens with one being prefilled, and finds
        `cached` in the cache now, gains by waiting for that prefill to land here."""

    @abstractmethod
    def insert(self, session: Session, tokens: list[int], preview: str = "",
               kind: MarkKind = MarkKind.CONVERSATION, at: InsertAt = InsertAt.EVALUATED) -> object | None:
        """Keep what the session evaluated of `tokens` (a prefix of its history) under the session's
        namespace, locked while it lives; `kind` says who can reuse it; `at`: when the session inserts.
        Returns what was kept (a chain of pages, a checkpoint), or None when nothing new was."""

    def pending(self) -> bool:
        """Whether work waits for `settle`, which the engine does while it idles."""
        return False

    def settle(self, timeout: float | None = 0) -> None:
        """Up to `timeout` seconds (None: all) of the work kept for the engine's idle time."""

    @abstractmethod
    def unlock(self, session: Session) -> None:
        """The session ends: what it attached or inserted may be evicted again."""

    @abstractmethod
    def release(self) -> None:
        """Give back everything the cache keeps; no session may still hold a lock."""

    @abstractmethod
    def rebind(self, ctx: "Context") -> bool:
        """Serve `ctx` from now on, keeping what is cached: a context over the same model file with
        the same settings as the one the rows were read from (the model reloaded); no session may
        still hold a lock. False, rebinding nothing, where `ctx`'s rows are of another format (another
        file, KV type or page size): the caller releases the cache."""

    def namespaces(self) -> set[str]:
        """The namespaces it holds rows of."""
        return set()

    @abstractmethod
    def stats(self) -> CacheStats:
        """Counters and how much it holds now."""

    @abstractmethod
    def view(self, namespace: str) -> dict:
        """What /v1/cache shows a caller of `namespace`: whether it is on, what it holds under that
        namespace, one entry per chain or checkpoint of it."""

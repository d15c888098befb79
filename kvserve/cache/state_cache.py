"""Checkpoints for models that carry state between tokens (Mamba, LFM2 and other hybrids).

KV pages cannot restore a recurrent state, so this cache keeps checkpoints: the tokens and the
whole sequence at exactly that position (its recurrent state and, for hybrids, its attention rows),
a blob from `llama_state_seq_get_data`, kept whole in the host store. A prompt can attach a
checkpoint only when it starts with all of its tokens; attaching sets the blob into the session's
empty stream.

Invariants:
- the blobs' bytes never exceed the store's budget, not even between insert and evict: the store
  makes room before it keeps a state; the number of checkpoints never exceeds `max_states`;
- eviction takes conversation checkpoints before opening ones, then cold before hot, least
  recently used first, and never one a live session restored or saved.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvserve.cache.cache_stats import CacheStats
from kvserve.cache.chat_marks import MarkKind
from kvserve.cache.host_store import HostStore
from kvserve.cache.kv_pool import Session
from kvserve.cache.prefix_cache import PrefixCache
from kvserve.llama.context import Context


@dataclass(eq=False)
class Checkpoint:
    tokens: list[int]
    kind: MarkKind
    nbytes: int
    preview: str = ""  # a label for dashboards
    hits: int = 0

    @property
    def position(self) -> int:
        return len(self.tokens)

    def snapshot(self) -> dict:
        return {"position": self.position, "kind": self.kind.value, "bytes": self.nbytes, "hits": self.hits,
                "preview": self.preview}


def _rank(kind: MarkKind) -> int:
    """Lower goes first: conversation checkpoints before openings."""
    return 1 if kind is MarkKind.OPENING else 0


class StateCache(PrefixCache):
    keeps = "checkpoints"
    donates_prompt = False  # the prompt's end is the `close` mark plus a generation prompt: not worth a state

    def __init__(self, ctx: Context, page_rows: int, store: HostStore[Checkpoint, np.ndarray], max_states: int = 16,
                 min_gap: int | None = None) -> None:
        if not ctx.model.info.carries_state:
            raise ValueError("attention-only models need no checkpoints: use the page cache")
        self.ctx = ctx
        self.page_rows = page_rows
        self.store = store
        store.on_evict = self._evicted
        self.max_states = max_states
        self.min_gap = page_rows if min_gap is None else min_gap
        self.checkpoints: list[Checkpoint] = []
        self._locks: dict[Session, list[Checkpoint]] = {}
        self._state_size = 0  # of the last state saved: the estimate `checkpoint_at` decides by
        self._queried_tokens = 0
        self._hit_tokens = 0
        self._restores = 0
        self._evictions = 0

    @property
    def bytes_used(self) -> int:
        return self.store.bytes_used

    @property
    def budget_bytes(self) -> int:
        return self.store.budget_bytes

    def caps(self) -> dict:
        return {"prefix_state_bytes": self.store.budget_bytes, "prefix_states": self.max_states}

    # -- lookup -------------------------------------------------------------------------------------

    def _match(self, tokens: list[int]) -> Checkpoint | None:
        """The deepest checkpoint `tokens` fully contains, leaving at least one token to evaluate."""
        best = None
        for c in self.checkpoints:
            if c.position < len(tokens) and (best is None or c.position > best.position):
                if tokens[: c.position] == c.tokens:
                    best = c
        return best

    def match_len(self, tokens: list[int]) -> int:
        found = self._match(tokens)
        return found.position if found else 0

    def attach(self, session: Session, tokens: list[int]) -> int:
        """Set the deepest checkpoint into an empty session's stream."""
        if session.tokens:
            raise ValueError("attach needs an empty session")
        self._queried_tokens += len(tokens)
        found = self._match(tokens)
        if found is None:
            return 0
        self.ctx.write_seq_state(session.seq, self.store.get(found))
        session.tokens = list(found.tokens)
        self._lock(session, found)
        found.hits += 1
        self._restores += 1
        self._hit_tokens += found.position
        return found.position

    def gains_from_waiting(self, shared: int, cached: int) -> bool:
        return shared >= cached + 2 * self.page_rows  # the running prefill may checkpoint a mark in between

    # -- taking checkpoints -------------------------------------------------------------------------

    def checkpoint_at(self, session: Session, tokens: list[int], matched: int, mark: int) -> int:
        if not matched + self.min_gap <= mark < len(tokens):
            return 0  # too close to what is already restored, or no token left to evaluate
        if any(c.tokens == tokens[:mark] for c in self.checkpoints):
            return 0  # already cached there
        if not self.store.fits(self._state_size):
            return 0  # the last state saved would not fit even after every eviction
        return mark

    def insert(self, session: Session, tokens: list[int], preview: str = "",
               kind: MarkKind = MarkKind.CONVERSATION) -> Checkpoint | None:
        """Record a checkpoint where the session stands (call it between two evals): `tokens` must be
        its whole history. An opening one is evicted after every conversation one."""
        if list(tokens) != session.tokens:
            raise ValueError("a checkpoint is taken where the session stands: tokens must be its history")
        for c in self.checkpoints:
            if c.tokens == session.tokens:
                self.store.touch(c)
                if kind is MarkKind.OPENING and c.kind is not kind:
                    c.kind = kind
                    self.store.rerank(c, _rank(kind))
                return c
        self._state_size = self.ctx.state_size(session.seq)
        if not self.store.fits(self._state_size) or not self._below_max_states():
            return None
        blob = self.ctx.read_seq_state(session.seq)
        checkpoint = Checkpoint(tokens=list(session.tokens), kind=kind, nbytes=blob.nbytes, preview=preview[:80])
        if not self.store.put(checkpoint, blob, rank=_rank(kind)):
            return None
        self.checkpoints.append(checkpoint)
        self._lock(session, checkpoint)
        return checkpoint

    def _below_max_states(self) -> bool:
        """Fewer than `max_states` checkpoints, once the store evicted what it may for that."""
        while len(self.checkpoints) >= self.max_states:
            if not self.store.evict(1):
                return False
        return True

    # -- locks and eviction -------------------------------------------------------------------------

    def _lock(self, session: Session, checkpoint: Checkpoint) -> None:
        self.store.lock(checkpoint)
        self._locks.setdefault(session, []).append(checkpoint)

    def unlock(self, session: Session) -> None:
        for checkpoint in self._locks.pop(session, []):
            self.store.unlock(checkpoint)

    def _evicted(self, checkpoint: Checkpoint) -> None:
        self.checkpoints.remove(checkpoint)
        self._evictions += 1

    def release(self) -> None:
        if any(self._locks.values()):
            raise RuntimeError("sessions still use checkpoints: end them first")
        for checkpoint in self.checkpoints:
            self.store.discard(checkpoint)
        self.checkpoints.clear()

    # -- what metrics and dashboards read -------------------------------------------------------------

    def stats(self) -> CacheStats:
        openings = sum(c.kind is MarkKind.OPENING for c in self.checkpoints)
        return CacheStats(
            queried_tokens=self._queried_tokens, hit_tokens=self._hit_tokens, state_hits=self._restores,
            state_evictions=self._evictions, state_bytes=self.bytes_used, held_bytes=self.bytes_used,
            locked_entries=self.store.stats().locked_entries,
            opening_checkpoints=openings, conversation_checkpoints=len(self.checkpoints) - openings,
        )

    def view(self) -> dict:
        return {"enabled": True, "held_pages": 0, "state_bytes": self.bytes_used, "held_bytes": self.bytes_used,
                "state_budget_bytes": self.budget_bytes, "budget_bytes": self.budget_bytes,
                "checkpoints": [c.snapshot() for c in self.checkpoints]}

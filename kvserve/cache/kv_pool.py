"""The KV pool: one context's cells and sequence ids, cut into pages, handed out as sessions.

Invariant (checked by tests through llama.cpp's own positions): the cells in use equal
`held_pages * page_rows` of the prefix cache plus the `private_cells` of every live session.
A session's first `shared` tokens sit on cells somebody else accounts for (cache pages it
attached, or the prompt of the sibling it was forked from); the rest are its own.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from kvserve.llama.batch import Batch
from kvserve.llama.context import Context, ContextParams
from kvserve.llama.model import Model

if TYPE_CHECKING:
    from kvserve.cache.page_tree import PageNode
    from kvserve.cache.prefix_cache import PrefixCache
    from kvserve.cache.state_cache import Checkpoint, StateCache


class PoolExhausted(RuntimeError):
    """No sequence id or no KV cell is left, even after the cache gave back what it could."""


@dataclass(eq=False)
class Session:
    """One sequence in the KV cache and the tokens it holds, in order."""

    seq: int
    tokens: list[int] = field(default_factory=list)
    shared: int = 0
    attached: list["PageNode | Checkpoint"] = field(default_factory=list)  # what it borrows from the cache (locked)

    @property
    def n_past(self) -> int:
        return len(self.tokens)

    @property
    def private_cells(self) -> int:
        return len(self.tokens) - self.shared


class KvPool:
    """Hands out sequence ids and accounts for cells; the prefix cache borrows ids for its holders."""

    def __init__(self, ctx: Context, page_rows: int) -> None:
        if page_rows < 1:
            raise ValueError("page_rows must be >= 1")
        self.ctx = ctx
        self.page_rows = page_rows
        self.cache: PrefixCache | StateCache | None = None
        self._free_ids = list(range(ctx.n_seq_max - 1, -1, -1))  # pop() hands out 0 first
        self._sessions: dict[int, Session] = {}

    # -- sequence ids ---------------------------------------------------------------------------

    @property
    def free_ids(self) -> int:
        return len(self._free_ids)

    def take_id(self) -> int:
        """A free sequence id; asks the cache to give back a holder when none is left."""
        if not self._free_ids and self.cache is not None:
            self.cache.free_a_holder()
        if not self._free_ids:
            raise PoolExhausted("no free sequence id")
        return self._free_ids.pop()

    def return_id(self, seq: int) -> None:
        self._free_ids.append(seq)

    # -- cells ------------------------------------------------------------------------------------

    @property
    def n_cells(self) -> int:
        return self.ctx.n_ctx

    @property
    def used_cells(self) -> int:
        held = self.cache.held_cells if self.cache is not None else 0
        return held + sum(s.private_cells for s in self._sessions.values())

    @property
    def free_cells(self) -> int:
        return self.n_cells - self.used_cells

    def make_room(self, cells: int) -> bool:
        """Have at least `cells` free, evicting unlocked cache pages if needed."""
        short = cells - self.free_cells
        if short > 0 and self.cache is not None:
            self.cache.evict_pages(-(-short // self.page_rows))
        return self.free_cells >= cells

    # -- sessions ---------------------------------------------------------------------------------

    def new_session(self) -> Session:
        session = Session(seq=self.take_id())
        self._sessions[session.seq] = session
        return session

    @property
    def sessions(self) -> list[Session]:
        return list(self._sessions.values())

    def fork(self, parent: Session, child: Session) -> None:
        """Let `child` (empty) share all of `parent`'s cells; they are accounted to the parent."""
        self.ctx.seq_cp(parent.seq, child.seq)
        child.tokens = list(parent.tokens)
        child.shared = len(parent.tokens)

    def release_kv_pages(self, session: Session) -> None:
        """Forget the session: its own cells are freed, borrowed cache pages unlocked, its id returned."""
        self.ctx.seq_rm(session.seq)
        if self.cache is not None:
            self.cache.unlock(session)
        del self._sessions[session.seq]
        self.return_id(session.seq)

    def eval(self, session: Session, tokens: list[int]) -> np.ndarray:
        """Decode `tokens` after the session's history, alone; returns a copy of the last logits."""
        if not tokens:
            raise ValueError("eval needs at least one token")
        if not self.make_room(len(tokens)):
            raise PoolExhausted(f"no room for {len(tokens)} tokens")
        batch = Batch(self.ctx.n_batch)
        try:
            for start in range(0, len(tokens), self.ctx.n_batch):
                batch.clear()
                chunk = tokens[start : start + self.ctx.n_batch]
                for i, token in enumerate(chunk):
                    batch.add(token, session.n_past + i, session.seq, i == len(chunk) - 1)
                self.ctx.decode(batch)
                session.tokens.extend(chunk)
            return self.ctx.logits(batch.n_tokens - 1).copy()
        finally:
            batch.close()

    def close(self) -> None:
        """Free the context. A cache that still borrows pages must be released first."""
        if self.cache is not None and (self.cache.held_pages or self.cache.chain_list()):
            raise RuntimeError("the prefix cache still holds pages of this pool: call release(pool) first")
        self.ctx.close()


def create_kv_pool(model: Model, page_rows: int = 16, *, n_ctx: int = 4096, n_seq_max: int = 64,
                   n_batch: int = 512, n_threads: int = 2) -> KvPool:
    """A pool over a fresh unified-KV context of `model`."""
    params = ContextParams(n_ctx=n_ctx, n_batch=max(n_batch, n_seq_max), n_seq_max=n_seq_max, n_threads=n_threads)
    return KvPool(Context(model, params), page_rows)

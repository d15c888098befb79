"""The KV pool: one context's cells and sequence ids, handed out as sessions.

The pool is a leaf: whoever else keeps cells and sequence ids of its context (the prefix cache)
is a `Lender` it was given at construction, which it asks for room and tells when a session ends.

Invariant (checked by tests through llama.cpp's own positions): the cells in use equal the
lender's `held_cells` plus the `private_cells` of every live session. A session's first `shared`
tokens sit on cells somebody else accounts for (cache pages it attached, or the prompt of the
sibling it was forked from); the rest are its own.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Protocol

import numpy as np

from kvserve.llama.batch import Batch
from kvserve.llama.context import Context


class PoolExhausted(RuntimeError):
    """No sequence id or no KV cell is left, even after the cache gave back what it could."""


@dataclass(eq=False)
class Session:
    """One sequence in the KV cache and the tokens it holds, in order."""

    seq: int
    tokens: list[int] = field(default_factory=list)
    shared: int = 0

    @property
    def n_past(self) -> int:
        return len(self.tokens)

    @property
    def private_cells(self) -> int:
        return len(self.tokens) - self.shared


class SeqIds:
    """The context's sequence ids, drawn by the pool for sessions and by the cache for its holders."""

    def __init__(self, n_seq_max: int) -> None:
        self.n_seq_max = n_seq_max
        self._free = list(range(n_seq_max - 1, -1, -1))  # pop() hands out 0 first

    @property
    def free(self) -> int:
        return len(self._free)

    def take(self, free_one: Callable[[], None]) -> int:
        """A free id; when none is left, `free_one` is asked to give one back first."""
        if not self._free:
            free_one()
        if not self._free:
            raise PoolExhausted("no free sequence id")
        return self._free.pop()

    def give_back(self, seq: int) -> None:
        self._free.append(seq)


class Lender(Protocol):
    """What the pool asks of whoever else keeps cells and sequence ids of its context."""

    @property
    def held_cells(self) -> int:
        """Cells only the lender keeps (a session that shares them does not count them)."""
        ...

    def evict(self, cells: int) -> int:
        """Give back at least `cells` cells if it can; returns the cells it gave back."""
        ...

    def free_a_seq_id(self) -> None:
        """Give back one sequence id, if it keeps one it may let go."""
        ...

    def unlock(self, session: Session) -> None:
        """The session ends: what it borrowed may be evicted again."""
        ...


class KvPool:
    """Hands out sessions (a sequence id each) and accounts for cells."""

    def __init__(self, ctx: Context, ids: SeqIds, lender: Lender) -> None:
        self.ctx = ctx
        self.ids = ids
        self.lender = lender
        self._sessions: dict[int, Session] = {}

    @property
    def free_ids(self) -> int:
        return self.ids.free

    # -- cells ------------------------------------------------------------------------------------

    @property
    def n_cells(self) -> int:
        return self.ctx.n_ctx

    @property
    def used_cells(self) -> int:
        return self.lender.held_cells + sum(s.private_cells for s in self._sessions.values())

    @property
    def free_cells(self) -> int:
        return self.n_cells - self.used_cells

    def make_room(self, cells: int) -> bool:
        """Have at least `cells` free, asking the lender to evict if needed."""
        short = cells - self.free_cells
        if short > 0:
            self.lender.evict(short)
        return self.free_cells >= cells

    # -- sessions ---------------------------------------------------------------------------------

    def new_session(self) -> Session:
        session = Session(seq=self.ids.take(self.lender.free_a_seq_id))
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

    def end_session(self, session: Session) -> None:
        """Forget the session: its own cells are freed, what it borrowed unlocked, its id returned."""
        self.ctx.seq_rm(session.seq)
        self.lender.unlock(session)
        del self._sessions[session.seq]
        self.ids.give_back(session.seq)

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
        """Free the context. A lender that still keeps cells in it must be released first."""
        if self.lender.held_cells:
            raise RuntimeError("the prefix cache still holds cells of this pool: release the cache first")
        self.ctx.close()

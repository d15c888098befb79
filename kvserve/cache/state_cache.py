"""Checkpoints for models that carry state between tokens (Mamba, LFM2 and other hybrids).

KV pages cannot restore a recurrent state, so this cache keeps checkpoints: the tokens, the
recurrent state at exactly that position (a blob from `llama_state_seq_get_data_ext`) and, for
hybrids, the attention cells of those tokens under a holder sequence id (shared, not copied).
A prompt can attach a checkpoint only when it starts with all of its tokens.

Invariants:
- the blobs' bytes never exceed the budget, not even between insert and evict: room is made
  before a state is saved; the number of checkpoints never exceeds `max_states`;
- eviction takes conversation checkpoints before opening ones, least recently used first, and
  never one a live session was restored from;
- `own_cells` counts the attention cells only this checkpoint's holder keeps: the rest belong to
  its `base` (the checkpoint its session was restored from), so the sum is the cells held.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvserve.cache.kv_pool import KvPool, Session
from kvserve.cache.page_tree import tick
from kvserve.cache.prefix_cache import CacheStats


@dataclass(eq=False)
class Checkpoint:
    tokens: list[int]
    blob: bytes
    opening: bool  # shared by every conversation on its system prompt; evicted last
    preview: str = ""  # a label for dashboards
    holder: int | None = None
    base: "Checkpoint | None" = None
    own_cells: int = 0
    lock_ref: int = 0
    hits: int = 0
    last_access: int = field(default_factory=tick)

    @property
    def position(self) -> int:
        return len(self.tokens)

    def snapshot(self) -> dict:
        return {"position": self.position, "kind": "opening" if self.opening else "conversation",
                "bytes": len(self.blob), "hits": self.hits, "preview": self.preview}


@dataclass
class StateStats(CacheStats):
    state_hits: int = 0
    state_evictions: int = 0


class StateCache:
    donates_prompt = False  # the prompt's end is the `close` mark plus a generation prompt: not worth a state

    def __init__(self, pool: KvPool, budget_bytes: int, max_states: int = 16, min_gap: int | None = None) -> None:
        if pool.cache is not None:
            raise ValueError("this pool already has a prefix cache")
        if not pool.ctx.model.info.carries_state:
            raise ValueError("attention-only models need no checkpoints: use the page cache")
        self.pool = pool
        self.budget_bytes = budget_bytes
        self.max_states = max_states
        self.min_gap = pool.page_rows if min_gap is None else min_gap
        self.hybrid = pool.ctx.model.info.is_hybrid
        self.checkpoints: list[Checkpoint] = []
        self.stats = StateStats()
        self._state_size = 0  # of the last state saved: the estimate `checkpoint_at` decides by
        pool.cache = self

    # -- what the pool and the scheduler read ------------------------------------------------------

    @property
    def bytes_used(self) -> int:
        return sum(len(c.blob) for c in self.checkpoints)

    @property
    def held_cells(self) -> int:
        return sum(c.own_cells for c in self.checkpoints)

    @property
    def held_pages(self) -> int:
        return -(-self.held_cells // self.pool.page_rows)

    def chain_list(self) -> list[dict]:
        return [c.snapshot() for c in self.checkpoints]

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
        """Tokens `attach` would restore now. Touches nothing."""
        found = self._match(tokens)
        return found.position if found else 0

    def attach(self, session: Session, tokens: list[int]) -> int:
        """Restore the deepest checkpoint into an empty session: its cells shared, its state loaded."""
        if session.tokens:
            raise ValueError("attach needs an empty session")
        self.stats.queried_tokens += len(tokens)
        found = self._match(tokens)
        if found is None:
            return 0
        ctx = self.pool.ctx
        if found.holder is not None:
            ctx.seq_cp(found.holder, session.seq, 0, found.position)
        ctx.load_state(session.seq, found.blob)
        session.tokens = list(found.tokens)
        session.shared = found.position if found.holder is not None else 0
        self._lock(session, found)
        found.hits += 1
        self.stats.state_hits += 1
        self.stats.hit_tokens += found.position
        return found.position

    # -- taking checkpoints -------------------------------------------------------------------------

    def checkpoint_at(self, session: Session, tokens: list[int], matched: int, mark: int) -> int:
        """Where to stop the prefill for `mark`, or 0 when a stop there buys nothing."""
        if not matched + self.min_gap <= mark < len(tokens):
            return 0  # too close to what is already restored, or no token left to evaluate
        if any(c.tokens == tokens[:mark] for c in self.checkpoints):
            return 0  # already cached there
        if self._state_size > self.budget_bytes:
            return 0  # the last state saved would not fit even in an empty budget
        return mark

    def insert(self, session: Session, tokens: list[int] | None = None, preview: str = "",
               opening: bool = False) -> Checkpoint | None:
        """Record a checkpoint where the session stands (call it between two evals)."""
        if tokens is not None and list(tokens) != session.tokens:
            raise ValueError("a checkpoint is taken where the session stands: tokens must be its history")
        for c in self.checkpoints:
            if c.tokens == session.tokens:
                c.last_access = tick()
                c.opening = c.opening or opening
                return c
        if not self._make_room(self.pool.ctx.state_size(session.seq)):
            return None
        return self._save(session, opening, preview)

    def _save(self, session: Session, opening: bool, preview: str) -> Checkpoint:
        ctx = self.pool.ctx
        base = next((c for c in reversed(session.attached) if isinstance(c, Checkpoint)), None)
        checkpoint = Checkpoint(tokens=list(session.tokens), blob=ctx.save_state(session.seq), opening=opening,
                                preview=preview[:80])
        self._state_size = len(checkpoint.blob)
        if self.hybrid:
            checkpoint.holder = self.pool.take_id()
            ctx.seq_cp(session.seq, checkpoint.holder, 0, session.n_past)
            checkpoint.base = base
            checkpoint.own_cells = session.n_past - (base.position if base else 0)
            session.shared = session.n_past  # its cells are the checkpoint's from here on
        self.checkpoints.append(checkpoint)
        self._lock(session, checkpoint)
        return checkpoint

    # -- locks and eviction -------------------------------------------------------------------------

    def _lock(self, session: Session, checkpoint: Checkpoint) -> None:
        checkpoint.lock_ref += 1
        checkpoint.last_access = tick()
        session.attached.append(checkpoint)

    def unlock(self, session: Session) -> None:
        for checkpoint in session.attached:
            checkpoint.lock_ref -= 1
        session.attached.clear()

    def _victims(self) -> list[Checkpoint]:
        """Unlocked checkpoints in eviction order: conversation before opening, then oldest first."""
        free = [c for c in self.checkpoints if c.lock_ref == 0]
        return sorted(free, key=lambda c: (c.opening, c.last_access))

    def _make_room(self, size: int) -> bool:
        if size > self.budget_bytes:
            return False
        victims = iter(self._victims())
        while self.bytes_used + size > self.budget_bytes or len(self.checkpoints) >= self.max_states:
            victim = next(victims, None)
            if victim is None:
                return False
            self._evict(victim)
        return True

    def evict_pages(self, n_pages: int) -> int:
        """Give back at least `n_pages` pages' worth of attention cells, if unlocked checkpoints hold them."""
        wanted = n_pages * self.pool.page_rows
        freed = 0
        for victim in self._victims():
            if freed >= wanted:
                break
            if victim.own_cells:
                freed += victim.own_cells
                self._evict(victim)
        return -(-freed // self.pool.page_rows)

    def free_a_holder(self) -> None:
        victim = next((c for c in self._victims() if c.holder is not None), None)
        if victim is not None:
            self._evict(victim)

    def _evict(self, victim: Checkpoint) -> None:
        self.checkpoints.remove(victim)
        for c in self.checkpoints:
            if c.base is victim:  # the victim's own cells stay alive under this holder's bits
                c.base = victim.base
                c.own_cells += victim.own_cells
        if victim.holder is not None:
            self.pool.ctx.seq_rm(victim.holder)
            self.pool.return_id(victim.holder)
        self.stats.state_evictions += 1

    def release(self) -> None:
        if any(c.lock_ref for c in self.checkpoints):
            raise RuntimeError("sessions still use checkpoints: release them first")
        for victim in list(self.checkpoints):
            self._evict(victim)
        self.pool.cache = None

"""The prefix cache as a library, usable by hand to drive one's own scheduler.

    pool = create_kv_pool(model, page_rows=16)
    cache = create_prefix_cache(pool)
    a = pool.new_session(); pool.eval(a, prompt_a); insert(pool, a, a.tokens, preview="A")
    match_len(pool, prompt_b)             # how much of B is cached; touches nothing
    b = pool.new_session(); attach(pool, b, prompt_b); pool.eval(b, prompt_b[b.n_past:])
    cache.chain_list(); cache.held_pages
    release_kv_pages(pool, a); release_kv_pages(pool, b); release(pool); pool.close()

Models that carry state (Mamba, LFM2, hybrids) get checkpoints instead of pages: render the chat
with `render_turn_marked`, ask `checkpoint_at` where a mark is worth a stop, eval up to it, and
`insert(..., opening=True)` records the state there.
"""

from __future__ import annotations

from kvserve.cache.chat_marks import Chat, MarkedTurn, add_assistant, add_user, create_chat_renderer, render_turn_marked
from kvserve.cache.kv_pool import KvPool, PoolExhausted, Session, create_kv_pool
from kvserve.cache.prefix_cache import Chain, PrefixCache
from kvserve.cache.state_cache import Checkpoint, StateCache

DEFAULT_STATE_BUDGET = 256 * 1024 * 1024


def create_prefix_cache(pool: KvPool, *, max_states: int = 16,
                        state_budget_bytes: int = DEFAULT_STATE_BUDGET) -> PrefixCache | StateCache:
    """The cache serving `pool`'s sessions: pages for attention models, checkpoints (at most
    `max_states`, within `state_budget_bytes` of state) for models that carry state."""
    if pool.ctx.model.info.carries_state:
        return StateCache(pool, state_budget_bytes, max_states)
    return PrefixCache(pool)


def _cache(pool: KvPool) -> PrefixCache | StateCache:
    if pool.cache is None:
        raise RuntimeError("this pool has no prefix cache")
    return pool.cache


def insert(pool: KvPool, session: Session, tokens: list[int], preview: str = "",
           opening: bool = False) -> Chain | Checkpoint | None:
    """Donate the session's evaluated history: its full pages, or a checkpoint where it stands
    (`opening=True`: one every conversation on this system prompt shares)."""
    cache = _cache(pool)
    if isinstance(cache, StateCache):
        return cache.insert(session, tokens, preview, opening=opening)
    return cache.insert(session, tokens, preview)


def match_len(pool: KvPool, tokens: list[int]) -> int:
    """How many leading tokens `attach` would attach now; touches nothing."""
    return _cache(pool).match_len(tokens)


def attach(pool: KvPool, session: Session, tokens: list[int]) -> int:
    """Attach the longest cached prefix of `tokens` to an empty session; returns its length."""
    return _cache(pool).attach(session, tokens)


def checkpoint_at(pool: KvPool, session: Session, tokens: list[int], matched: int, opening: int) -> int:
    """Where to stop the prefill for the mark `opening`, or 0 when a stop buys nothing (always 0
    on a model with no recurrent state: its pages are already the cache)."""
    cache = pool.cache
    if not isinstance(cache, StateCache):
        return 0
    return cache.checkpoint_at(session, tokens, matched, opening)


def release_kv_pages(pool: KvPool, session: Session) -> None:
    """End a session: its own cells are freed and borrowed pages unlocked."""
    pool.release_kv_pages(session)


def release(pool: KvPool) -> None:
    """Hand every cached page and checkpoint back to the pool."""
    _cache(pool).release()


__all__ = [
    "Chain", "Chat", "Checkpoint", "KvPool", "MarkedTurn", "PoolExhausted", "PrefixCache", "Session", "StateCache",
    "add_assistant", "add_user", "attach", "checkpoint_at", "create_chat_renderer", "create_kv_pool",
    "create_prefix_cache", "insert", "match_len", "release", "release_kv_pages", "render_turn_marked",
]

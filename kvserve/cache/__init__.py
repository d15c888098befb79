"""The prefix cache as a library, usable by hand to drive one's own scheduler.

    pool = create_kv_pool(model, page_rows=16)
    cache = create_prefix_cache(pool)
    a = pool.new_session(); pool.eval(a, prompt_a); insert(pool, a, a.tokens, preview="A")
    match_len(pool, prompt_b)             # how much of B is cached; touches nothing
    b = pool.new_session(); attach(pool, b, prompt_b); pool.eval(b, prompt_b[b.n_past:])
    cache.chain_list(); cache.held_pages
    release_kv_pages(pool, a); release_kv_pages(pool, b); release(pool); pool.close()
"""

from __future__ import annotations

from kvserve.cache.kv_pool import KvPool, PoolExhausted, Session, create_kv_pool
from kvserve.cache.prefix_cache import Chain, PrefixCache


def create_prefix_cache(pool: KvPool) -> PrefixCache:
    """A prefix cache serving `pool`'s sessions (a pool has at most one)."""
    return PrefixCache(pool)


def _cache(pool: KvPool) -> PrefixCache:
    if pool.cache is None:
        raise RuntimeError("this pool has no prefix cache")
    return pool.cache


def insert(pool: KvPool, session: Session, tokens: list[int], preview: str = "") -> Chain | None:
    """Donate every full page of `tokens` (the session's evaluated history)."""
    return _cache(pool).insert(session, tokens, preview)


def match_len(pool: KvPool, tokens: list[int]) -> int:
    """How many leading tokens `attach` would attach now; touches nothing."""
    return _cache(pool).match_len(tokens)


def attach(pool: KvPool, session: Session, tokens: list[int]) -> int:
    """Attach the longest cached run of whole pages of `tokens`; returns the tokens attached."""
    return _cache(pool).attach(session, tokens)


def release_kv_pages(pool: KvPool, session: Session) -> None:
    """End a session: its own cells are freed and borrowed pages unlocked."""
    pool.release_kv_pages(session)


def release(pool: KvPool) -> None:
    """Hand every cached page back to the pool."""
    _cache(pool).release()


__all__ = [
    "Chain", "KvPool", "PoolExhausted", "PrefixCache", "Session",
    "attach", "create_kv_pool", "create_prefix_cache", "insert", "match_len", "release", "release_kv_pages",
]

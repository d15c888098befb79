"""The prefix cache as a library, usable by hand to drive one's own scheduler.

    pool, cache = create_kv_pool(model, page_rows=16)
    a = pool.new_session(); pool.eval(a, prompt_a); cache.insert(a, a.tokens, preview="A")
    cache.match_len(prompt_b)             # how much of B is cached; touches nothing
    b = pool.new_session(); cache.attach(b, prompt_b); pool.eval(b, prompt_b[b.n_past:])
    cache.view(); cache.stats()
    pool.end_session(a); pool.end_session(b); cache.release(); pool.close()

Models that carry state (Mamba, LFM2, hybrids) get checkpoints instead of pages: render the chat
with `render_turn_marked`, ask `cache.checkpoint_at` where a mark is worth stopping the prefill,
eval up to it, and `cache.insert` records the state there.
"""

from __future__ import annotations

from typing import Any

from kvserve.cache.cache_stats import CacheStats
from kvserve.cache.chat_marks import (
    Chat, Mark, MarkedTurn, MarkKind, add_assistant, add_user, create_chat_renderer, render_turn_marked,
)
from kvserve.cache.kv_pool import KvPool, PoolExhausted, SeqIds, Session
from kvserve.cache.no_cache import NoCache
from kvserve.cache.page_cache import Chain, PageCache
from kvserve.cache.prefix_cache import PrefixCache
from kvserve.cache.state_cache import Checkpoint, StateCache
from kvserve.llama.context import Context, ContextParams
from kvserve.llama.model import Model

DEFAULT_STATE_BUDGET = 256 * 1024 * 1024


def create_prefix_cache(ctx: Context, ids: SeqIds, page_rows: int, *, enabled: bool = True,
                        max_cells: int | None = None, max_states: int = 16,
                        state_budget_bytes: int = DEFAULT_STATE_BUDGET) -> PrefixCache:
    """The cache serving `ctx`'s sessions: pages (at most `max_cells` of them) for attention models,
    checkpoints (at most `max_states`, within `state_budget_bytes` of state) for models that carry
    state, nothing when not `enabled`."""
    if not enabled:
        return NoCache()
    if ctx.model.info.carries_state:
        return StateCache(ctx, ids, page_rows, state_budget_bytes, max_states)
    return PageCache(ctx, ids, page_rows, max_cells)


def create_kv_pool(model: Model, page_rows: int = 16, *, n_ctx: int = 4096, n_seq_max: int = 64,
                   n_batch: int = 512, n_threads: int = 2, **cache_options: Any) -> tuple[KvPool, PrefixCache]:
    """A pool over a fresh unified-KV context of `model`, and the prefix cache its sessions share
    (`cache_options`: those of `create_prefix_cache`)."""
    params = ContextParams(n_ctx=n_ctx, n_batch=max(n_batch, n_seq_max), n_seq_max=n_seq_max, n_threads=n_threads)
    ctx = Context(model, params)
    ids = SeqIds(ctx.n_seq_max)
    cache = create_prefix_cache(ctx, ids, page_rows, **cache_options)
    return KvPool(ctx, ids, cache), cache


__all__ = [
    "CacheStats", "Chain", "Chat", "Checkpoint", "KvPool", "Mark", "MarkKind", "MarkedTurn", "NoCache", "PageCache",
    "PoolExhausted", "PrefixCache", "SeqIds", "Session", "StateCache", "add_assistant", "add_user",
    "create_chat_renderer", "create_kv_pool", "create_prefix_cache", "render_turn_marked",
]

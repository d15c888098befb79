"""The prefix cache as a library, usable by hand to drive one's own scheduler.

    pool, cache = create_kv_pool(model, page_rows=16)   # a stream per session; pages in host memory
    kv = KvManager(pool, cache)                          # kvserve.scheduler.kv_manager: what streams hold
    a = kv.new_session(); kv.eval(a, prompt_a); cache.insert(a, a.tokens, preview="A")
    key_b = PrefixKey("", prompt_b)      # "" is the shared namespace
    cache.match_len(key_b)                # how much of B is cached; touches nothing
    b = kv.new_session(); kv.attach(b, key_b); kv.eval(b, prompt_b[b.n_past:])
    cache.view(""); cache.stats()
    pool.end_session(a); pool.end_session(b); cache.release(); pool.close()

`kv.new_session(key)` instead places the session in place: in the idle stream of `key`'s
namespace that still holds the longest prefix of its tokens, which it keeps. A session's namespace
(its key's, at `new_session`) is what it may attach and what it donates to: a key of another
namespace never matches its rows. A session's tokens are read-only: the pool and the caches move
rows and say what they kept or restored, and only the `KvManager` records it.

Models that carry state (Mamba, LFM2, hybrids) get checkpoints instead of pages: render the chat
with `render_turn_marked`, ask `cache.checkpoint_at` where a mark is worth stopping the prefill,
eval up to it, and `cache.insert` records the state there.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from kvserve.cache.cache_stats import CacheStats
from kvserve.cache.chat_marks import (
    Chat, Mark, MarkedTurn, MarkKind, add_assistant, add_user, create_chat_renderer, render_turn_marked,
)
from kvserve.cache.host_store import HostStore
from kvserve.cache.kv_pool import KvPool, PoolExhausted, Session, StreamPool
from kvserve.cache.no_cache import NoCache
from kvserve.cache.page_cache import Chain, PageCache
from kvserve.cache.prefix_cache import PrefixCache
from kvserve.cache.prefix_key import PrefixKey
from kvserve.cache.state_cache import Checkpoint, StateCache
from kvserve.cache.tiers import Tiers
from kvserve.llama.context import Context, ContextParams, FlashAttn
from kvserve.llama.kv_types import KvType
from kvserve.llama.model import Model

DEFAULT_CACHE_BUDGET = 256 * 1024 * 1024


def create_prefix_cache(ctx: Context, page_rows: int, *, enabled: bool = True,
                        budget_bytes: int = DEFAULT_CACHE_BUDGET, max_states: int = 16,
                        tiers: Tiers = Tiers()) -> PrefixCache:
    """The cache serving `ctx`'s sessions, within `budget_bytes` of host memory (one store): pages
    for attention models (also on disk and announced, as `tiers` say), checkpoints (at most
    `max_states`) for models that carry state, nothing when not `enabled`."""
    scratch, tiers = tiers.scratch, replace(tiers, scratch=None)  # a page cache's alone: others let it go
    if not enabled:
        return NoCache()
    store: HostStore = HostStore(budget_bytes)
    if ctx.model.info.carries_state:
        return StateCache(ctx, page_rows, store, max_states, tiers=tiers)
    return PageCache(ctx, page_rows, store, tiers, scratch)


def create_kv_pool(model: Model, page_rows: int = 16, *, n_ctx_seq: int = 2048, n_streams: int = 8,
                   n_batch: int = 512, n_threads: int = 2, flash_attn: FlashAttn = "auto",
                   kv_types: tuple[KvType, KvType] = ("f16", "f16"), kept: PrefixCache | None = None,
                   **cache_options: Any) -> tuple[StreamPool, PrefixCache]:
    """A context of `n_streams` streams of `n_ctx_seq` cells each over `model`, its KV rows stored as
    `kv_types` (K, V), the pool of its streams, and the prefix cache its sessions share: `kept` (the
    cache of an earlier context with the same model and settings, rebound to this one), else a new
    one (`cache_options`: those of `create_prefix_cache`); pages keep the rows as stored."""
    params = ContextParams(n_ctx_seq=n_ctx_seq, n_batch=max(n_batch, n_streams), n_seq_max=n_streams,
                           n_threads=n_threads, flash_attn=flash_attn, type_k=kv_types[0], type_v=kv_types[1])
    ctx = Context(model, params)
    if kept is not None and not kept.rebind(ctx):  # rows of another file or format: never attached here
        kept.release()
        kept = None
    cache = kept if kept is not None else create_prefix_cache(ctx, page_rows, **cache_options)
    return StreamPool(ctx, on_end=cache.unlock, reuse=cache_options.get("enabled", True)), cache


__all__ = [
    "CacheStats", "Chain", "Chat", "Checkpoint", "HostStore", "KvPool", "Mark", "MarkKind", "MarkedTurn", "NoCache",
    "PageCache",
    "PoolExhausted", "PrefixCache", "PrefixKey", "Session", "StateCache", "StreamPool", "Tiers", "add_assistant", "add_user",
    "create_chat_renderer", "create_kv_pool", "create_prefix_cache", "render_turn_marked",
]

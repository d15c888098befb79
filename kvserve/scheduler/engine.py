"""Everything one served model needs, built from settings in dependency order and closed in reverse."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from kvserve.cache.kv_pool import KvPool, SeqIds
from kvserve.cache.no_cache import NoCache
from kvserve.cache.page_cache import PageCache
from kvserve.cache.prefix_cache import PrefixCache
from kvserve.cache.state_cache import StateCache
from kvserve.config import Settings
from kvserve.llama.attention_check import FlashAttnChoice, choose_flash_attn
from kvserve.llama.chat_template import ChatTemplate
from kvserve.llama.context import MAX_SEQUENCES, Context, ContextParams
from kvserve.llama.model import Model
from kvserve.scheduler.async_engine import AsyncEngine
from kvserve.scheduler.config import SchedulerConfig
from kvserve.scheduler.embeddings import Embedder, EmbedderConfig, model_pooling
from kvserve.scheduler.scheduler import Scheduler

_log = logging.getLogger("kvserve.engine")


def cache_cells(asked: int, n_ctx: int) -> int:
    """The cells the page cache may keep: at most half the context, since a cache that can fill it
    leaves running requests room only by evicting at every step."""
    return min(asked, n_ctx // 2)


def _cache_cells(asked: int, n_ctx: int) -> int:
    cap = cache_cells(asked, n_ctx)
    if cap < asked:
        _log.warning("--prefix-cache-cells %d is more than half of the %d-cell context; the cache keeps at most %d",
                     asked, n_ctx, cap)
    return cap


def _prefix_cache(settings: Settings, ctx: Context, ids: SeqIds) -> PrefixCache:
    if not settings.prefix_cache:
        return NoCache()
    if ctx.model.info.carries_state:
        return StateCache(ctx, ids, settings.page_rows, settings.prefix_state_mb * 1024 * 1024, settings.prefix_states)
    return PageCache(ctx, ids, settings.page_rows, _cache_cells(settings.prefix_cache_cells, ctx.n_ctx))


@dataclass
class Engine:
    settings: Settings
    model: Model
    template: ChatTemplate
    pool: KvPool
    cache: PrefixCache
    scheduler: Scheduler
    async_engine: AsyncEngine
    attention: FlashAttnChoice  # flash attention on or off, and why (/server_info reports it)

    @property
    def embedder(self) -> Embedder:
        return self.scheduler.embedder

    @property
    def max_seq_len(self) -> int:
        return self.scheduler.config.max_seq_len

    @classmethod
    def load(cls, settings: Settings) -> "Engine":
        model = Model(settings.model)
        caching = settings.prefix_cache
        # The cache's holder sequences share llama.cpp's sequence ids with running ones; a recurrent
        # model allocates a state per id, so it gets only what its checkpoints need.
        if not caching:
            n_seq_max = settings.parallel
        elif model.info.carries_state:
            n_seq_max = settings.parallel + settings.prefix_states
        else:
            n_seq_max = MAX_SEQUENCES
        n_seq_max = min(n_seq_max, MAX_SEQUENCES)
        attention = choose_flash_attn(model, settings.flash_attn, settings.threads)
        params = ContextParams(
            n_ctx=settings.ctx_size,
            n_batch=max(settings.batch_size, n_seq_max),
            n_seq_max=n_seq_max,
            n_threads=settings.threads,
            flash_attn="on" if attention.enabled else "off",
        )
        ctx = Context(model, params)
        ids = SeqIds(ctx.n_seq_max)
        cache = _prefix_cache(settings, ctx, ids)
        pool = KvPool(ctx, ids, cache)
        config = SchedulerConfig(
            max_running=settings.parallel,
            token_budget=settings.batch_size,
            max_seq_len=min(ctx.n_ctx, model.info.n_ctx_train or ctx.n_ctx),
            queue_timeout=settings.queue_timeout,
            prefill_chunk=settings.prefill_chunk or None,
            attention_tile_rows=ctx.attention_tile_rows,
        )
        embedder = Embedder(model, EmbedderConfig(
            pooling=settings.pooling or model_pooling(model), batch_tokens=min(settings.embedding_batch, config.max_seq_len),
            n_threads=settings.threads, queue_timeout=settings.queue_timeout))
        scheduler = Scheduler(pool, cache, config, embedder)
        async_engine = AsyncEngine(scheduler, settings.max_queue, settings.stall_seconds)
        return cls(settings, model, ChatTemplate.from_model(model), pool, cache, scheduler, async_engine, attention)

    def close(self) -> None:
        """Release the cache, then the contexts, then the model (the reverse of `load`)."""
        self.scheduler.release_all()
        self.cache.release()
        self.pool.close()
        self.embedder.close()
        self.model.close()

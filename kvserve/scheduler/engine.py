"""Everything one served model needs, built from settings in dependency order and closed in reverse."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from kvserve.cache import create_kv_pool
from kvserve.cache.kv_pool import KvPool
from kvserve.cache.prefix_cache import PrefixCache
from kvserve.cache.tiers import Tiers
from kvserve.config import ModelSettings, ServerSettings
from kvserve.llama.attention_check import FlashAttnChoice, choose_flash_attn
from kvserve.llama.chat_template import ChatTemplate
from kvserve.llama.kv_types import KvType, is_quantized
from kvserve.llama.lora import AdapterLoadError, LoraAdapters
from kvserve.llama.model import Model, ModelLoadError, peek_kind
from kvserve.reply import ReasoningFormat, resolve_format
from kvserve.scheduler.async_engine import AsyncEngine
from kvserve.scheduler.config import SchedulerConfig
from kvserve.scheduler.draft_model import DraftModel, check_draft_model
from kvserve.scheduler.embeddings import Embedder, EmbedderConfig, model_pooling
from kvserve.scheduler.scheduler import Scheduler
from kvserve.scheduler.speculation import SpecConfig, SpecMode

_log = logging.getLogger("kvserve.engine")
MIB = 1024 * 1024


@dataclass
class Engine:
    settings: ModelSettings
    model: Model
    template: ChatTemplate
    pool: KvPool
    cache: PrefixCache
    scheduler: Scheduler
    async_engine: AsyncEngine
    attention: FlashAttnChoice  # flash attention on or off, and why (/server_info reports it)
    reasoning: ReasoningFormat = ReasoningFormat.NONE  # how replies carry thinking
    lora: LoraAdapters | None = None  # the --lora adapters requests may pick (None: none given)
    draft: DraftModel | None = None  # --draft-model, where speculation uses it

    @property
    def embedder(self) -> Embedder:
        return self.scheduler.embedder

    @property
    def max_seq_len(self) -> int:
        return self.scheduler.config.max_seq_len

    @property
    def memory_bytes(self) -> int:
        """What it holds, as llama.cpp reports it: the weights, each context's KV cells and compute
        and output buffers (the embedding context once made), a draft model's too."""
        held = self.model.info.size_bytes + self.pool.ctx.buffer_bytes + self.embedder.memory_bytes
        if self.draft is not None:
            held += self.draft.model.info.size_bytes + self.draft.ctx.buffer_bytes
        return held

    @property
    def kind(self) -> str:
        """`chat` (it generates, and embeds too) or `embedding` (it only embeds)."""
        return "embedding" if self.model.info.embedding_only else "chat"

    @classmethod
    def load(cls, settings: ModelSettings, server: ServerSettings, cache_mb: float | None = None,
             kept: PrefixCache | None = None, tiers: Tiers = Tiers()) -> "Engine":
        """`settings`' model, served within `server`'s queue limits, its prefix cache within `cache_mb` of
        host memory (default: all of `--prefix-state-mb`), or `kept`: what `close(keep_cache=True)` gave
        back of an engine of the same file and settings."""
        model = Model(settings.model)
        try:
            return cls._load(model, embedder_settings(settings) if model.info.embedding_only else settings, server,
                             server.prefix_state_mb if cache_mb is None else cache_mb, kept, tiers)
        except BaseException:
            model.close()
            raise

    @classmethod
    def _load(cls, model: Model, settings: ModelSettings, server: ServerSettings, cache_mb: float,
              kept: PrefixCache | None, tiers: Tiers) -> "Engine":
        attention = flash_attn_for(model, settings)
        lora = LoraAdapters(model, settings.lora_paths()) if settings.lora else None
        # a stream of --ctx-size cells per running sequence: llama.cpp's n_ctx is their sum
        pool, cache = create_kv_pool(
            model, settings.page_rows, n_ctx_seq=settings.ctx_size, n_streams=settings.parallel,
            n_batch=settings.batch_size, n_threads=settings.threads,
            flash_attn="on" if attention.enabled else "off", kv_types=kv_types(settings),
            enabled=settings.prefix_cache, budget_bytes=int(cache_mb * MIB),
            max_states=settings.prefix_states, kept=kept, tiers=tiers,
        )
        try:
            draft = load_draft_model(settings, pool, attention)
        except Exception:
            cache.release()
            pool.close()
            if lora is not None:
                lora.close()
            raise
        ctx = pool.ctx
        _log.info("KV: %d streams of %d cells (K %s, V %s), %.0f MiB; prefix cache: %s in up to %g MiB of host memory",
                  pool.n_streams, pool.n_ctx_seq, *kv_types(settings), ctx.kv_bytes / MIB, cache.keeps, cache_mb)
        config = SchedulerConfig(
            max_running=settings.parallel,
            token_budget=settings.batch_size,
            max_seq_len=min(ctx.n_ctx_seq, model.info.n_ctx_train or ctx.n_ctx_seq),
            queue_timeout=server.queue_timeout,
            prefill_chunk=settings.prefill_chunk or None,
        )
        embedder = Embedder(model, EmbedderConfig(
            # its own context: --ctx-size (the generation streams') does not bound it, the model's does
            pooling=settings.pooling or model_pooling(model),
            batch_tokens=min(settings.embedding_batch, model.info.n_ctx_train or settings.embedding_batch),
            n_threads=settings.threads, queue_timeout=server.queue_timeout))
        spec = SpecConfig.of(SpecMode(settings.speculative), settings.draft_max)
        scheduler = Scheduler(pool, cache, config, embedder, spec, lora, draft)
        if spec.mode is not SpecMode.OFF and not scheduler.speculator.enabled:  # auto decides so quietly
            (_log.info if spec.mode is SpecMode.AUTO else _log.warning)(
                "speculative decoding is off: this model's KV rows cannot be cut back (a recurrent state)")
        async_engine = AsyncEngine(scheduler, server.max_queue, server.stall_seconds, settings.threads)
        template = ChatTemplate.from_model(model, settings.chat_template_file)
        reasoning = resolve_format(settings.reasoning_format, template.source, model.is_one_token)
        _log.info("reasoning format: %s", reasoning.value)
        return cls(settings, model, template, pool, cache, scheduler, async_engine, attention, reasoning,
                   lora, draft)

    def close(self, keep_cache: bool = False) -> PrefixCache | None:
        """Release the cache (or, `keep_cache`, return it for a later `load` of the same file and
        settings), then the contexts, then the model (the reverse of `load`)."""
        self.scheduler.release_all()
        if not keep_cache:
            self.cache.release()
        self.pool.close()
        if self.draft is not None:
            self.draft.close()
        self.embedder.close()
        if self.lora is not None:
            self.lora.close()
        self.model.close()
        return self.cache if keep_cache else None


def embedder_settings(settings: ModelSettings) -> ModelSettings:
    """An embedding-only model's settings: one stream, no prefix cache (it keeps no KV rows to page), no drafts."""
    if settings.speculative not in ("off", "auto") or settings.lora:  # auto (the default) drafts where it can
        _log.warning("%s embeds only: --speculative and --lora do not apply to it", settings.model)
    return settings.model_copy(update={"prefix_cache": False, "parallel": 1, "speculative": "off", "draft_model": None,
                                       "lora": []})


def uses_draft_model(settings: ModelSettings) -> bool:
    return settings.draft_model is not None and settings.speculative == "draft"


def load_draft_model(settings: ModelSettings, pool: KvPool, attention: FlashAttnChoice) -> DraftModel | None:
    """The draft model's context beside the target's (a stream per target stream), where
    `--speculative draft` uses it and the target's rows can be cut back (not a recurrent state)."""
    if settings.draft_model is not None and not uses_draft_model(settings):
        _log.warning("--draft-model %s is not loaded: only --speculative draft uses it, not %s",
                     settings.draft_model, settings.speculative)
    if not uses_draft_model(settings) or pool.ctx.model.info.carries_state:
        return None
    draft = DraftModel(settings.draft_model, pool.ctx, settings.threads, "on" if attention.enabled else "off")
    _log.info("draft model %s: %d streams, %.0f MiB", settings.draft_model, draft.ctx.n_seq_max, draft.ctx.kv_bytes / MIB)
    return draft


def kv_types(settings: ModelSettings) -> tuple[KvType, KvType]:
    return settings.cache_type_k, settings.cache_type_v


def flash_attn_for(model: Model, settings: ModelSettings) -> FlashAttnChoice:
    """Flash attention on or off (`--flash-attn` and the self-check over the served KV types). A
    quantized V cache needs it: `auto` turns it on then, as llama.cpp does; with `off` this raises
    ValueError."""
    asked = "on" if is_quantized(settings.cache_type_v) and settings.flash_attn == "auto" else settings.flash_attn
    attention = choose_flash_attn(model, asked, settings.threads, kv_types(settings))
    if is_quantized(settings.cache_type_v) and not attention.enabled:
        raise ValueError(f"--cache-type-v {settings.cache_type_v} needs flash attention, which is off: {attention.reason}")
    return attention


def preflight(settings: ModelSettings) -> None:
    """What `Engine.load` would refuse, refused before the server starts, as a ValueError: a quantized
    V without flash attention (the check's verdict is kept for `Engine.load`), an adapter llama.cpp
    cannot load for the model, a file llama.cpp cannot read at all."""
    llama_log = logging.getLogger("kvserve.llama")
    level = llama_log.level
    llama_log.setLevel(logging.CRITICAL)  # what llama.cpp says of a refusal is in the one line raised
    try:
        _refuse_what_would_not_load(settings)
    finally:
        llama_log.setLevel(level)


def _refuse_what_would_not_load(settings: ModelSettings) -> None:
    if peek_kind(settings.model) is None:  # its header and vocabulary only: a fraction of a second
        raise ValueError(f"--model {settings.model}: llama.cpp cannot read it (not a GGUF file, or a damaged one)")
    if not is_quantized(settings.cache_type_v) and not settings.lora and not uses_draft_model(settings):
        return
    try:
        model = Model(settings.model)
    except ModelLoadError as exc:
        raise ValueError(f"--model: {exc}") from None
    try:
        flash_attn_for(model, settings)
        LoraAdapters(model, settings.lora_paths()).close()
        if uses_draft_model(settings):
            _check_draft_file(model, settings.draft_model)
    except AdapterLoadError as exc:
        raise ValueError(str(exc)) from None
    finally:
        model.close()


def _check_draft_file(model: Model, path) -> None:
    try:
        draft = Model(path)
    except ModelLoadError as exc:
        raise ValueError(f"--draft-model: {exc}") from None
    try:
        check_draft_model(model, draft)
    finally:
        draft.close()

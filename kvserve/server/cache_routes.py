"""Prefix-cache views: what a router asks each replica (`/v1/prefix/match`) and a dashboard's `/v1/cache`.

Both answer for the caller's namespace only (its tenant and the `cache_salt` it gives): a caller
never learns whether, or what, another namespace has cached.
"""

from __future__ import annotations

import dataclasses

from fastapi import APIRouter, Request

from kvserve.cache.prefix_key import PrefixKey
from kvserve.scheduler.engine import Engine
from kvserve.server import prompts
from kvserve.server.model_set import engine_for, loaded_engine_for
from kvserve.server.auth import tenant_of
from kvserve.server.errors import invalid
from kvserve.server.namespace import request_namespace
from kvserve.server.schemas import MAX_CACHE_SALT

router = APIRouter()


@router.post("/v1/prefix/match")
@router.post("/prefix/match")
async def prefix_match(body: dict, request: Request) -> dict:
    parsed = prompts.parse_body(body)
    engine = await engine_for(request, parsed.model)
    tokens = await prompts.prompt_tokens(engine.model, engine.template, parsed)
    prompts.room_for(tokens, engine.max_seq_len, prompts.prompt_param(parsed))  # refused as its request would be
    namespace = prompts.job_namespace(parsed, tenant_of(request), engine, prompts.adapters_for(engine, parsed))
    key = PrefixKey(namespace, tokens)

    def match() -> dict:
        keys = getattr(engine.cache, "matched_keys", lambda _: [])(key)
        # `page_keys`: the pages the cache would attach (host memory, then disk), by the names KV events
        # use; `cached_tokens` may be more: an idle stream may still hold a longer prefix in place
        return {"prompt_tokens": len(tokens), "cached_tokens": engine.scheduler.kv.cached_len(key),
                "page_size": engine.settings.page_rows, "page_tokens": len(keys) * engine.settings.page_rows,
                "page_keys": [k.hex() for k in keys]}

    return await engine.async_engine.call(match)


@router.get("/v1/cache")
@router.get("/cache")
async def cache_view(request: Request, cache_salt: str | None = None, model: str | None = None) -> dict:
    """What the caller's namespace holds in `?model=`'s cache (`?cache_salt=` names a salted one); the
    pool's counts are the whole model's, its streams of other namespaces show neither rows nor lengths."""
    if cache_salt is not None and not 1 <= len(cache_salt) <= MAX_CACHE_SALT:
        raise invalid(f"cache_salt: a salt has 1 to {MAX_CACHE_SALT} characters", "cache_salt")
    models = request.app.state.models
    served, engine = models.find(model), loaded_engine_for(request, model)
    if engine is None:  # a look loads nothing: it says so, and what its settings say
        return {**models.describe(served), "page_rows": served.spec.settings.page_rows, "tiers": _disk_tier(request)}
    pool = engine.pool
    namespace = request_namespace(tenant=tenant_of(request), cache_salt=cache_salt)

    def snapshot() -> dict:
        return {
            "status": {"value": served.status.value},
            "page_rows": engine.settings.page_rows,
            **engine.cache.view(namespace),
            "tiers": _tiers(request, engine),
            "pool": {"cells": pool.n_cells, "used_cells": pool.used_cells, "streams": pool.n_streams,
                     "free_streams": pool.free_streams, "inplace_reuses": pool.inplace_reuses,
                     "stream_cells": pool.n_ctx_seq, "stream_states": pool.stream_view(namespace)},
        }

    return await engine.async_engine.call(snapshot)


def _tiers(request: Request, engine: Engine) -> dict:
    """Each tier the model's pages live in: host memory (its own share), and the server's disk tier."""
    stats = engine.cache.stats()
    return {"host": {"bytes": stats.held_bytes, "pages": stats.held_pages, "hit_tokens": stats.hit_tokens,
                     "evicted_pages": stats.evicted_pages}, **_disk_tier(request)}


def _disk_tier(request: Request) -> dict:
    """The server's disk tier, where it has one, which every model's pages share."""
    disk = getattr(request.app.state.models.persistence, "disk", None)
    if disk is None:
        return {}
    d = disk.stats()
    return {"disk": {"bytes": d.bytes, "pages": d.pages, "budget_bytes": d.budget_bytes, "hits": d.hits,
                     "writes": d.writes, "written_bytes": d.written_bytes, "read_seconds": round(d.read_seconds, 3),
                     "write_seconds": round(d.write_seconds, 3), "refused": d.refused,
                     "dropped_writes": d.dropped_writes, "evictions": d.evictions, **_runs(request)}}


def _runs(request: Request) -> dict:
    """The disk tier's runs: long chains of its pages again, each in one file llama.cpp reads itself."""
    runs = getattr(request.app.state.models.persistence, "runs", None)
    if runs is None:
        return {}
    return {"runs": {name: round(value, 3) if isinstance(value, float) else value
                     for name, value in dataclasses.asdict(runs.stats()).items()}}

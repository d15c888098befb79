"""Prefix-cache views: what a router asks each replica (`/v1/prefix/match`) and a dashboard's `/v1/cache`.

Both answer for the caller's namespace only (its tenant and the `cache_salt` it gives): a caller
never learns whether, or what, another namespace has cached.
"""

from __future__ import annotations

from fastapi import APIRouter, Request

from kvserve.cache.prefix_key import PrefixKey
from kvserve.scheduler.engine import Engine
from kvserve.server import prompts
from kvserve.server.model_set import engine_for
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
    key = PrefixKey(prompts.job_namespace(parsed, tenant_of(request)), tokens)
    cached = await engine.async_engine.call(lambda: engine.scheduler.kv.cached_len(key))
    return {"prompt_tokens": len(tokens), "cached_tokens": cached}


@router.get("/v1/cache")
@router.get("/cache")
async def cache_view(request: Request, cache_salt: str | None = None, model: str | None = None) -> dict:
    """What the caller's namespace holds in `?model=`'s cache (`?cache_salt=` names a salted one); the
    pool's counts are the whole model's, its streams of other namespaces show neither rows nor lengths."""
    if cache_salt is not None and not 1 <= len(cache_salt) <= MAX_CACHE_SALT:
        raise invalid(f"cache_salt: a salt has 1 to {MAX_CACHE_SALT} characters", "cache_salt")
    engine = await engine_for(request, model)
    pool = engine.pool
    namespace = request_namespace(tenant=tenant_of(request), cache_salt=cache_salt)

    def snapshot() -> dict:
        return {
            "page_rows": engine.settings.page_rows,
            **engine.cache.view(namespace),
            "pool": {"cells": pool.n_cells, "used_cells": pool.used_cells, "streams": pool.n_streams,
                     "free_streams": pool.free_streams, "inplace_reuses": pool.inplace_reuses,
                     "stream_cells": pool.n_ctx_seq, "stream_states": pool.stream_view(namespace)},
        }

    return await engine.async_engine.call(snapshot)

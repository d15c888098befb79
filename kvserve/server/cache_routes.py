"""Prefix-cache views: what a router asks each replica (`/v1/prefix/match`) and a dashboard's `/v1/cache`."""

from __future__ import annotations

from fastapi import APIRouter, Request

from kvserve.scheduler.engine import Engine
from kvserve.server import prompts

router = APIRouter()


@router.post("/v1/prefix/match")
@router.post("/prefix/match")
async def prefix_match(body: dict, request: Request) -> dict:
    engine: Engine = request.app.state.engine
    tokens = await prompts.body_prompt(engine.model, engine.template, body)
    cached = await engine.async_engine.call(lambda: engine.scheduler.kv.cached_len(tokens))
    return {"prompt_tokens": len(tokens), "cached_tokens": cached}


@router.get("/v1/cache")
@router.get("/cache")
async def cache_view(request: Request) -> dict:
    engine: Engine = request.app.state.engine
    pool = engine.pool

    def snapshot() -> dict:
        return {
            "page_rows": engine.settings.page_rows,
            **engine.cache.view(),
            "pool": {"cells": pool.n_cells, "used_cells": pool.used_cells, "streams": pool.n_streams,
                     "free_streams": pool.free_streams, "inplace_reuses": pool.inplace_reuses,
                     "stream_cells": pool.n_ctx_seq, "stream_states": pool.stream_view()},
        }

    return await engine.async_engine.call(snapshot)

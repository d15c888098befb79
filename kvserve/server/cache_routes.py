"""Prefix-cache views: what a router asks each replica (`/v1/prefix/match`) and a dashboard's `/v1/cache`."""

from __future__ import annotations

from fastapi import APIRouter, Request

from kvserve.cache.state_cache import StateCache
from kvserve.scheduler.engine import Engine
from kvserve.server import prompts

router = APIRouter()


@router.post("/v1/prefix/match")
@router.post("/prefix/match")
async def prefix_match(body: dict, request: Request) -> dict:
    engine: Engine = request.app.state.engine
    tokens = await prompts.body_prompt(engine.model, engine.template, body)
    cache = engine.pool.cache
    cached = await engine.async_engine.call(lambda: cache.match_len(tokens)) if cache is not None else 0
    return {"prompt_tokens": len(tokens), "cached_tokens": cached}


@router.get("/v1/cache")
@router.get("/cache")
async def cache_view(request: Request) -> dict:
    engine: Engine = request.app.state.engine
    pool = engine.pool

    def snapshot() -> dict:
        cache = pool.cache
        view = {
            "enabled": cache is not None,
            "page_rows": pool.page_rows,
            "held_pages": cache.held_pages if cache is not None else 0,
            "pool": {"cells": pool.n_cells, "used_cells": pool.used_cells, "free_seq_ids": pool.free_ids},
        }
        if isinstance(cache, StateCache):
            return {**view, "state_bytes": cache.bytes_used, "state_budget_bytes": cache.budget_bytes,
                    "checkpoints": cache.chain_list()}
        return {**view, "chains": cache.chain_list() if cache is not None else []}

    return await engine.async_engine.call(snapshot)

"""Prefix-cache views: what a router asks each replica (`/v1/prefix/match`) and a dashboard's `/v1/cache`."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request
from pydantic import ValidationError

from kvserve.cache.state_cache import StateCache
from kvserve.scheduler.engine import Engine
from kvserve.server import prompts
from kvserve.server.errors import invalid_body
from kvserve.server.schemas import ChatCompletionRequest, CompletionRequest

router = APIRouter()


async def _prompt_of(engine: Engine, body: dict) -> list[int]:
    """The tokens a chat or completion body would be served with, exactly as a real request."""
    try:
        if "messages" in body:
            chat = ChatCompletionRequest.model_validate(body)
            tokens, _ = await asyncio.to_thread(prompts.chat_prompt, engine.model, engine.template, chat)
            return tokens
        completion = CompletionRequest.model_validate(body)
        return await asyncio.to_thread(prompts.completion_prompt, engine.model, completion)
    except ValidationError as exc:
        raise invalid_body(exc.errors()) from exc


@router.post("/v1/prefix/match")
@router.post("/prefix/match")
async def prefix_match(body: dict, request: Request) -> dict:
    engine: Engine = request.app.state.engine
    tokens = await _prompt_of(engine, body)
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

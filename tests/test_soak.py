"""Soak: hundreds of concurrent requests over loopback, about 30% abandoned at random points, streamed
and whole. Afterwards nothing leaked: no live session, every sequence id not lent to the cache is
empty in llama.cpp, and the cells in use are exactly the cache's held pages."""

from __future__ import annotations

import asyncio
import json
import random
from collections import Counter

import httpx

from conftest import served
from test_hardening import engine_idle
from test_prefix_cache import PAGE, _cells_held_by_llama, _holder_seqs

N_REQUESTS = 520
CONCURRENCY = 32
CANCEL_SHARE = 0.3
PREFIXES = ["You are a helpful assistant. " * 6, "Answer in French, briefly. " * 5, "Summarize this: " * 4]


def _body(rng: random.Random, i: int) -> tuple[str, dict]:
    text = f"{rng.choice(PREFIXES)}question {i}: {rng.random()}"
    common = {"max_tokens": rng.randint(1, 24), "temperature": rng.choice([0, 0.8]), "stream": rng.random() < 0.5}
    if rng.random() < 0.5:
        return "/v1/chat/completions", {**common, "messages": [{"role": "user", "content": text}]}
    return "/v1/completions", {**common, "prompt": text}


async def _one(client: httpx.AsyncClient, rng: random.Random, i: int) -> str:
    """'ok', 'cancelled', or the failing status as text."""
    path, body = _body(rng, i)
    cancel = rng.random() < CANCEL_SHARE
    if not body["stream"]:
        work = client.post(path, json=body)
        if cancel:
            try:
                await asyncio.wait_for(work, timeout=rng.uniform(0.001, 0.2))
            except asyncio.TimeoutError:
                return "cancelled"
            return "ok"  # it finished before the client gave up
        response = await work
        return "ok" if response.status_code == 200 and response.json()["usage"] else str(response.status_code)
    stop_after = rng.randint(0, 3) if cancel else None
    async with client.stream("POST", path, json=body) as response:
        if response.status_code != 200:
            return str(response.status_code)
        seen = 0
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line.removeprefix("data: ")
            if data == "[DONE]":
                return "ok"
            if "error" in json.loads(data):
                return "stream error"
            seen += 1
            if stop_after is not None and seen > stop_after:
                return "cancelled"  # leaving the block closes the connection mid-stream
    return "stream cut"


def test_soak_leaks_nothing(tiny) -> None:
    with served(tiny("llama"), threads=1, parallel=8, ctx_size=2048, prefix_cache_cells=1024) as (url, app):
        async def soak() -> Counter[str]:
            rng = random.Random(7)
            gate = asyncio.Semaphore(CONCURRENCY)
            async with httpx.AsyncClient(base_url=url, timeout=60,
                                         limits=httpx.Limits(max_connections=CONCURRENCY * 2)) as client:
                async def bounded(i: int) -> str:
                    async with gate:
                        try:
                            return await asyncio.wait_for(_one(client, rng, i), timeout=120)
                        except asyncio.TimeoutError:
                            return "hung"
                return Counter(await asyncio.gather(*(bounded(i) for i in range(N_REQUESTS))))

        outcomes = asyncio.run(soak())
        print(f"\nsoak: {N_REQUESTS} requests, outcomes {dict(outcomes)}")
        assert set(outcomes) <= {"ok", "cancelled"}, outcomes
        assert outcomes["cancelled"] >= N_REQUESTS * CANCEL_SHARE / 2

        assert engine_idle(app)
        pool = app.state.engine.pool
        cache = pool.cache
        assert pool.sessions == []
        holders = _holder_seqs(pool)
        assert pool.free_ids == pool.ctx.n_seq_max - len(holders)
        assert all(pool.ctx.seq_pos_max(s) == -1 for s in range(pool.ctx.n_seq_max) if s not in holders)
        assert pool.used_cells == cache.held_pages * PAGE
        assert _cells_held_by_llama(pool, holders) == cache.held_pages * PAGE

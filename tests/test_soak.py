"""Soak: hundreds of concurrent requests over loopback, about 30% abandoned at random points, streamed
and whole. Afterwards nothing leaked: no live session, every stream holds in llama.cpp exactly the
rows it keeps for a next turn, no sampler chain is alive, and the cache is within its byte budget."""

from __future__ import annotations

import asyncio

from bench.soak import CANCEL_SHARE, soak
from conftest import served
from kvserve.llama.sampler import live_samplers
from test_hardening import engine_idle

N_REQUESTS = 520
CONCURRENCY = 32


def test_soak_leaks_nothing(tiny) -> None:
    with served(tiny("llama"), threads=1, parallel=8, ctx_size=2048, prefix_state_mb=1) as (url, app):
        outcomes = asyncio.run(soak(url, N_REQUESTS, CONCURRENCY, seed=7))
        print(f"\nsoak: {N_REQUESTS} requests, outcomes {dict(outcomes)}")
        assert set(outcomes) <= {"ok", "cancelled"}, outcomes
        assert outcomes["cancelled"] >= N_REQUESTS * CANCEL_SHARE / 2

        assert engine_idle(app)
        pool = app.state.models.only.pool
        cache = app.state.models.only.cache
        assert pool.sessions == []
        assert live_samplers() == 0
        assert pool.live_sessions == 0 and pool.free_streams == pool.n_streams
        for stream in pool.streams:
            assert pool.ctx.seq_pos_min(stream.seq) == (0 if stream.resident else -1)
            assert pool.ctx.seq_pos_max(stream.seq) == len(stream.resident) - 1
        assert 0 < cache.bytes_used <= cache.budget_bytes

"""Soak: hundreds of concurrent requests over loopback, about 30% abandoned at random points, streamed
and whole. Afterwards nothing leaked: no live session, every sequence id not lent to the cache is
empty in llama.cpp, no sampler chain is alive, and the cells in use are exactly the cache's held pages."""

from __future__ import annotations

import asyncio

from bench.soak import CANCEL_SHARE, soak
from conftest import served
from kvserve.llama.sampler import live_samplers
from test_hardening import engine_idle
from test_prefix_cache import PAGE, _cells_held_by_llama, _holder_seqs

N_REQUESTS = 520
CONCURRENCY = 32


def test_soak_leaks_nothing(tiny) -> None:
    with served(tiny("llama"), threads=1, parallel=8, ctx_size=2048, prefix_cache_cells=1024) as (url, app):
        outcomes = asyncio.run(soak(url, N_REQUESTS, CONCURRENCY, seed=7))
        print(f"\nsoak: {N_REQUESTS} requests, outcomes {dict(outcomes)}")
        assert set(outcomes) <= {"ok", "cancelled"}, outcomes
        assert outcomes["cancelled"] >= N_REQUESTS * CANCEL_SHARE / 2

        assert engine_idle(app)
        pool = app.state.engine.pool
        cache = app.state.engine.cache
        assert pool.sessions == []
        assert live_samplers() == 0
        holders = _holder_seqs(cache)
        assert pool.free_ids == pool.ctx.n_seq_max - len(holders)
        assert all(pool.ctx.seq_pos_max(s) == -1 for s in range(pool.ctx.n_seq_max) if s not in holders)
        assert pool.used_cells == cache.held_pages * PAGE
        assert _cells_held_by_llama(pool, holders) == cache.held_pages * PAGE

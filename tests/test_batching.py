"""Continuous batching must not change results: greedy output served among 8 concurrent requests of
different lengths equals greedy output of the same request served alone, from scratch.

On SmolLM2 the generations are kept short. llama.cpp's CPU attention sums over the KV cells in the
order they sit in the unified cache, and batching interleaves the cells of concurrent sequences;
after some tokens the rounding differs (logits move by ~1e-3 relative, amplified by 30 quantized
layers) and a near-tie can flip. Prefill and the first decode steps are bit-identical, which is
what catches real bugs: a wrong position, cell, mask or sequence id diverges at the first token.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import ARCHS, engine, greedy, run

PROMPTS = [
    "Hello",
    "The capital of France is",
    "Write a short poem about the sea and the wind, with rhymes.",
    "1, 2, 3, 4, 5,",
    "Once upon a time, in a land far away, there lived a dragon who loved to read books about",
    "Q: What is 2+2? A:",
    "def fibonacci(n):",
    "Translate to German: good morning, my friend. How have you been lately? " * 3,
]


def alone_and_together(model: Path, max_tokens: int, **overrides) -> tuple[list[list[int]], list[list[int]]]:
    with engine(model, **{"prefix_cache": False, **overrides}) as e:
        prompts = [e.model.tokenize(p, add_special=True) for p in PROMPTS]
        alone = []
        for i, prompt in enumerate(prompts):
            request = greedy(prompt, max_tokens=max_tokens + i % 3)
            alone.append(run(e, [request])[request.id])
        requests = [greedy(p, max_tokens=max_tokens + i % 3) for i, p in enumerate(prompts)]
        together = run(e, requests)
        return alone, [together[r.id] for r in requests]


@pytest.mark.parametrize("arch", ARCHS)
def test_tiny_models_batch_like_alone(tiny, arch: str) -> None:
    alone, together = alone_and_together(tiny(arch), max_tokens=24)
    assert all(len(tokens) >= 20 for tokens in alone)
    assert together == alone


def test_smollm2_batches_like_alone(smollm2: Path) -> None:
    alone, together = alone_and_together(smollm2, max_tokens=6)
    assert together == alone


@pytest.mark.parametrize("arch", ARCHS)
def test_small_token_budget_chunks_prompts_alongside_decodes(tiny, arch: str) -> None:
    """A 16-token budget forces long prompts through several prefill chunks next to running decodes,
    and a parallel limit of 3 makes requests wait and join between steps."""
    alone, together = alone_and_together(tiny(arch), max_tokens=20, batch_size=16, parallel=3)
    assert together == alone


@pytest.mark.parametrize("caching", [False, True], ids=["no-cache", "cache"])
def test_full_kv_cache_preempts_and_resumes_like_alone(tiny, caching: bool) -> None:
    """256 cells cannot hold 8 requests of ~60 tokens each: the newest running ones are sent back
    to the queue (cache pages go first) and resume where they stopped, with nothing lost."""
    with engine(tiny("llama"), prefix_cache=caching, ctx_size=256, prefix_cache_cells=64) as e:
        prompts = [e.model.tokenize(p, add_special=True)[:40] for p in PROMPTS]
        alone = []
        for prompt in prompts:
            request = greedy(prompt, max_tokens=30)
            alone.append(run(e, [request])[request.id])
        requests = [greedy(p, max_tokens=30) for p in prompts]
        together = run(e, requests)
        assert e.scheduler.preemptions > 0
        assert [together[r.id] for r in requests] == alone
        assert e.pool.sessions == []

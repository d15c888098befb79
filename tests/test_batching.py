"""Continuous batching must not change results: greedy output served among 8 concurrent requests of
different lengths equals greedy output of the same request served alone, from scratch."""

from __future__ import annotations

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


def _alone_then_together(model, tokenize_with, **overrides) -> tuple[list, list]:
    with engine(model, no_prefix_cache=True, **overrides) as e:
        prompts = [e.model.tokenize(p, add_special=True) for p in PROMPTS]
        alone = [run(e, [greedy(p, max_tokens=12 + i)])[0] if False else None for i, p in enumerate([])]
        alone = []
        for i, p in enumerate(prompts):
            request = greedy(p, max_tokens=12 + i)
            alone.append(run(e, [request])[request.id])
        requests = [greedy(p, max_tokens=12 + i) for i, p in enumerate(prompts)]
        together = run(e, requests)
        return alone, [together[r.id] for r in requests]


@pytest.mark.parametrize("arch", ARCHS)
def test_tiny_models_batch_like_alone(tiny, arch: str) -> None:
    alone, together = _alone_then_together(tiny(arch), None)
    assert all(alone), "every request generated tokens"
    assert together == alone


def test_smollm2_batches_like_alone(smollm2) -> None:
    alone, together = _alone_then_together(smollm2, None)
    assert together == alone


def test_small_token_budget_chunks_prompts_without_changing_output(smollm2) -> None:
    """A 40-token budget forces every long prompt through several prefill chunks alongside decodes."""
    alone, together = _alone_then_together(smollm2, None, batch_size=40, parallel=4)
    assert together == alone

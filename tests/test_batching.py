"""Continuous batching must not change results: what a request gets served among 8 concurrent
requests of different lengths equals what it gets served alone, from scratch, compared as
tests/equality.py says for each attention mode (strict token equality with `--flash-attn off` on
the tiny models).

On SmolLM2 the generations are kept short and compared within the tolerance in both modes: a
prompt batched with others is cut into other ubatch shapes than alone, its 30 quantized layers
round by shape even under plain attention, and a near-tie can flip. A wrong position, cell, mask or
sequence id moves logprobs far beyond that tolerance (tests/test_equality_catches_bugs.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import ARCHS, engine, run_traced
from equality import SMOLLM2_TOLERANCE, TINY_TOLERANCE, TOP, assert_like_alone
from kvserve.llama.context import Context, NoKvSlot
from kvserve.llama.sampler import SamplingParams, TokenLogprobs
from kvserve.scheduler.request import Request
from kvserve.scheduler.scheduler import Scheduler

MODES = ["off", "on"]  # --flash-attn

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


def traced(prompt: list[int], max_tokens: int) -> Request:
    return Request(id=f"{len(prompt)}-{max_tokens}-{id(prompt)}", prompt=prompt,
                   params=SamplingParams(temperature=0.0), max_tokens=max_tokens, logprobs=TOP)


# prompts of more than one flash-attention tile (64 tokens), that join while others decode
LONG_PROMPTS = [f"{p} Then the story goes on, and on, and on, for a while. " * 6 for p in PROMPTS]


def no_slot_every(e, n: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """From now on every `n`th llama_decode of the engine that carries several sequences finds no KV
    slot (and changes nothing). One carrying a single sequence always finds room: a request alone
    in a context without room ends with `length` (`BatchPlanner.shed_load`), so a fault that could
    hit it would cut whichever request happened to run last, as many steps in as drafts made."""
    calls = iter(range(1, 10**9))
    real_decode = e.pool.ctx.decode

    def decode(batch) -> None:
        several = len({batch.raw.seq_id[i][0] for i in range(batch.n_tokens)}) > 1
        if several and next(calls) % n == 0:
            raise NoKvSlot(1)
        real_decode(batch)

    monkeypatch.setattr(e.pool.ctx, "decode", decode)


def alone_and_together(model: Path, max_tokens: int, texts: list[str] = PROMPTS,
                       **overrides) -> tuple[list[list[TokenLogprobs]], ...]:
    with engine(model, **{"prefix_cache": False, **overrides}) as e:
        prompts = [e.model.tokenize(p, add_special=True) for p in texts]
        alone = []
        for i, prompt in enumerate(prompts):
            request = traced(prompt, max_tokens + i % 3)
            alone.append(run_traced(e, [request])[request.id])
        requests = [traced(p, max_tokens + i % 3) for i, p in enumerate(prompts)]
        together = run_traced(e, requests)
        return alone, [together[r.id] for r in requests]


def assert_all_like_alone(alone, together, flash_attn: str, tolerance: float = TINY_TOLERANCE) -> None:
    for a, t in zip(alone, together, strict=True):
        assert_like_alone(a, t, None if flash_attn == "off" else tolerance)


@pytest.mark.parametrize("flash_attn", MODES)
@pytest.mark.parametrize("arch", ARCHS)
def test_tiny_models_batch_like_alone(tiny, arch: str, flash_attn: str) -> None:
    alone, together = alone_and_together(tiny(arch), max_tokens=24, flash_attn=flash_attn)
    assert all(len(tokens) >= 20 for tokens in alone)
    assert_all_like_alone(alone, together, flash_attn)


@pytest.mark.parametrize("flash_attn", MODES)
def test_smollm2_batches_like_alone(smollm2: Path, flash_attn: str) -> None:
    """Within the tolerance in both modes: llama.cpp cuts a batch over several streams into ubatches
    of equal tokens per stream, so a prompt batched with others is evaluated in other shapes than
    alone, and SmolLM2's quantized layers round by shape even under plain attention (first-token
    logprobs up to 0.1 apart, measured); the tiny models stay token-equal."""
    alone, together = alone_and_together(smollm2, max_tokens=6, flash_attn=flash_attn)
    assert_all_like_alone(alone, together, "on", SMOLLM2_TOLERANCE)


@pytest.mark.parametrize("flash_attn", MODES)
@pytest.mark.parametrize("arch", ARCHS)
def test_small_token_budget_chunks_prompts_alongside_decodes(tiny, arch: str, flash_attn: str) -> None:
    """A 16-token budget forces long prompts through several prefill chunks next to running decodes,
    and a parallel limit of 3 makes requests wait and join between steps."""
    alone, together = alone_and_together(tiny(arch), max_tokens=20, batch_size=16, parallel=3, flash_attn=flash_attn)
    assert_all_like_alone(alone, together, flash_attn)


@pytest.mark.parametrize("arch", ARCHS)
def test_prompts_joining_decodes_in_one_call_like_alone(tiny, arch: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A step is one llama_decode, decodes and long prompt chunks together: each sequence has its own
    stream, and llama.cpp splits the batch by stream itself; a parallel limit of 3 makes long
    prompts join while others decode. Its tokens go in sequence-id order, for llama.cpp puts
    sequences into one ubatch only while their ids run consecutively."""
    calls_per_step: list[int] = []
    seq_orders: list[list[int]] = []
    real_step, real_decode = Scheduler.step, Context.decode

    def counting_step(self: Scheduler):
        calls_per_step.append(0)
        return real_step(self)

    def counting_decode(self: Context, batch) -> None:
        if not calls_per_step:  # the flash-attention self-check at load, before any step
            return real_decode(self, batch)
        calls_per_step[-1] += 1
        seq_orders.append([batch.raw.seq_id[i][0] for i in range(batch.n_tokens)])
        real_decode(self, batch)

    monkeypatch.setattr(Scheduler, "step", counting_step)
    monkeypatch.setattr(Context, "decode", counting_decode)
    alone, together = alone_and_together(tiny(arch), 16, LONG_PROMPTS, parallel=3, flash_attn="on")
    assert max(calls_per_step) == 1
    assert all(order == sorted(order) for order in seq_orders)
    assert any(len(set(order)) > 1 for order in seq_orders)  # steps did carry several sequences
    assert_all_like_alone(alone, together, "on")


@pytest.mark.parametrize("flash_attn", MODES)
@pytest.mark.parametrize("caching", [False, True], ids=["no-cache", "cache"])
def test_no_kv_slot_preempts_and_resumes_like_alone(tiny, caching: bool, flash_attn: str,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """When llama.cpp finds no KV slot for a step, the newest running requests are sent back to the
    queue and resume where they stopped (in place, with the cache on), with nothing lost."""
    with engine(tiny("llama"), prefix_cache=caching, ctx_size=256, flash_attn=flash_attn) as e:
        prompts = [e.model.tokenize(p, add_special=True)[:40] for p in PROMPTS]
        alone = []
        for prompt in prompts:
            request = traced(prompt, 30)
            alone.append(run_traced(e, [request])[request.id])
        no_slot_every(e, 7, monkeypatch)
        requests = [traced(p, 30) for p in prompts]
        together = run_traced(e, requests)
        assert e.scheduler.preemptions > 0
        assert not caching or e.pool.inplace_reuses >= e.scheduler.preemptions  # each resumed in its stream
        assert_all_like_alone(alone, [together[r.id] for r in requests], flash_attn)
        assert e.pool.sessions == []

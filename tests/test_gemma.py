"""Gemma 3 270M (sliding window 512, head size 256): the prefix cache answers as a server without it
and as llama.cpp with flash attention off, on a prefix over three windows long; and the start-up
check that keeps flash attention off where its few-row path is wrong for the model.

Flash attention's CPU kernel accumulates V in f16 for ubatches under 64 rows (see
kvserve/llama/attention_check.py), which moves Gemma 3's logprobs by up to 1-2 at an 1,800-token
prefix, so a cached prefix plus a short tail answered differently from the whole prompt.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import pytest

from conftest import serve
from kvserve.cache.chat_marks import mark_messages
from kvserve.cache.kv_pool import common_prefix
from kvserve.llama.chat_template import ChatTemplate
from kvserve.llama.attention_check import TOLERANCE, choose_flash_attn, probe_kl
from kvserve.llama.batch import Batch
from kvserve.llama.context import Context, ContextParams
from kvserve.llama.model import Model

PREFIX_TOKENS = 1800  # over three windows of 512
TAILS = ("\n\nQuestion: which of these", "\n\nSummary:", "\n\nThe last item above")
TOP = 5
BATCH = 2048  # the server's batch (its default); the reference decodes in the same calls
# The servers against llama.cpp evaluating the same tokens in the same calls with plain attention:
# identical (0.0). With flash attention on, as `auto` ran it before the start-up check, they were
# 0.10-0.31 apart on these prompts (its tiled path and its one-query path each differ from plain
# attention). Plain attention still rounds a little by batch shape: a cached prefix plus its tail
# against the whole prompt, 0.0 here and up to 0.11 on other prompts, so cache on vs off gets that
# at about twice.
LOGPROB_TOLERANCE = 0.01
SHAPE_TOLERANCE = 0.25


def _prefix_text() -> str:
    colours = ("red", "green", "blue", "amber", "violet", "grey", "white")
    lines = [f"Item {i}: a {colours[i % 7]} box holds {i * 37 % 101} marbles and {i * 13 % 17} keys."
             for i in range(400)]
    return "\n".join(lines)


@pytest.fixture(scope="module")
def gemma_model(gemma3: Path):
    model = Model(gemma3)
    yield model
    model.close()


@pytest.fixture(scope="module")
def prompts(gemma_model: Model) -> list[list[int]]:
    prefix = gemma_model.tokenize(_prefix_text(), add_special=True)[:PREFIX_TOKENS]
    assert len(prefix) == PREFIX_TOKENS
    return [prefix + gemma_model.tokenize(tail, add_special=False) for tail in TAILS]


def _reference(model: Model, prompt: list[int], cached: int) -> dict[str, float]:
    """The next token's top logprobs from llama.cpp with plain attention, evaluating `prompt[:cached]`
    and then the rest, each in calls of BATCH tokens, as the server does with `cached` tokens attached."""
    ctx = Context(model, ContextParams(n_ctx_seq=4096, n_batch=BATCH, n_seq_max=1, n_threads=2, flash_attn="off"))
    try:
        for start, end in _calls(cached, len(prompt)):
            batch = Batch(end - start)
            for pos in range(start, end):
                batch.add(prompt[pos], pos, 0, pos == len(prompt) - 1)
            ctx.decode(batch)
            batch.close()
        logits = ctx.logits(batch.n_tokens - 1).astype(np.float64)
    finally:
        ctx.close()
    logprobs = logits - logits.max() - np.log(np.exp(logits - logits.max()).sum())
    return {model.token_text(int(t)): float(logprobs[t]) for t in np.argsort(-logprobs)[:TOP]}


def _calls(cached: int, n: int) -> list[tuple[int, int]]:
    bounds = [*range(0, cached, BATCH), *range(cached, n, BATCH), n]
    return list(zip(bounds, bounds[1:]))


def _served(url: str, prompts: list[list[int]]) -> list[tuple[dict[str, float], int]]:
    """Each prompt's first-token top logprobs (by token text) and cached prompt tokens, one after another."""
    out = []
    for prompt in prompts:
        body = {"prompt": prompt, "max_tokens": 1, "temperature": 0, "logprobs": TOP}
        response = httpx.post(f"{url}/v1/completions", json=body, timeout=600)
        assert response.status_code == 200, response.text
        reply = response.json()
        top = reply["choices"][0]["logprobs"]["top_logprobs"][0]
        out.append((top, reply["usage"]["prompt_tokens_details"]["cached_tokens"]))
    return out


def _assert_close(got: dict[str, float], want: dict[str, float], tolerance: float, what: str) -> None:
    assert next(iter(got)) == next(iter(want)), f"{what}: first token {next(iter(got))!r} vs {next(iter(want))!r}"
    shared = set(got) & set(want)
    assert len(shared) >= TOP - 1, f"{what}: top logprobs {got} vs {want}"
    worst = max(shared, key=lambda text: abs(got[text] - want[text]))
    assert abs(got[worst] - want[worst]) <= tolerance, f"{what}: {worst!r} {got[worst]:.4f} vs {want[worst]:.4f}"


def test_cached_prefix_answers_as_llama_cpp_without_flash_attention(gemma3: Path, gemma_model: Model,
                                                                    prompts: list[list[int]]) -> None:
    with serve(gemma3, ctx_size=8192, batch_size=BATCH) as url:  # --flash-attn auto, prefix cache on
        attention = httpx.get(f"{url}/server_info").json()["flash_attn"]
        cached = _served(url, prompts)
    with serve(gemma3, ctx_size=8192, batch_size=BATCH, prefix_cache=False) as url:
        alone = _served(url, prompts)
    # The later prompts continue the first's stream in place (cut back to the shared prefix, whose
    # window the stream still holds); what must hold, however much is kept, is the equality below.
    for i, (prompt, (on, hit), (off, _)) in enumerate(zip(prompts, cached, alone)):
        whole = _reference(gemma_model, prompt, 0)
        _assert_close(off, whole, LOGPROB_TOLERANCE, f"tail {i}, no prefix cache")
        split = _reference(gemma_model, prompt, hit) if hit else whole
        _assert_close(on, split, LOGPROB_TOLERANCE, f"tail {i}, {hit} tokens cached")
        _assert_close(on, off, SHAPE_TOLERANCE, f"tail {i}, prefix cache vs none")
    assert attention["enabled"] is False and "self-check failed" in attention["reason"], attention


def test_auto_turns_flash_attention_off_for_gemma3(gemma_model: Model) -> None:
    kl = probe_kl(gemma_model, "on", 2)
    assert kl is not None and kl > 1.5 * TOLERANCE  # measured 0.034
    choice = choose_flash_attn(gemma_model, "auto", 2)
    assert not choice.enabled and "self-check failed" in choice.reason
    forced = choose_flash_attn(gemma_model, "on", 2)
    assert forced.enabled and "although" in forced.reason
    assert not choose_flash_attn(gemma_model, "off", 2).enabled


def test_flash_attention_passes_the_check_on_smollm2_and_tiny_models(smollm2: Path, tiny) -> None:
    for path in (smollm2, tiny("llama")):
        model = Model(path)
        try:
            kl = probe_kl(model, "on", 2)
        finally:
            model.close()
        assert kl is not None and kl <= TOLERANCE / 1.5, path  # measured 0.007 and under 0.001


# -- many conversations on one long system prompt --------------------------------------------------

QUESTIONS = ("Which box holds the most marbles?", "How many keys are in the red boxes?",
             "Name a violet box with more than fifty marbles.", "Is there a white box without keys?",
             "What colour is item 12?", "Count the amber boxes.", "Which item comes after item 300?",
             "Do green boxes hold more keys than blue ones?")
SYSTEM_TOKENS = 1800  # over three windows of 512
# cache on vs off, first token's top logprobs: a cached prefix (in place or attached) plus its tail is
# evaluated in other shapes than the whole prompt, and Gemma 3 amplifies the rounding. Measured over
# these 16 comparisons: at most 0.217; one near-tie flipped (the cache-off run's best two 0.009
# apart, 'What' -1.095 and 'Item' -1.104), as the equality contract allows (tests/equality.py): the
# first token is exact unless the cache-off run's best two are within twice the tolerance.
CONVERSATION_TOLERANCE = 0.3


def _system_prompt(model: Model) -> str:
    lines = _prefix_text().split("\n")
    text = ""
    for line in lines:
        text += line + "\n"
        if len(model.tokenize(text, add_special=False)) >= SYSTEM_TOKENS:
            return text
    raise AssertionError("the prefix text is too short")


def _conversation(system: str, question: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": system}, {"role": "user", "content": question}]


def _first_token(url: str, messages: list[dict[str, str]]) -> tuple[dict[str, float], int]:
    body = {"messages": messages, "max_tokens": 1, "temperature": 0, "logprobs": True, "top_logprobs": TOP}
    response = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=900)
    assert response.status_code == 200, response.text
    reply = response.json()
    top = reply["choices"][0]["logprobs"]["content"][0]["top_logprobs"]
    return {t["token"]: t["logprob"] for t in top}, reply["usage"]["prompt_tokens_details"]["cached_tokens"]


def _together(url: str, conversations: list[list[dict[str, str]]]) -> list[tuple[dict[str, float], int]]:
    with ThreadPoolExecutor(len(conversations)) as pool:
        return list(pool.map(lambda messages: _first_token(url, messages), conversations))


def _attached(served: list[tuple[dict[str, float], int]], prompts: list[list[int]], together: bool) -> list[float]:
    """After the first, what each attached of what it shares with the others: one after another,
    with those before it; together, with any other, and the first is whichever computed it."""
    fractions = []
    for i, (prompt, (_, hit)) in enumerate(zip(prompts, served)):
        others = [q for j, q in enumerate(prompts) if j != i and (together or j < i)]
        if others:
            fractions.append(hit / max(common_prefix(prompt, q) for q in others))
    return sorted(fractions)[1:] if together else fractions


def _assert_near_tie_or_close(on: dict[str, float], off: dict[str, float], what: str) -> None:
    """The first token as with the cache off, unless that run's best two are a near-tie and the cache
    chose the other; the top logprobs within CONVERSATION_TOLERANCE either way."""
    best, runner_up = list(off)[:2]
    if next(iter(on)) == runner_up and off[best] - off[runner_up] <= 2 * CONVERSATION_TOLERANCE:
        print(f"{what}: near-tie {best!r} {off[best]:.3f} / {runner_up!r} {off[runner_up]:.3f} flipped")
        on = {best: on[best], **on}  # compare the rest as if the tie had gone the same way
    _assert_close(on, off, CONVERSATION_TOLERANCE, what)


@pytest.mark.slow
def test_conversations_on_one_system_prompt_attach_it(gemma3: Path, gemma_model: Model) -> None:
    """8 conversations on one 1,800-token system prompt (over three windows): after the first, each
    attaches at least 90% of what it shares with those before it, one after another (in place: the
    stream the last one left is cut back) and all at once (in other streams: the pages and window
    kept at the first one's opening), and answers as with the cache off."""
    system = _system_prompt(gemma_model)
    template = ChatTemplate.from_model(gemma_model)
    conversations = [_conversation(system, q) for q in QUESTIONS]
    prompts = [mark_messages(gemma_model, template, c).tokens for c in conversations]
    assert min(common_prefix(prompts[0], q) for q in prompts[1:]) > SYSTEM_TOKENS
    options = dict(ctx_size=2560, batch_size=BATCH)
    with serve(gemma3, prefix_cache=False, **options) as url:
        alone = [_first_token(url, c) for c in conversations]
    with serve(gemma3, **options) as url:
        in_turn = [_first_token(url, c) for c in conversations]
    with serve(gemma3, **options) as url:
        at_once = _together(url, conversations)
        cache = httpx.get(f"{url}/v1/cache").json()
    print(f"window rows kept: {cache['window_bytes']} bytes; held {cache['held_bytes']} of {cache['budget_bytes']}")
    for name, served in (("one after another", in_turn), ("together", at_once)):
        attached = _attached(served, prompts, together=served is at_once)
        drift = [max(abs(on[t] - off[t]) for t in set(on) & set(off)) for (on, _), (off, _) in zip(served, alone)]
        print(f"{name}: attached {[f'{a:.1%}' for a in attached]} of the shared prefix; "
              f"top-{TOP} logprobs vs cache off at most {[f'{d:.3f}' for d in drift]}")
    for name, served in (("one after another", in_turn), ("together", at_once)):
        attached = _attached(served, prompts, together=served is at_once)
        assert min(attached) >= 0.9, (name, attached)
        for i, ((on, _), (off, _)) in enumerate(zip(served, alone)):
            _assert_near_tie_or_close(on, off, f"{name}, conversation {i}")
    assert 0 < cache["window_bytes"] and cache["held_bytes"] <= cache["budget_bytes"]

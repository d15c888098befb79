"""The OpenAI surface end to end: the official `openai` client (sync and async) and raw `httpx`
against one real kvserve serving SmolLM2, started once for the module.

Greedy outputs are compared across requests (streamed against whole, batched against alone). Those
requests put their tokens in different KV cells (the second one attaches its prompt from the prefix
cache; concurrent ones interleave), and llama.cpp's CPU arithmetic depends on where cells sit: a
prompt whose cells follow another sequence's gets first-token logprobs up to ~0.1 off the ones it
gets alone (what the other sequence holds does not matter, only where the cells are). So
generations stay short, and every greedy prompt here was picked for a margin of at least ~0.4 nats
between the best and the second-best token at each step it generates.
"""

from __future__ import annotations

import asyncio
import json
from typing import Iterator

import httpx
import openai
import pytest

from kvserve.testing import read_metrics, wait_until

MODEL = "smollm2"  # kvserve serves one model and ignores the name a client asks for
MATH = [{"role": "user", "content": "What is 2+2?"}]  # "The answer to this classic math problem is 4."
GERMANY = "The capital of Germany is"


@pytest.fixture(scope="module")
def client(base_url: str) -> Iterator[openai.OpenAI]:
    # No retries: a 5xx or a dropped connection must fail the test, not be papered over.
    with openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=120) as c:
        yield c


def chat_text(client: openai.OpenAI, messages: list[dict], **kwargs) -> tuple[str, str]:
    """(content, finish_reason) of a whole greedy chat completion."""
    r = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, **kwargs)
    return r.choices[0].message.content, r.choices[0].finish_reason


def chat_stream(client: openai.OpenAI, messages: list[dict], **kwargs) -> list:
    return list(client.chat.completions.create(model=MODEL, messages=messages, temperature=0, stream=True, **kwargs))


def metric(base_url: str, name: str, **labels: str) -> float:
    """One sample of /metrics, read now."""
    return read_metrics(base_url).value(name, **labels)


def streamed_text(chunks: list, index: int = 0) -> tuple[list[str], str | None]:
    """(text pieces, finish_reason) of one choice of a chat stream."""
    pieces, reason = [], None
    for chunk in chunks:
        for choice in chunk.choices:
            if choice.index == index:
                pieces += [choice.delta.content] if choice.delta.content else []
                reason = choice.finish_reason or reason
    return pieces, reason


# --- chat and text completions -------------------------------------------------------------------


def test_chat_completion_whole(client: openai.OpenAI, base_url: str) -> None:
    match = httpx.post(f"{base_url}/v1/prefix/match", json={"messages": MATH}).json()
    r = client.chat.completions.create(model=MODEL, messages=MATH, temperature=0, max_tokens=16)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    assert [c.index for c in r.choices] == [0]
    choice = r.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content.strip()
    assert choice.finish_reason in {"stop", "length"}
    u = r.usage
    assert u.prompt_tokens > 0 and 0 < u.completion_tokens <= 16
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens
    # the prefix the cache attached, as /v1/prefix/match predicted it
    assert u.prompt_tokens == match["prompt_tokens"]
    assert u.prompt_tokens_details.cached_tokens == match["cached_tokens"] < u.prompt_tokens


def test_chat_stream_equals_whole(client: openai.OpenAI) -> None:
    whole = client.chat.completions.create(model=MODEL, messages=MATH, temperature=0, max_tokens=16)
    chunks = chat_stream(client, MATH, max_tokens=16, stream_options={"include_usage": True})

    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    pieces, reason = streamed_text(chunks)
    assert "".join(pieces) == whole.choices[0].message.content
    assert reason == whole.choices[0].finish_reason
    assert sum(1 for c in chunks for ch in c.choices if ch.finish_reason) == 1

    # include_usage: usage only on a last, choice-less chunk
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None
    assert all(c.usage is None for c in chunks[:-1])
    assert last.usage.completion_tokens == whole.usage.completion_tokens
    assert last.usage.prompt_tokens == whole.usage.prompt_tokens
    # The same prompt again: its full pages come from the prefix cache.
    assert 0 < last.usage.prompt_tokens_details.cached_tokens < last.usage.prompt_tokens


def test_chat_stream_with_continuous_usage_counts_every_chunk(client: openai.OpenAI) -> None:
    """vLLM's `continuous_usage_stats`: every chunk carries the usage so far, which ends at the
    last chunk's usage; without include_usage it adds nothing."""
    whole = client.chat.completions.create(model=MODEL, messages=MATH, temperature=0, max_tokens=16)
    chunks = chat_stream(client, MATH, max_tokens=16,
                         stream_options={"include_usage": True, "continuous_usage_stats": True})
    assert all(c.usage is not None and c.usage.prompt_tokens == whole.usage.prompt_tokens for c in chunks)
    counts = [c.usage.completion_tokens for c in chunks if c.choices]  # not the last, usage-only chunk
    assert counts[0] == 0 and counts == sorted(counts) and counts[-1] == whole.usage.completion_tokens
    assert all(c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens for c in chunks)
    pieces, _ = streamed_text(chunks)
    assert "".join(pieces) == whole.choices[0].message.content
    ignored = chat_stream(client, MATH, max_tokens=4, stream_options={"continuous_usage_stats": True})
    assert all(c.usage is None for c in ignored)


def test_chat_stream_without_include_usage_has_no_usage(client: openai.OpenAI) -> None:
    chunks = chat_stream(client, MATH, max_tokens=4)
    assert chunks[-1].choices and chunks[-1].choices[0].finish_reason == "length"
    assert all(c.usage is None for c in chunks)


def test_text_completion_stream_equals_whole(client: openai.OpenAI, base_url: str) -> None:
    kwargs = dict(model=MODEL, prompt=GERMANY, temperature=0, max_tokens=6)
    match = httpx.post(f"{base_url}/v1/prefix/match", json={"prompt": GERMANY}).json()
    whole = client.completions.create(**kwargs)
    assert whole.object == "text_completion" and whole.id.startswith("cmpl-")
    text = whole.choices[0].text
    assert text.strip() and whole.choices[0].finish_reason in {"stop", "length"}
    assert 0 < whole.usage.completion_tokens <= 6
    assert whole.usage.prompt_tokens == match["prompt_tokens"]
    assert whole.usage.prompt_tokens_details.cached_tokens == match["cached_tokens"]

    chunks = list(client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    assert all(c.object == "text_completion" for c in chunks)
    texts = [c.choices[0].text for c in chunks if c.choices]
    assert "".join(texts) == text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_n_choices(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model=MODEL, messages=MATH, temperature=0, max_tokens=8, n=2)
    assert [c.index for c in r.choices] == [0, 1]
    texts = [c.message.content for c in r.choices]
    assert texts[0].strip() and texts[0] == texts[1]  # greedy: both choices are the same continuation
    assert r.usage.completion_tokens == 16  # usage counts every choice's tokens

    chunks = chat_stream(client, MATH, max_tokens=8, n=2)
    roles = [ch.index for c in chunks for ch in c.choices if ch.delta.role == "assistant"]
    assert sorted(roles) == [0, 1]
    for index in (0, 1):
        pieces, reason = streamed_text(chunks, index)
        assert "".join(pieces) == texts[index] and reason == "length"


# --- stop strings --------------------------------------------------------------------------------


def _stops(full: str) -> list[tuple[str, str]]:
    """(stop, expected output) pairs cut from a greedy output `full`."""
    words = full.split()
    middle = words[len(words) // 2]
    two = " ".join(words[len(words) // 2 : len(words) // 2 + 2])  # spans a token boundary
    return [(middle, full[: full.index(middle)]), (two, full[: full.index(two)])]


@pytest.mark.parametrize("which", [0, 1], ids=["word", "two-words"])
def test_stop_string_cuts_before_first_occurrence(client: openai.OpenAI, which: int) -> None:
    full, _ = chat_text(client, MATH, max_tokens=16)
    assert len(full.split()) >= 6, full
    stop, expected = _stops(full)[which]
    assert expected.strip(), "the stop must fall in the middle of the output"

    assert chat_text(client, MATH, max_tokens=16, stop=[stop]) == (expected, "stop")

    chunks = chat_stream(client, MATH, max_tokens=16, stop=stop)  # a bare string is one stop
    pieces, reason = streamed_text(chunks)
    assert not any(stop in p for p in pieces)
    assert ("".join(pieces), reason) == (expected, "stop")


@pytest.mark.parametrize("max_tokens", [8, 16], ids=["length", "eos"])
def test_stop_prefix_held_back_is_flushed_at_the_end(client: openai.OpenAI, max_tokens: int) -> None:
    """A stop that the output's tail begins but never completes: the held-back tail still arrives,
    whether the output ends at the token limit or at end-of-sequence."""
    full, reason = chat_text(client, MATH, max_tokens=max_tokens)
    assert reason == ("length" if max_tokens == 8 else "stop")
    stop = full[-3:] + "\u00a7never"
    assert chat_text(client, MATH, max_tokens=max_tokens, stop=[stop]) == (full, reason)
    pieces, streamed_reason = streamed_text(chat_stream(client, MATH, max_tokens=max_tokens, stop=[stop]))
    assert ("".join(pieces), streamed_reason) == (full, reason)


# --- logprobs ------------------------------------------------------------------------------------


def test_chat_logprobs(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model=MODEL, messages=MATH, temperature=0, max_tokens=6, logprobs=True, top_logprobs=3
    )
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 6
    for item in content:
        assert isinstance(item.token, str) and item.logprob <= 0
        assert len(item.top_logprobs) == 3
        tops = [t.logprob for t in item.top_logprobs]
        assert tops == sorted(tops, reverse=True) and all(lp <= 0 for lp in tops)
        # greedy picked the most likely token
        assert (item.top_logprobs[0].token, item.top_logprobs[0].logprob) == (item.token, item.logprob)
    assert b"".join(bytes(i.bytes) for i in content).decode() == r.choices[0].message.content


def test_completion_logprobs_whole_and_streamed(client: openai.OpenAI) -> None:
    kwargs = dict(model=MODEL, prompt=GERMANY, temperature=0, max_tokens=6, logprobs=2)
    whole = client.completions.create(**kwargs)
    text, lp = whole.choices[0].text, whole.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    assert "".join(lp.tokens) == text
    assert lp.text_offset == [len("".join(lp.tokens[:i])) for i in range(6)]
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert logprob <= 0 and len(top) == 2
        assert max(top.values()) == logprob and top[token] == logprob

    chunks = [c.choices[0] for c in client.completions.create(**kwargs, stream=True)]
    assert [t for c in chunks for t in c.logprobs.tokens] == lp.tokens
    assert [x for c in chunks for x in c.logprobs.token_logprobs] == lp.token_logprobs
    assert [x for c in chunks for x in c.logprobs.text_offset] == lp.text_offset


def test_completion_text_offsets_count_characters(client: openai.OpenAI) -> None:
    """Tokens that each hold part of a character: offsets stay inside the text, whole or streamed."""
    prompt = "English: hello\nJapanese: こんにちは\nEnglish: hello\nJapanese:"
    kwargs = dict(model=MODEL, prompt=prompt, temperature=0, max_tokens=6, logprobs=0)
    whole = client.completions.create(**kwargs).choices[0]
    text, offsets = whole.text, whole.logprobs.text_offset
    assert len(text) < len(offsets) == 6, "no character spanned tokens: the test proves nothing"
    assert offsets[0] == 0 and offsets == sorted(offsets) and offsets[-1] < len(text)

    chunks = [c.choices[0] for c in client.completions.create(**kwargs, stream=True)]
    assert "".join(c.text for c in chunks) == text
    assert [x for c in chunks for x in c.logprobs.text_offset] == offsets


# 'In English, "你好" is a': 你 and 好 each come as two tokens, the first of them two bytes of three
CHINESE = [{"role": "user", "content": "What is 你好 in English?"}]


def test_chat_logprobs_of_split_characters_are_their_own_bytes(client: openai.OpenAI) -> None:
    """`bytes` join into the reply's text, whole and streamed; `token` writes the part of a
    character as OpenAI does ("\\xe4\\xbd"): U+FFFD, with U+FFFD's bytes, said nothing."""
    kwargs = dict(model=MODEL, messages=CHINESE, temperature=0, max_tokens=10, logprobs=True, top_logprobs=2)
    r = client.chat.completions.create(**kwargs)
    text, content = r.choices[0].message.content, r.choices[0].logprobs.content
    assert "你好" in text
    assert b"".join(bytes(i.bytes) for i in content).decode() == text
    assert [i.token for i in content][4:8] == ["\\xe4\\xbd", "\\xa0", "\\xe5\\xa5", "\\xbd"]
    for item in [*content, *(t for i in content for t in i.top_logprobs)]:
        assert item.token == bytes(item.bytes).decode(errors="backslashreplace") and "\ufffd" not in item.token
    streamed = [i for chunk in client.chat.completions.create(**kwargs, stream=True) if chunk.choices
                for i in (chunk.choices[0].logprobs.content if chunk.choices[0].logprobs else [])]
    assert [(i.token, i.bytes) for i in streamed] == [(i.token, i.bytes) for i in content]


def test_completion_logprobs_of_split_characters_name_their_bytes(client: openai.OpenAI) -> None:
    """Legacy completions write the part of a character as OpenAI's do, "bytes:\\xe3\\x81"; each is
    its own key of `top_logprobs` (as U+FFFD, two partial tokens were one key, one logprob lost)."""
    prompt = "English: hello\nJapanese: こんにちは\nEnglish: hello\nJapanese:"
    kwargs = dict(model=MODEL, prompt=prompt, temperature=0, max_tokens=6, logprobs=3)
    lp = client.completions.create(**kwargs).choices[0].logprobs
    assert any(t.startswith("bytes:\\x") for t in lp.tokens), lp.tokens
    assert not any("\ufffd" in t for t in [*lp.tokens, *(k for top in lp.top_logprobs for k in top)])
    assert all(len(top) == 3 for top in lp.top_logprobs)
    chunks = [c.choices[0] for c in client.completions.create(**kwargs, stream=True)]
    assert [t for c in chunks for t in c.logprobs.tokens] == lp.tokens


# --- structured output ---------------------------------------------------------------------------


def test_json_object(client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "Reply with a JSON object with keys name and age for a person."}]
    text, reason = chat_text(client, messages, max_tokens=200, response_format={"type": "json_object"})
    assert reason == "stop", f"the object was not closed within 200 tokens: {text!r}"
    assert isinstance(json.loads(text), dict)


def test_json_schema(client: openai.OpenAI) -> None:
    schema = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "cat", "schema": schema}}
    messages = [{"role": "user", "content": "Give a name for a cat as JSON."}]
    text, reason = chat_text(client, messages, max_tokens=60, response_format=fmt)
    assert reason == "stop", text
    value = json.loads(text)
    assert isinstance(value, dict) and isinstance(value["name"], str)


# --- UTF-8 ---------------------------------------------------------------------------------------


def test_utf8_stream_never_splits_a_character(client: openai.OpenAI) -> None:
    """SmolLM2 writes most Japanese characters as two or three byte-level tokens each. (12 tokens end
    on a character boundary here; a limit that cut a character would rightly end in U+FFFD.)"""
    messages = [{"role": "user", "content": "Say こんにちは."}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=12)
    text = whole.choices[0].message.content
    assert any(ord(ch) > 0x7F for ch in text) and "\ufffd" not in text
    pieces, _ = streamed_text(chat_stream(client, messages, max_tokens=12))
    assert not any("\ufffd" in p for p in pieces)
    assert "".join(pieces) == text
    assert len(pieces) < whole.usage.completion_tokens, "no character spanned tokens: the test proves nothing"


# --- many clients at once ------------------------------------------------------------------------

PROMPTS = [
    GERMANY,
    "A short poem about the sea and the wind:\n",
    "1, 2, 3, 4, 5,",
    "Q: What is 2+2? A:",
    "a b c d e f g",
    "The largest planet in our solar system is",
    "10, 20, 30, 40,",
    ", ".join(str(i) for i in range(1, 31)) + ",",  # 110 tokens: prefilled next to the others' decodes
]


async def _streamed_completion(c: openai.AsyncOpenAI, prompt: str) -> tuple[str, str]:
    stream = await c.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=6, stream=True)
    text, reason = "", None
    async for chunk in stream:
        text += chunk.choices[0].text
        reason = chunk.choices[0].finish_reason or reason
    return text, reason


async def _all_prompts(base_url: str, at_once: bool) -> list[tuple[str, str]]:
    async with openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=120) as c:
        if at_once:
            return list(await asyncio.gather(*(_streamed_completion(c, p) for p in PROMPTS)))
        return [await _streamed_completion(c, p) for p in PROMPTS]


def test_concurrent_streams_equal_alone(base_url: str) -> None:
    steps = [metric(base_url, "kvserve_engine_steps_total")]
    alone = asyncio.run(_all_prompts(base_url, at_once=False))
    steps.append(metric(base_url, "kvserve_engine_steps_total"))
    together = asyncio.run(_all_prompts(base_url, at_once=True))
    steps.append(metric(base_url, "kvserve_engine_steps_total"))

    assert all(text and reason in {"stop", "length"} for text, reason in alone), alone
    assert together == alone
    # They really ran together: one after another takes 8 x (prefill + 5 decodes) steps.
    assert steps[2] - steps[1] < (steps[1] - steps[0]) / 2, steps


def test_a_seed_gives_n_different_choices_each_reproducible(client: openai.OpenAI) -> None:
    """As OpenAI's API: a seed makes the answer reproducible, not its n choices identical; choice 0
    is what n = 1 gives with that seed."""
    def texts(n: int) -> list[str]:
        r = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=8, temperature=1.0,
                                      seed=7, n=n)
        return [c.text for c in sorted(r.choices, key=lambda c: c.index)]
    three = texts(3)
    assert len(set(three)) == 3, three
    assert texts(3) == three
    assert texts(1) == three[:1]


def test_a_vanishing_temperature_is_greedy(client: openai.OpenAI) -> None:
    """1e-38 divides logits past float's range: sampled, every token came out the vocabulary's last."""
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    def content(temperature: float) -> str:
        r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=temperature)
        return r.choices[0].message.content
    assert content(1e-38) == content(0)


def test_null_fields_take_their_defaults(client: openai.OpenAI) -> None:
    """Wrappers pass unset knobs through as None, which the SDK sends as null: each is its default."""
    r = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=3, temperature=None, top_p=None,
                                       n=None, presence_penalty=None, frequency_penalty=None, logprobs=None,
                                       stream=None)
    assert r.choices[0].finish_reason in {"stop", "length"} and r.choices[0].logprobs is None
    c = client.completions.create(model=MODEL, prompt="hi", max_tokens=None, temperature=None, echo=None)
    assert c.usage.completion_tokens <= 16  # OpenAI's default max_tokens for completions
    response = client.responses.create(model=MODEL, input="hi", max_output_tokens=3, store=None,
                                       parallel_tool_calls=None, temperature=None)
    assert response.status in {"completed", "incomplete"}


# --- errors --------------------------------------------------------------------------------------

HI = [{"role": "user", "content": "hi"}]
BAD_CHAT = {
    "messages-string": ({"messages": "hi"}, "messages"),
    "messages-missing": ({}, "messages"),
    "messages-empty": ({"messages": []}, "messages"),
    "temperature-string": ({"messages": HI, "temperature": "hot"}, "temperature"),
    "temperature-negative": ({"messages": HI, "temperature": -1}, "temperature"),
    "max_tokens-negative": ({"messages": HI, "max_tokens": -5}, "max_tokens"),
    "max_tokens-zero": ({"messages": HI, "max_tokens": 0}, "max_tokens"),
    "unknown-role": ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
    "top_logprobs-21": ({"messages": HI, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    "top_logprobs-without-logprobs": ({"messages": HI, "top_logprobs": 2}, "top_logprobs"),
    "n-17": ({"messages": HI, "n": 17}, "n"),
    "logit_bias-key": ({"messages": HI, "logit_bias": {"hello": 5}}, "logit_bias"),
    "logit_bias-token": ({"messages": HI, "logit_bias": {"99999999": 5}}, "logit_bias"),
    "json_schema-missing": ({"messages": HI, "response_format": {"type": "json_schema"}}, "response_format"),
}


def assert_openai_error(response: httpx.Response, param: str | None, status: int = 400) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param
    return error


@pytest.mark.parametrize("body,param", BAD_CHAT.values(), ids=BAD_CHAT.keys())
def test_bad_chat_request(base_url: str, body: dict, param: str) -> None:
    assert_openai_error(httpx.post(f"{base_url}/v1/chat/completions", json=body, timeout=30), param)


@pytest.mark.parametrize("body,param", [
    ({"prompt": ""}, "prompt"),
    ({"prompt": [10**9]}, "prompt"),
    ({"prompt": "hi", "logprobs": 21}, "logprobs"),
    ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
], ids=["empty", "token-id", "logprobs-21", "max_tokens-zero"])
def test_bad_completion_request(base_url: str, body: dict, param: str) -> None:
    assert_openai_error(httpx.post(f"{base_url}/v1/completions", json=body, timeout=30), param)


def test_echo_is_refused_rather_than_ignored(base_url: str) -> None:
    response = httpx.post(f"{base_url}/v1/completions", json={"prompt": "hi", "echo": True}, timeout=30)
    assert_openai_error(response, "echo")


@pytest.mark.parametrize("route,body,param", [
    ("/v1/completions", {"prompt": "def f(", "suffix": "    return x"}, "suffix"),
    ("/v1/completions", {"prompt": "hi", "best_of": 3}, "best_of"),
    ("/v1/chat/completions", {"messages": HI, "guided_json": {"type": "object"}}, "guided_json"),
    ("/v1/chat/completions", {"messages": HI, "grammar": 'root ::= "yes" | "no"'}, "grammar"),
    ("/v1/chat/completions", {"messages": HI, "repetition_penalty": 1.3}, "repetition_penalty"),
    ("/v1/chat/completions", {"messages": HI, "min_tokens": 5}, "min_tokens"),
    ("/v1/chat/completions", {"messages": HI, "skip_special_tokens": False}, "skip_special_tokens"),
], ids=["suffix", "best_of", "guided_json", "grammar", "repetition_penalty", "min_tokens", "skip_special_tokens"])
def test_other_servers_parameters_that_change_the_output_are_refused(base_url: str, route: str, body: dict,
                                                                      param: str) -> None:
    """vLLM's and llama-server's extensions kvserve does not serve: a 400 that says what to send
    instead, never an answer that ignored them."""
    error = assert_openai_error(httpx.post(f"{base_url}{route}", json=body, timeout=30), param)
    assert "not supported" in error["message"], error


def test_other_servers_parameters_at_their_no_op_values_are_accepted(base_url: str) -> None:
    """Clients that send a full set of knobs at their defaults are served."""
    body = {"messages": HI, "max_tokens": 2, "best_of": 1, "typical_p": 1.0, "repetition_penalty": 1,
            "skip_special_tokens": True, "min_tokens": 0, "mirostat": 0, "suffix": None, "grammar": ""}
    response = httpx.post(f"{base_url}/v1/chat/completions", json=body, timeout=30)
    assert response.status_code == 200, response.text


def test_malformed_json(base_url: str) -> None:
    response = httpx.post(
        f"{base_url}/v1/chat/completions", content=b'{"messages": [{"role": "user", "content": "hi"',
        headers={"content-type": "application/json"}, timeout=30,
    )
    assert "JSON" in assert_openai_error(response, None)["message"]


def test_prompt_longer_than_a_sequence(base_url: str) -> None:
    """OpenAI's code and wording, which LiteLLM and LangChain match to trim the history and retry."""
    limit = httpx.get(f"{base_url}/v1/models").json()["data"][0]["max_model_len"]
    text = "hello " * limit  # about one token a word
    messages = [{"role": "user", "content": text}]
    chat = httpx.post(f"{base_url}/v1/chat/completions", json={"messages": messages}, timeout=30)
    n_chat = httpx.post(f"{base_url}/v1/chat/completions/render", json={"messages": messages}, timeout=30)
    error = assert_openai_error(chat, "messages")
    assert error["code"] == "context_length_exceeded"
    assert error["message"].startswith(
        f"This model's maximum context length is {limit} tokens. However, your messages resulted in "
        f"{len(n_chat.json()['token_ids'])} tokens"), error["message"]
    completion = httpx.post(f"{base_url}/v1/completions", json={"prompt": text}, timeout=30)
    error = assert_openai_error(completion, "prompt")
    assert error["code"] == "context_length_exceeded"
    assert error["message"].startswith(f"This model's maximum context length is {limit} tokens. However, your prompt")


def test_openai_client_raises_bad_request(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, messages=HI, n=17)
    assert (caught.value.status_code, caught.value.type, caught.value.param) == (400, "invalid_request_error", "n")


def test_unknown_route_is_an_openai_404(base_url: str) -> None:
    response = httpx.get(f"{base_url}/v1/nothing-here")
    assert response.status_code == 404
    assert response.json()["error"]["type"] == "not_found_error"


# --- other routes --------------------------------------------------------------------------------


def test_models_and_health(base_url: str, client: openai.OpenAI) -> None:
    models = client.models.list().data
    assert len(models) == 1 and models[0].id and models[0].object == "model"
    for path in ("/v1/models", "/models"):
        body = httpx.get(f"{base_url}{path}").json()
        assert body["object"] == "list" and body["data"][0]["id"] == models[0].id
        assert body["data"][0]["max_model_len"] > 0
    response = httpx.get(f"{base_url}/health")
    assert (response.status_code, response.json()) == (200, {"status": "ok"})


def test_routes_without_v1(base_url: str) -> None:
    chat = httpx.post(f"{base_url}/chat/completions", json={"messages": HI, "max_tokens": 2}, timeout=60)
    assert chat.status_code == 200 and chat.json()["object"] == "chat.completion"
    text = httpx.post(f"{base_url}/completions", json={"prompt": "Hello", "max_tokens": 2}, timeout=60)
    assert text.status_code == 200 and text.json()["object"] == "text_completion"


def test_abandoned_stream_frees_its_sequence(base_url: str, client: openai.OpenAI) -> None:
    """A client that hangs up mid-stream aborts its request: it ends in far fewer engine steps than
    the 3,000 tokens it asked for take (one step each), however long those steps are."""
    no_eos = {"0": -100, "2": -100}  # <|endoftext|> and <|im_end|>
    steps = metric(base_url, "kvserve_engine_steps_total")
    stream = client.chat.completions.create(
        model=MODEL, messages=MATH, max_tokens=3000, logit_bias=no_eos, stream=True
    )
    next(c for c in stream if c.choices[0].delta.content)  # the app answers once the engine has run it
    assert metric(base_url, "kvserve_requests_running") == 1
    stream.close()
    wait_until(lambda: metric(base_url, "kvserve_requests_running") == 0, 600, "the request ended")
    assert metric(base_url, "kvserve_engine_steps_total") - steps < 1000


def test_metrics_count_a_request(base_url: str, client: openai.OpenAI) -> None:
    counters = {
        "generation": ("kvserve_generation_tokens_total", {}),
        "prompt": ("kvserve_prompt_tokens_total", {}),
        "length": ("kvserve_request_success_total", {"finish_reason": "length"}),
        "ttft": ("kvserve_time_to_first_token_seconds_bucket", {"le": "+Inf"}),
    }
    chat_text(client, MATH, max_tokens=4)  # the "length" series exists from here on
    before = {k: metric(base_url, name, **labels) for k, (name, labels) in counters.items()}
    r = client.chat.completions.create(model=MODEL, messages=MATH, temperature=0, max_tokens=4)
    after = {k: metric(base_url, name, **labels) for k, (name, labels) in counters.items()}

    assert after["generation"] - before["generation"] == 4 and after["generation"] > 0
    assert after["prompt"] - before["prompt"] == r.usage.prompt_tokens
    assert after["length"] - before["length"] == 1
    assert after["ttft"] - before["ttft"] == 1
    assert metric(base_url, "kvserve_requests_running") == 0  # all traffic so far has finished
    assert 0 < metric(base_url, "kvserve_kv_cache_usage_ratio") <= 1  # the prefix cache holds pages

"""Thinking in each API's own shape, on real llama.cpp: a tiny random-weight model under a
Qwen3-style template that opens `<think>` (detected from the template), its thinking closed by
the server at a budget of a few tokens; the SDKs reading it; tools called after the thinking.
The real-model proof (Qwen2.5-Coder under the same template) is at the end."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

import anthropic
import httpx
import openai
import pytest

from conftest import serve, served
from kvserve.reply import ReasoningFormat
from kvserve.testing import read_metrics
from kvserve.testing.tiny_models import TEMPLATES

ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                   "required": ["city"]}}}
MARKER = 4  # <tool_call> in the tiny hermes vocabularies
BUDGET = 4


@pytest.fixture(scope="module")
def url(tiny) -> Iterator[str]:
    with serve(tiny("llama", "hermes-think"), threads=1) as base:
        yield base


def chat(url: str, **fields) -> dict:
    body = {"messages": ASK, "temperature": 0, "max_tokens": 40, "reasoning_budget": BUDGET, **fields}
    response = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=300)
    assert response.status_code == 200, response.text
    return response.json()


def chat_stream(url: str, **fields) -> list[dict]:
    body = {"messages": ASK, "temperature": 0, "max_tokens": 40, "reasoning_budget": BUDGET, "stream": True,
            "stream_options": {"include_usage": True}, **fields}
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=300) as response:
        assert response.status_code == 200
        lines = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def test_chat_splits_thinking_whole_and_streamed_alike(url: str) -> None:
    whole = chat(url)
    message = whole["choices"][0]["message"]
    assert message["reasoning_content"] and "</think>" not in message["reasoning_content"]
    assert "<think>" not in (message["content"] or "") and "</think>" not in (message["content"] or "")
    chunks = chat_stream(url)
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == message["reasoning_content"]
    assert "".join(d.get("content") or "" for d in deltas) == message["content"]
    usage, streamed_usage = whole["usage"], chunks[-1]["usage"]
    assert streamed_usage["completion_tokens_details"] == usage["completion_tokens_details"]
    assert streamed_usage["completion_tokens"] == usage["completion_tokens"]


def test_the_budget_closes_the_thinking_and_max_tokens_counts_it(url: str) -> None:
    """Budget 4: the server writes the close after four thinking tokens; the reasoning tokens are
    those four and the close's. Without a budget this random model never closes its thinking:
    cut by max_tokens, the reply is all thinking, every token of it counted."""
    usage = chat(url)["usage"]
    close = httpx.post(f"{url}/tokenize", json={"prompt": "\n</think>\n\n"}, timeout=30).json()["tokens"]
    texts = [httpx.post(f"{url}/detokenize", json={"tokens": close[:k]}, timeout=30).json()["prompt"]
             for k in range(1, len(close) + 1)]
    closing = next(k for k, text in enumerate(texts, 1) if "</think>" in text)  # the close's tokens up to `>`
    assert usage["completion_tokens_details"]["reasoning_tokens"] == BUDGET + closing
    unlimited = chat(url, reasoning_budget=-1)
    assert unlimited["usage"]["completion_tokens_details"]["reasoning_tokens"] == 40
    cut = chat(url, reasoning_budget=-1, max_tokens=12)
    choice = cut["choices"][0]
    assert choice["finish_reason"] == "length" and choice["message"]["content"] == ""
    assert choice["message"]["reasoning_content"]
    assert cut["usage"]["completion_tokens"] == cut["usage"]["completion_tokens_details"]["reasoning_tokens"] == 12


def test_responses_reasoning_items_and_token_count(url: str) -> None:
    body = {"input": "What is the weather in Paris?", "temperature": 0, "max_output_tokens": 40,
            "reasoning": {"effort": "low"}, "reasoning_budget": BUDGET}
    whole = httpx.post(f"{url}/v1/responses", json=body, timeout=300).json()
    kinds = [item["type"] for item in whole["output"]]
    assert kinds[0] == "reasoning" and whole["output"][0]["content"][0]["type"] == "reasoning_text"
    assert whole["usage"]["output_tokens_details"]["reasoning_tokens"] > 0
    with httpx.stream("POST", f"{url}/v1/responses", json={**body, "stream": True}, timeout=300) as response:
        events = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: ")]
    thought = "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta")
    assert thought == whole["output"][0]["content"][0]["text"]
    done = [e for e in events if e["type"] == "response.reasoning_text.done"]
    assert len(done) == 1 and done[0]["text"] == thought
    assert events[-1]["response"]["output"][0]["content"] == whole["output"][0]["content"]
    follow = httpx.post(f"{url}/v1/responses", json={**body, "input": "And Rome?", "previous_response_id": whole["id"]},
                        timeout=300)
    assert follow.status_code == 200 and follow.json()["output"][0]["type"] == "reasoning"
    assert whole["reasoning"] == {"effort": "low", "summary": None}  # the effort asked, echoed


def test_messages_thinking_blocks_budget_and_disabled(url: str) -> None:
    body = {"model": "any", "max_tokens": 40, "temperature": 0, "messages": ASK,
            "thinking": {"type": "enabled", "budget_tokens": BUDGET}}
    whole = httpx.post(f"{url}/v1/messages", json=body, timeout=300).json()
    assert whole["content"][0]["type"] == "thinking" and whole["content"][0]["thinking"]
    assert all(block["type"] != "thinking" for block in whole["content"][1:])
    with httpx.stream("POST", f"{url}/v1/messages", json={**body, "stream": True}, timeout=300) as response:
        events = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: ")]
    thinking = "".join(e["delta"]["thinking"] for e in events
                       if e["type"] == "content_block_delta" and e["delta"]["type"] == "thinking_delta")
    assert thinking == whole["content"][0]["thinking"]
    assert any(e["type"] == "content_block_delta" and e["delta"]["type"] == "signature_delta" for e in events)
    off = httpx.post(f"{url}/v1/messages", json={**body, "thinking": {"type": "disabled"}}, timeout=300).json()
    assert all(block["type"] != "thinking" for block in off["content"])
    bad = httpx.post(f"{url}/v1/messages", json={**body, "thinking": {"type": "enabled", "budget_tokens": 40}})
    assert bad.status_code == 400 and bad.json()["type"] == "error"


def test_a_response_format_holds_the_answer_after_the_thinking(url: str) -> None:
    """The JSON grammar lets the reply think first: the thinking is reasoning, the answer after the
    close is JSON of the schema, whole, in content (under the budget's forced close too)."""
    schema = {"type": "object", "properties": {"a": {"type": "string", "maxLength": 8}}, "required": ["a"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    for budget in (BUDGET, 0):
        message = chat(url, response_format=fmt, reasoning_budget=budget, max_tokens=60)["choices"][0]["message"]
        assert set(json.loads(message["content"])) == {"a"}, message
        assert bool(message.get("reasoning_content")) == (budget > 0), message


def test_chat_template_kwargs_reach_the_template(url: str) -> None:
    """enable_thinking false: the template writes an empty, closed block, so nothing is thought."""
    body = chat(url, chat_template_kwargs={"enable_thinking": False}, reasoning_budget=-1, max_tokens=12)
    assert "reasoning_content" not in body["choices"][0]["message"]
    tokens = httpx.post(f"{url}/v1/chat/completions/render", json={
        "messages": ASK, "chat_template_kwargs": {"enable_thinking": False}}, timeout=30).json()["token_ids"]
    text = httpx.post(f"{url}/detokenize", json={"tokens": tokens}, timeout=30).json()["prompt"]
    assert text.endswith("<think>\n\n</think>\n\n")


def test_past_turns_reasoning_is_left_to_the_template(url: str) -> None:
    """This template renders no past thinking: sending it back does not change the prompt."""
    turns = [*ASK, {"role": "assistant", "content": "Sunny.", "reasoning_content": "Think about Paris."},
             {"role": "user", "content": "And Rome?"}]
    bare = [*ASK, {"role": "assistant", "content": "Sunny."}, {"role": "user", "content": "And Rome?"}]
    with_reasoning = chat(url, messages=turns, max_tokens=1)["usage"]["prompt_tokens"]
    assert with_reasoning == chat(url, messages=bare, max_tokens=1)["usage"]["prompt_tokens"]


# --- SDKs -----------------------------------------------------------------------------------------------


def test_openai_sdk_reads_reasoning_content_and_reasoning_items(url: str) -> None:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300)
    extra = {"reasoning_budget": BUDGET}
    done = client.chat.completions.create(model="any", messages=ASK, temperature=0, max_tokens=40, extra_body=extra)
    reasoning = done.choices[0].message.model_extra["reasoning_content"]
    assert reasoning
    streamed = "".join((chunk.choices[0].delta.model_extra or {}).get("reasoning_content") or ""
                       for chunk in client.chat.completions.create(model="any", messages=ASK, temperature=0,
                                                                   max_tokens=40, extra_body=extra, stream=True)
                       if chunk.choices)
    assert streamed == reasoning
    response = client.responses.create(model="any", input="What is the weather in Paris?", temperature=0,
                                       max_output_tokens=12)
    item = response.output[0]
    assert item.type == "reasoning" and item.content[0].text
    assert response.usage.output_tokens_details.reasoning_tokens == 12


def test_anthropic_sdk_reads_thinking_blocks(url: str) -> None:
    client = anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0, timeout=300)
    kwargs = dict(model="any", max_tokens=40, messages=ASK, thinking={"type": "enabled", "budget_tokens": BUDGET},
                  extra_body={"temperature": 0})  # the SDK sends sampling fields only as extra_body
    message = client.messages.create(**kwargs)
    assert message.content[0].type == "thinking" and message.content[0].thinking
    with client.messages.stream(**kwargs) as stream:
        final = stream.get_final_message()
    assert final.content[0].thinking == message.content[0].thinking


def test_langchain_gets_the_answer_without_the_thinking(url: str) -> None:
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(base_url=f"{url}/v1", api_key="unused", model="any", temperature=0, max_tokens=40,
                     extra_body={"reasoning_budget": BUDGET}, max_retries=0)
    answer = llm.invoke("What is the weather in Paris?")
    raw = chat(url, messages=[{"role": "user", "content": "What is the weather in Paris?"}])
    assert answer.content == raw["choices"][0]["message"]["content"]
    assert raw["choices"][0]["message"]["reasoning_content"] not in answer.content


# --- tools after thinking ------------------------------------------------------------------------------


@pytest.mark.parametrize("choice", ["auto", "required", "named"])
def test_one_clean_call_after_the_thinking_in_chat(url: str, choice: str) -> None:
    """Under auto the marker is pushed by a logit bias, so the random model writes it inside its
    thinking too: there it is reasoning, and the lazy grammar waits; after the close, one call."""
    tool_choice = {"type": "function", "function": {"name": "get_weather"}} if choice == "named" else choice
    fields = dict(tools=[WEATHER], tool_choice=tool_choice, parallel_tool_calls=False, max_tokens=120)
    if choice == "auto":
        fields["logit_bias"] = {str(MARKER): 100}
    body = chat(url, **fields)
    message = body["choices"][0]["message"]
    calls = message["tool_calls"]
    assert len(calls) == 1 and calls[0]["function"]["name"] == "get_weather"
    assert isinstance(json.loads(calls[0]["function"]["arguments"])["city"], str)
    assert body["choices"][0]["finish_reason"] == "tool_calls"
    assert message["reasoning_content"]
    if choice == "auto":
        assert "<tool_call>" in message["reasoning_content"]  # the marker inside the thinking was not a call
    chunks = chat_stream(url, **fields)
    heads = [call for c in chunks if c["choices"] for call in c["choices"][0]["delta"].get("tool_calls") or []
             if "id" in call]
    assert [h["function"]["name"] for h in heads] == ["get_weather"]


@pytest.mark.parametrize("choice", ["auto", "required"])
def test_a_reply_that_may_open_its_own_thinking_calls_at_once(url: str, choice: str) -> None:
    """enable_thinking false: the prompt closed the block, so the reply might open one itself or
    not; the grammar allows either, and this one calls at once."""
    fields = dict(tools=[WEATHER], tool_choice=choice, parallel_tool_calls=False, max_tokens=120,
                  chat_template_kwargs={"enable_thinking": False})
    if choice == "auto":
        fields["logit_bias"] = {str(MARKER): 100}
    message = chat(url, **fields)["choices"][0]["message"]
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["get_weather"]
    assert "reasoning_content" not in message


def test_a_call_after_thinking_in_responses_and_messages(url: str) -> None:
    tool = WEATHER["function"]
    response = httpx.post(f"{url}/v1/responses", json={
        "input": ASK[0]["content"], "temperature": 0, "max_output_tokens": 120, "tools": [{"type": "function", **tool}],
        "tool_choice": "required", "parallel_tool_calls": False, "reasoning_budget": BUDGET}, timeout=300).json()
    assert [item["type"] for item in response["output"]][-1] == "function_call"
    assert response["output"][0]["type"] == "reasoning"
    message = httpx.post(f"{url}/v1/messages", json={
        "model": "any", "max_tokens": 120, "temperature": 0, "messages": ASK,
        "thinking": {"type": "enabled", "budget_tokens": BUDGET},
        "tools": [{"name": tool["name"], "input_schema": tool["parameters"]}],
        "tool_choice": {"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True}}, timeout=300).json()
    assert [block["type"] for block in message["content"]] == ["thinking", "tool_use"]
    assert message["stop_reason"] == "tool_use"


def test_a_forced_close_is_the_same_under_speculation(tiny, url: str) -> None:
    """Drafts verified token by token: a forced close is one more token the chain accepts, so a
    speculating server gives the very reply a plain one gives."""
    plain = chat(url, max_tokens=60)
    with serve(tiny("llama", "hermes-think"), threads=1, speculative="ngram") as spec_url:
        speculated = chat(spec_url, max_tokens=60)
        drafted = read_metrics(spec_url).total("kvserve_spec_draft_tokens_total")
    assert drafted > 0  # the random model repeats itself: drafts were verified
    assert speculated["choices"] == plain["choices"]
    assert speculated["usage"]["completion_tokens_details"] == plain["usage"]["completion_tokens_details"]


# --- detection ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("template,flag,expected", [
    ("hermes-think", "auto", ReasoningFormat.DEEPSEEK),
    ("harmony", "auto", ReasoningFormat.HARMONY),
    ("hermes", "auto", ReasoningFormat.NONE),
    ("hermes-think", "none", ReasoningFormat.NONE),
])
def test_the_format_is_detected_and_the_flag_overrides_it(tiny, template: str, flag: str,
                                                        expected: ReasoningFormat) -> None:
    with served(tiny("llama", template), threads=1, reasoning_format=flag) as (base, app):
        assert app.state.models.only.reasoning is expected
        if expected is ReasoningFormat.NONE:
            body = httpx.post(f"{base}/v1/chat/completions", json={"messages": ASK, "temperature": 0,
                                                                   "max_tokens": 8}, timeout=300).json()
            assert "reasoning_content" not in body["choices"][0]["message"]


# --- the real path ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def qwen_thinking(qwen_coder: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    template = tmp_path_factory.mktemp("templates") / "qwen-think.jinja"
    template.write_text(TEMPLATES["hermes-think"])
    with serve(qwen_coder, threads=2, ctx_size=2048, chat_template_file=template, reasoning_budget=6) as base:
        yield base


@pytest.mark.slow
def test_qwen_thinks_a_few_tokens_then_the_server_closes_and_it_answers(qwen_thinking: str) -> None:
    """Qwen2.5-Coder was never trained to think: opened `<think>`, it would write on. At the
    budget (6, by flag) the server writes the close, and the model answers the question."""
    body = {"messages": [{"role": "user", "content": "What is 2 + 3? Answer with the number."}], "temperature": 0,
            "max_tokens": 60}
    whole = httpx.post(f"{qwen_thinking}/v1/chat/completions", json=body, timeout=300).json()
    message = whole["choices"][0]["message"]
    assert message["reasoning_content"] and "</think>" not in message["reasoning_content"]
    assert "5" in message["content"] and "</think>" not in message["content"]
    with httpx.stream("POST", f"{qwen_thinking}/v1/chat/completions", json={**body, "stream": True},
                      timeout=300) as response:
        chunks = [json.loads(line[6:]) for line in response.iter_lines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == message["reasoning_content"]
    assert "".join(d.get("content") or "" for d in deltas) == message["content"]
    responses = httpx.post(f"{qwen_thinking}/v1/responses", json={
        "input": body["messages"][0]["content"], "temperature": 0, "max_output_tokens": 60}, timeout=300).json()
    assert 6 < responses["usage"]["output_tokens_details"]["reasoning_tokens"] < responses["usage"]["output_tokens"]

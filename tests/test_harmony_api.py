"""gpt-oss's harmony format on real llama.cpp: a tiny random-weight model whose vocabulary has the
harmony tokens (`<|end|>` plain, `<|call|>` and `<|return|>` ending generation, as gpt-oss's) under a
gpt-oss-like template whose generation prompt opens `<|start|>assistant<|channel|>analysis<|message|>`.
The server closes the analysis at a budget of a few tokens, and the model answers; under a required
or named tool choice the close leaves the header to the grammar, which writes one call."""

from __future__ import annotations

import json
from typing import Iterator

import httpx
import pytest

from conftest import serve

ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                   "required": ["city"]}}}
BUDGET = 4
CLOSE = "<|end|><|start|>assistant<|channel|>final<|message|>"
CALL_CLOSE = "<|end|><|start|>assistant"


@pytest.fixture(scope="module")
def url(tiny) -> Iterator[str]:
    with serve(tiny("llama", "harmony"), threads=1) as base:
        yield base


def post(url: str, path: str, body: dict) -> dict:
    response = httpx.post(f"{url}{path}", json=body, timeout=300)
    assert response.status_code == 200, response.text
    return response.json()


def events(url: str, path: str, body: dict) -> list[dict]:
    with httpx.stream("POST", f"{url}{path}", json={**body, "stream": True}, timeout=300) as response:
        assert response.status_code == 200
        lines = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    return [json.loads(line) for line in lines if line != "[DONE]"]


def tokens_of(url: str, text: str) -> list[int]:
    return post(url, "/tokenize", {"prompt": text})["tokens"]


def chat_body(**fields) -> dict:
    return {"messages": ASK, "temperature": 0, "max_tokens": 30, "reasoning_budget": BUDGET, "logprobs": True,
            **fields}


def test_chat_the_server_closes_the_analysis_at_the_budget_and_the_model_answers(url: str) -> None:
    """The reply's tokens (logprobs list each one): exactly BUDGET of analysis, then the close's
    tokens, then the answer. Reasoning tokens: the budget and the close's `<|end|>` (the last token
    written inside the analysis); the header after it is not thinking."""
    whole = post(url, "/v1/chat/completions", chat_body())
    choice = whole["choices"][0]
    pieces = [entry["token"] for entry in choice["logprobs"]["content"]]
    close = tokens_of(url, CLOSE)
    assert "".join(pieces[BUDGET:BUDGET + len(close)]) == CLOSE
    assert CLOSE not in "".join(pieces[:BUDGET])
    message = choice["message"]
    assert message["reasoning_content"] == "".join(pieces[:BUDGET]).strip()
    assert message["content"] and message["content"] == "".join(pieces[BUDGET + len(close):])
    assert whole["usage"]["completion_tokens_details"]["reasoning_tokens"] == BUDGET + 1
    chunks = events(url, "/v1/chat/completions", {**chat_body(), "stream_options": {"include_usage": True}})
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == message["reasoning_content"]
    assert "".join(d.get("content") or "" for d in deltas) == message["content"]
    assert chunks[-1]["usage"]["completion_tokens_details"]["reasoning_tokens"] == BUDGET + 1


def test_a_response_format_holds_the_final_message_after_the_analysis(url: str) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "string", "maxLength": 8}}, "required": ["a"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    message = post(url, "/v1/chat/completions", chat_body(response_format=fmt, max_tokens=60))["choices"][0]["message"]
    assert message["reasoning_content"] and set(json.loads(message["content"])) == {"a"}, message


def test_responses_reasoning_item_at_the_budget_then_the_answer(url: str) -> None:
    body = {"input": ASK[0]["content"], "temperature": 0, "max_output_tokens": 30, "reasoning_budget": BUDGET}
    whole = post(url, "/v1/responses", body)
    kinds = [item["type"] for item in whole["output"]]
    assert kinds == ["reasoning", "message"]
    thought = whole["output"][0]["content"][0]["text"]
    chat = post(url, "/v1/chat/completions", chat_body())["choices"][0]["message"]
    assert thought == chat["reasoning_content"]
    assert whole["output"][1]["content"][0]["text"] == chat["content"]
    assert whole["usage"]["output_tokens_details"]["reasoning_tokens"] == BUDGET + 1
    streamed = events(url, "/v1/responses", body)
    assert "".join(e["delta"] for e in streamed if e["type"] == "response.reasoning_text.delta") == thought
    assert "".join(e["delta"] for e in streamed if e["type"] == "response.output_text.delta") == chat["content"]


def test_messages_thinking_block_at_the_budget_then_the_answer(url: str) -> None:
    body = {"model": "any", "max_tokens": 30, "temperature": 0, "messages": ASK,
            "thinking": {"type": "enabled", "budget_tokens": BUDGET}}
    whole = post(url, "/v1/messages", body)
    assert [block["type"] for block in whole["content"]] == ["thinking", "text"]
    chat = post(url, "/v1/chat/completions", chat_body())["choices"][0]["message"]
    assert whole["content"][0]["thinking"] == chat["reasoning_content"]
    assert whole["content"][1]["text"] == chat["content"]
    streamed = events(url, "/v1/messages", body)
    deltas = [e["delta"] for e in streamed if e["type"] == "content_block_delta"]
    assert "".join(d.get("thinking", "") for d in deltas) == chat["reasoning_content"]
    assert "".join(d.get("text", "") for d in deltas) == chat["content"]


# --- tools ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("choice", ["required", "named"])
def test_chat_one_call_after_the_analysis(url: str, choice: str) -> None:
    """At the budget the server writes `<|end|><|start|>assistant`; the grammar then writes the
    call's header (recipient, channel) and its arguments to the schema; `<|call|>` ends it."""
    tool_choice = {"type": "function", "function": {"name": "get_weather"}} if choice == "named" else choice
    body = chat_body(tools=[WEATHER], tool_choice=tool_choice, max_tokens=120)
    whole = post(url, "/v1/chat/completions", body)
    choice_ = whole["choices"][0]
    pieces = [entry["token"] for entry in choice_["logprobs"]["content"]]
    assert "".join(pieces[BUDGET:BUDGET + len(tokens_of(url, CALL_CLOSE))]) == CALL_CLOSE
    assert "to=functions.get_weather" in "".join(pieces)
    calls = choice_["message"]["tool_calls"]
    assert [c["function"]["name"] for c in calls] == ["get_weather"]
    assert isinstance(json.loads(calls[0]["function"]["arguments"])["city"], str)
    assert choice_["finish_reason"] == "tool_calls" and not choice_["message"]["content"]
    assert choice_["message"]["reasoning_content"] == "".join(pieces[:BUDGET]).strip()
    chunks = events(url, "/v1/chat/completions", body)
    streamed = [call for c in chunks if c["choices"] for call in c["choices"][0]["delta"].get("tool_calls") or []]
    assert [s["function"]["name"] for s in streamed if "id" in s] == ["get_weather"]
    assert "".join(s["function"].get("arguments") or "" for s in streamed) == calls[0]["function"]["arguments"]


def test_auto_answers_in_the_final_channel_with_the_lazy_grammar_waiting(url: str) -> None:
    """Under auto the close opens the final channel: the model answers; the lazy grammar, armed
    after the analysis, waits for a recipient that never comes."""
    whole = post(url, "/v1/chat/completions", chat_body(tools=[WEATHER], tool_choice="auto"))
    message = whole["choices"][0]["message"]
    assert message["reasoning_content"] and message["content"] and "tool_calls" not in message


def test_a_call_after_the_analysis_in_responses_and_messages(url: str) -> None:
    tool = WEATHER["function"]
    body = {"input": ASK[0]["content"], "temperature": 0, "max_output_tokens": 120,
            "tools": [{"type": "function", **tool}], "tool_choice": "required", "reasoning_budget": BUDGET}
    response = post(url, "/v1/responses", body)
    assert [item["type"] for item in response["output"]] == ["reasoning", "function_call"]
    call = response["output"][1]
    assert call["name"] == "get_weather" and isinstance(json.loads(call["arguments"])["city"], str)
    streamed = events(url, "/v1/responses", body)
    done = [e["item"] for e in streamed if e["type"] == "response.output_item.done"]
    assert [(i["type"], i.get("arguments")) for i in done][-1] == ("function_call", call["arguments"])
    messages = {"model": "any", "max_tokens": 120, "temperature": 0, "messages": ASK,
                "thinking": {"type": "enabled", "budget_tokens": BUDGET},
                "tools": [{"name": tool["name"], "input_schema": tool["parameters"]}],
                "tool_choice": {"type": "tool", "name": "get_weather"}}
    message = post(url, "/v1/messages", messages)
    assert [block["type"] for block in message["content"]] == ["thinking", "tool_use"]
    assert message["content"][1]["name"] == "get_weather" and isinstance(message["content"][1]["input"]["city"], str)
    assert message["stop_reason"] == "tool_use"
    streamed = events(url, "/v1/messages", messages)
    starts = [e["content_block"] for e in streamed if e["type"] == "content_block_start"]
    assert [s["type"] for s in starts] == ["thinking", "tool_use"]
    partial = "".join(e["delta"]["partial_json"] for e in streamed
                      if e["type"] == "content_block_delta" and e["delta"]["type"] == "input_json_delta")
    assert json.loads(partial) == message["content"][1]["input"]


def test_a_past_call_and_its_result_render_as_harmony_messages(url: str) -> None:
    messages = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    tokens = post(url, "/v1/chat/completions/render", {"messages": messages, "tools": [WEATHER]})["token_ids"]
    text = post(url, "/detokenize", {"tokens": tokens})["prompt"]
    assert ('<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"}<|call|>'
            in text)
    assert "<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>sunny<|end|>" in text
    assert text.endswith("<|start|>assistant<|channel|>analysis<|message|>")

"""Tool calls on /v1/chat/completions with the `openai` client, on real llama.cpp: tiny random-weight
models with a Hermes-style, a Llama-3-style and a Mistral-style template, and SmolLM2 (whose template knows nothing
of tools: the generic JSON mode).

With `required`, a named function or allowed tools, the grammar holds from the first token, so even
random weights produce a valid call: those tests are exact. `auto` is lazy; the tiny models are
pushed to open a call with a logit bias on the marker, after which the grammar takes over.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Iterator

import httpx
import jsonschema
import openai
import pydantic
import pytest

from conftest import serve
from kvserve.testing import read_metrics
from test_openai_api import assert_openai_error

MODEL = "any"
ADD = {"type": "function", "function": {
    "name": "add", "description": "Add two integers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                   "required": ["a", "b"]}}}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    # maxLength bounds what random weights can write into the string
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                   "required": ["city"]}}}
TOOLS = [WEATHER, ADD]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
# Token ids in SmolLM2's vocabulary, which the tiny models share: their marker (<tool_call> for
# hermes, [TOOL_CALLS] for mistral), and `{"`.
MARKER, OPEN_OBJECT = 4, 39428


@pytest.fixture(scope="module")
def servers(tiny, smollm2: Path) -> Iterator[dict[str, str]]:
    with serve(tiny("llama", "hermes"), threads=1) as hermes, serve(tiny("llama", "llama3"), threads=1) as llama3, \
            serve(tiny("llama", "mistral"), threads=1) as mistral, serve(smollm2, threads=1) as generic:
        yield {"hermes": hermes, "llama3": llama3, "mistral": mistral, "generic": generic}


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300)


def create(url: str, **kwargs):
    kwargs = {"model": MODEL, "messages": ASK, "tools": TOOLS, "temperature": 0, "max_tokens": 200, **kwargs}
    return client(url).chat.completions.create(**kwargs)


def streamed(url: str, **kwargs) -> tuple[str | None, list[dict], str]:
    """(content, calls, finish_reason) of a streamed reply, checking what clients rely on: each call
    delta has an index; id, type and name come once, in the call's first delta; then only
    argument fragments."""
    chunks = list(create(url, stream=True, stream_options={"include_usage": True}, **kwargs))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 0
    content, calls, reasons = [], {}, []
    for chunk in chunks[:-1]:
        (choice,) = chunk.choices
        content += [choice.delta.content] if choice.delta.content else []
        for call in choice.delta.tool_calls or []:
            assert call.index is not None
            if call.index not in calls:
                assert call.index == len(calls) and call.id.startswith("call_") and call.type == "function"
                assert call.function.name in SCHEMAS
                calls[call.index] = {"id": call.id, "name": call.function.name, "arguments": call.function.arguments}
            else:
                assert (call.id, call.type, call.function.name) == (None, None, None)
                calls[call.index]["arguments"] += call.function.arguments
        reasons += [choice.finish_reason] if choice.finish_reason else []
    assert len(reasons) == 1 and chunks[-2].choices[0].finish_reason == reasons[0]
    return "".join(content) or None, list(calls.values()), reasons[0]


def check_call(name: str, arguments: str, expected_name: str | None = None) -> dict:
    """A call that names a tool (`expected_name`, if given) with arguments that satisfy its schema."""
    assert name in SCHEMAS and (expected_name is None or name == expected_name)
    value = json.loads(arguments)
    jsonschema.validate(value, SCHEMAS[name])
    return value


def one_call(url: str, expected_name: str | None = None, **kwargs) -> None:
    """Whole and streamed: exactly one valid call, no content, finish_reason tool_calls."""
    whole = create(url, parallel_tool_calls=False, **kwargs).choices[0]
    assert (whole.finish_reason, whole.message.content) == ("tool_calls", None)
    (call,) = whole.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    check_call(call.function.name, call.function.arguments, expected_name)

    content, calls, reason = streamed(url, parallel_tool_calls=False, **kwargs)
    assert (content, reason, len(calls)) == (None, "tool_calls", 1)
    check_call(calls[0]["name"], calls[0]["arguments"], expected_name)


FORMATS = ["hermes", "llama3", "mistral", "generic"]


def finishes(url: str) -> dict[str, float]:
    metrics = read_metrics(url)
    return {reason: metrics.value("kvserve_request_success_total", finish_reason=reason) for reason in ("stop", "tool_calls")}


@pytest.mark.parametrize("fmt", FORMATS)
def test_required_is_one_valid_call(servers: dict[str, str], fmt: str) -> None:
    """... and /metrics counts both replies (whole and streamed) as finished with tool_calls."""
    before = finishes(servers[fmt])
    one_call(servers[fmt], tool_choice="required")
    after = finishes(servers[fmt])
    assert (after["tool_calls"] - before["tool_calls"], after["stop"] - before["stop"]) == (2, 0)


@pytest.mark.parametrize("fmt", ["hermes", "mistral"])
def test_required_cut_short_has_no_text(servers: dict[str, str], fmt: str) -> None:
    """max_tokens cuts a forced call before it is certain: what came out was call syntax, never
    the reply's text (whole and streamed)."""
    for max_tokens in (1, 2, 3, 5):
        whole = create(servers[fmt], tool_choice="required", max_tokens=max_tokens).choices[0]
        assert whole.finish_reason == "length" and not whole.message.content, (max_tokens, whole.message.content)
        content, _, reason = streamed(servers[fmt], tool_choice="required", max_tokens=max_tokens)
        assert reason == "length" and not content, (max_tokens, content)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("name", ["add", "get_weather"])
def test_named_function_is_called(servers: dict[str, str], fmt: str, name: str) -> None:
    one_call(servers[fmt], name, tool_choice={"type": "function", "function": {"name": name}})


@pytest.mark.parametrize("fmt", FORMATS)
def test_allowed_tools_restrict_the_call(servers: dict[str, str], fmt: str) -> None:
    allowed = {"type": "allowed_tools", "allowed_tools": {"mode": "required", "tools": [
        {"type": "function", "function": {"name": "add"}}]}}
    one_call(servers[fmt], "add", tool_choice=allowed)


@pytest.mark.parametrize("fmt,bias", [("hermes", MARKER), ("llama3", OPEN_OBJECT), ("mistral", MARKER)])
def test_auto_grammar_takes_over_at_the_marker(servers: dict[str, str], fmt: str, bias: int) -> None:
    """Pushed to open a call, random weights finish it validly: the lazy grammar fired on the marker
    (a control token for hermes and mistral, a reply opening an object for llama3). Only integers in the tool,
    so the bias cannot be satisfied inside a string."""
    one_call(servers[fmt], "add", tools=[ADD], tool_choice="auto", logit_bias={str(bias): 100})


def test_auto_leaves_free_text_free(servers: dict[str, str]) -> None:
    url = servers["hermes"]
    whole = create(url, tool_choice="auto", max_tokens=24).choices[0]
    assert whole.message.tool_calls is None and whole.message.content
    content, calls, reason = streamed(url, tool_choice="auto", max_tokens=24)
    assert calls == [] and content and reason == whole.finish_reason


def rendered(url: str, **body) -> str:
    tokens = httpx.post(f"{url}/v1/chat/completions/render", json={"messages": ASK, **body}, timeout=60)
    assert tokens.status_code == 200, tokens.text
    return httpx.post(f"{url}/detokenize", json={"tokens": tokens.json()["token_ids"]}, timeout=60).json()["prompt"]


@pytest.mark.parametrize("fmt,shown", [("hermes", "<tools>"), ("llama3", "Environment: ipython"),
                                       ("generic", "You can call these tools")])
def test_tools_reach_the_prompt_unless_choice_is_none(servers: dict[str, str], fmt: str, shown: str) -> None:
    url = servers[fmt]
    assert shown in rendered(url, tools=TOOLS) and '"get_weather"' in rendered(url, tools=TOOLS)
    assert shown not in rendered(url, tools=TOOLS, tool_choice="none")
    assert shown not in rendered(url)


@pytest.mark.parametrize("fmt", FORMATS)
def test_none_is_text(servers: dict[str, str], fmt: str) -> None:
    """No call even where the history is all calls; the generic mode answers in its JSON shape,
    whose text is the content."""
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "3"}]
    whole = create(servers[fmt], messages=history, tool_choice="none", max_tokens=24).choices[0]
    assert whole.message.tool_calls is None and whole.message.content
    assert not whole.message.content.startswith('{"response"')


def test_response_format_with_tool_choice_none(servers: dict[str, str]) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "n", "schema": {
        "type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}}}
    whole = create(servers["hermes"], tool_choice="none", response_format=fmt, max_tokens=60).choices[0]
    assert whole.finish_reason == "stop" and isinstance(json.loads(whole.message.content)["n"], int)


def test_parallel_calls(servers: dict[str, str]) -> None:
    """SmolLM2, made to call add, calls it again and again when it may: several calls, each streamed
    under its own index, each whole (max_tokens cuts the last one, which is dropped)."""
    url = servers["generic"]
    add = [{"role": "user", "content": "What is 2 + 3?"}]
    whole = create(url, messages=add, tool_choice="required", max_tokens=64).choices[0]
    assert len(whole.message.tool_calls) >= 2 and whole.finish_reason == "length"
    for call in whole.message.tool_calls:
        check_call(call.function.name, call.function.arguments)
    content, calls, reason = streamed(url, messages=add, tool_choice="required", max_tokens=64)
    assert len({c["id"] for c in calls}) == len(calls) and reason == "length"
    assert [(c["name"], c["arguments"]) for c in calls] == [
        (c.function.name, c.function.arguments) for c in whole.message.tool_calls]


# --- the tool choice contract: one call when named, whole calls only ----------------------------


ADD_QUESTION = [{"role": "user", "content": "What is 2 + 3?"}]


def whole_and_streamed(url: str, **kwargs) -> tuple[str | None, list[tuple[str, str]], str]:
    """(content, [(name, arguments)], finish_reason), the same whole and streamed."""
    whole = create(url, **kwargs).choices[0]
    calls = [(c.function.name, c.function.arguments) for c in whole.message.tool_calls or []]
    content, streamed_calls, reason = streamed(url, **kwargs)
    assert (content, [(c["name"], c["arguments"]) for c in streamed_calls], reason) == (
        whole.message.content or None, calls, whole.finish_reason)
    return whole.message.content or None, calls, whole.finish_reason


@pytest.mark.parametrize("fmt", FORMATS)
def test_named_choice_is_exactly_one_call(servers: dict[str, str], fmt: str) -> None:
    """OpenAI's contract for a named function, with parallel calls allowed (the default): the
    grammar ends after one call. SmolLM2 would repeat it until max_tokens (issue 19), the tiny
    models too where their marker is pushed."""
    named = {"type": "function", "function": {"name": "add"}}
    bias = {str(MARKER): 100} if fmt in ("hermes", "mistral") else None
    content, calls, reason = whole_and_streamed(servers[fmt], messages=ADD_QUESTION, tool_choice=named,
                                                max_tokens=64, logit_bias=bias)
    assert (content, len(calls), reason) == (None, 1, "tool_calls")
    check_call(*calls[0], "add")


def tokens_until_arguments(url: str, **kwargs) -> int:
    """How many tokens a reply takes to open its call's arguments object (greedy, so the same
    request writes the same tokens)."""
    whole = create(url, logprobs=True, **kwargs).choices[0]
    assert whole.finish_reason == "tool_calls"
    text = ""
    for i, token in enumerate(whole.logprobs.content):
        text += token.token
        if re.search(r'"(arguments|parameters)": ?\{', text):
            assert len(whole.logprobs.content) > i + 3, "the arguments need a few tokens to be cut inside"
            return i + 1
    raise AssertionError(f"no arguments in {text!r}")


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_call_cut_by_max_tokens_is_dropped(servers: dict[str, str], fmt: str) -> None:
    """A reply never carries arguments that do not parse: a call cut inside its arguments is not
    reported, whole or streamed, and the finish reason says the reply was cut."""
    url = servers[fmt]
    request = {"messages": ADD_QUESTION, "tools": [ADD], "tool_choice": "required", "parallel_tool_calls": False}
    cut = tokens_until_arguments(url, **request) + 2
    content, calls, reason = whole_and_streamed(url, max_tokens=cut, **request)
    assert (content, calls, reason) == (None, [], "length")


def test_every_choice_gets_its_calls(servers: dict[str, str]) -> None:
    choices = create(servers["hermes"], tool_choice="required", parallel_tool_calls=False, n=2).choices
    assert [c.index for c in choices] == [0, 1]
    ids = [c.message.tool_calls[0].id for c in choices]
    assert len(set(ids)) == 2
    for choice in choices:
        assert choice.finish_reason == "tool_calls"
        check_call(choice.message.tool_calls[0].function.name, choice.message.tool_calls[0].function.arguments)


@pytest.mark.parametrize("fmt,result_shown", [("hermes", "<tool_response>\nIt is 21 C in Paris.\n</tool_response>"),
                                              ("llama3", "ipython<|end_header_id|>\n\nIt is 21 C in Paris."),
                                              ("generic", "Result of get_weather (call call_")])
def test_round_trip(servers: dict[str, str], fmt: str, result_shown: str) -> None:
    """A call, its result sent back, a final answer: the assistant message goes back as the client
    received it (content null), and the template shows the result."""
    url = servers[fmt]
    first = create(url, tool_choice={"type": "function", "function": {"name": "get_weather"}},
                   parallel_tool_calls=False).choices[0].message
    call = first.tool_calls[0]
    messages = [*ASK, first.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": call.id, "content": "It is 21 C in Paris."}]
    assert result_shown in rendered(url, messages=messages, tools=TOOLS)
    final = create(url, messages=messages, tool_choice="none", max_tokens=24).choices[0]
    assert final.message.content and final.message.tool_calls is None


def test_history_with_arguments_that_are_not_json(servers: dict[str, str]) -> None:
    messages = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{Paris"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    for url in servers.values():
        assert create(url, messages=messages, max_tokens=4).choices[0].finish_reason in {"length", "stop", "tool_calls"}


class GetWeather(pydantic.BaseModel):
    """The weather in a city."""

    city: str = pydantic.Field(max_length=12)


def test_parse_with_a_strict_pydantic_tool(servers: dict[str, str]) -> None:
    for fmt in FORMATS:
        parsed = client(servers[fmt]).chat.completions.parse(
            model=MODEL, messages=ASK, tools=[openai.pydantic_function_tool(GetWeather)], tool_choice="required",
            parallel_tool_calls=False, temperature=0, max_tokens=200)
        call = parsed.choices[0].message.tool_calls[0]
        assert isinstance(call.function.parsed_arguments, GetWeather), fmt


# --- bad requests --------------------------------------------------------------------------------

BAD = {
    "tools-empty": ({"tools": []}, "tools"),
    "tool_choice-without-tools": ({"tool_choice": "auto"}, "tool_choice"),
    "tool_choice-unknown-string": ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    "named-not-among-tools": ({"tools": [ADD], "tool_choice": {"type": "function", "function": {"name": "rm"}}},
                              "tool_choice"),
    "allowed-not-among-tools": ({"tools": [ADD], "tool_choice": {"type": "allowed_tools", "allowed_tools": {
        "mode": "auto", "tools": [{"type": "function", "function": {"name": "rm"}}]}}}, "tool_choice"),
    "schema-not-expressible": ({"tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"$ref": "https://example.com/schema.json"}}}]}, "tools[0].function.parameters"),
    "tool-type-custom": ({"tools": [{"type": "custom", "custom": {"name": "f"}}]}, "tools[0].type"),
    "duplicate-names": ({"tools": [ADD, ADD]}, "tools[1].function.name"),
    "bad-name": ({"tools": [{"type": "function", "function": {"name": "add two"}}]}, "tools[0].function.name"),
    "legacy-functions": ({"functions": [{"name": "f"}]}, "functions"),
    "with-response_format": ({"tools": TOOLS, "response_format": {"type": "json_object"}}, "response_format"),
    "tool-message-without-id": ({"messages": [*ASK, {"role": "tool", "content": "x"}]}, "messages[1]"),
    "tool_calls-on-a-user-message": ({"messages": [{"role": "user", "content": "x", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "add", "arguments": "{}"}}]}]}, "messages[0]"),
}


@pytest.mark.parametrize("body,param", BAD.values(), ids=BAD.keys())
def test_bad_tool_request(servers: dict[str, str], body: dict, param: str) -> None:
    response = httpx.post(f"{servers['hermes']}/v1/chat/completions", json={"messages": ASK, **body}, timeout=30)
    assert_openai_error(response, param)

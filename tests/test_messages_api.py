"""`/v1/messages` and `/v1/messages/count_tokens` (Anthropic's Messages API) end to end with the
official `anthropic` SDK, raw `httpx` and LangChain's `ChatAnthropic`, against a real kvserve.

A message is served as the chat completion it translates to, so each greedy reply is checked
against /v1/chat/completions answering the same conversation: the same text, the same calls, the
same token counts. SmolLM2's template knows no tools, so its tool tests run the generic JSON mode;
a tiny random-weight model with a Hermes-style template runs the native one (exact only where the
grammar holds from the first token: `any` and a named tool)."""

from __future__ import annotations

import json
from typing import Iterator

import anthropic
import httpx
import jsonschema
import openai
import pydantic
import pytest
from anthropic.types import Message, RawMessageStreamEvent

from conftest import serve, served
from kvserve.reply import ReplyPlan
from kvserve.scheduler.request import Delta, FinishReason, RequestOutput, Usage
from kvserve.server.messages_api.events import MessageEvents, MessageHead
from kvserve.testing import read_metrics
from test_responses_api import named_events

MODEL = "any"
QUESTION = "What is 2+2?"
GREEDY = {"temperature": 0}  # the SDK sends sampling fields only as extra_body
ADD_SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
              "required": ["a", "b"]}
ADD = {"name": "add", "description": "Add two integers.", "input_schema": ADD_SCHEMA}
ADD_CHAT = {"type": "function", "function": {"name": "add", "description": "Add two integers.",
                                             "parameters": ADD_SCHEMA}}
STREAM_EVENT = pydantic.TypeAdapter(RawMessageStreamEvent)


@pytest.fixture(scope="module")
def client(base_url: str) -> Iterator[anthropic.Anthropic]:
    with anthropic.Anthropic(base_url=base_url, api_key="unused", max_retries=0, timeout=300) as c:
        yield c


def chat(base_url: str, messages: list[dict], **kwargs) -> openai.types.chat.ChatCompletion:
    with openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=300) as c:
        return c.chat.completions.create(model=MODEL, messages=messages, temperature=0, **kwargs)


def text_of(message: Message) -> str:
    return "".join(block.text for block in message.content if block.type == "text")


def stream_events(base_url: str, **body) -> list[dict]:
    """The events of a streamed message, each checked against the SDK's event types (ping, which
    the SDK skips, has none)."""
    events = list(named_events(f"{base_url}/v1/messages", {"model": MODEL, "stream": True, **GREEDY, **body}))
    for event in events:
        if event["type"] != "ping":
            STREAM_EVENT.validate_python(event)
    return events


def shape(events: list[dict]) -> list[str]:
    """The event sequence with runs of deltas to one block folded: `delta` once per run."""
    out: list[str] = []
    for e in events:
        kind = e["type"] if e["type"] != "content_block_delta" else f"delta:{e['delta']['type']}"
        if "index" in e:
            kind += f"@{e['index']}"
        if not out or out[-1] != kind or not kind.startswith("delta:"):
            out.append(kind)
    return out


# --- plain text ------------------------------------------------------------------------------------


@pytest.mark.parametrize("max_tokens,stop_reason", [(64, "end_turn"), (5, "max_tokens")])
def test_message_is_the_chat_answer(client: anthropic.Anthropic, base_url: str, max_tokens: int,
                                    stop_reason: str) -> None:
    system = "You are a helpful assistant."
    expected = chat(base_url, [{"role": "system", "content": system}, {"role": "user", "content": QUESTION}],
                    max_tokens=max_tokens)
    m = client.messages.create(model=MODEL, max_tokens=max_tokens, system=[{"type": "text", "text": system}],
                               messages=[{"role": "user", "content": [{"type": "text", "text": QUESTION}]}],
                               extra_body=GREEDY)
    assert (m.type, m.role, m.id[:4]) == ("message", "assistant", "msg_")
    assert [b.type for b in m.content] == ["text"] and text_of(m) == expected.choices[0].message.content
    assert {"stop": "end_turn", "length": "max_tokens"}[expected.choices[0].finish_reason] == m.stop_reason \
        == stop_reason and m.stop_sequence is None
    usage, prompt = m.usage, expected.usage.prompt_tokens
    assert usage.input_tokens + usage.cache_read_input_tokens == prompt and usage.cache_creation_input_tokens == 0
    assert usage.cache_read_input_tokens > 0  # the same prompt, just served to chat: attached from the cache
    assert usage.output_tokens == expected.usage.completion_tokens


def test_stop_sequence_ends_the_text_and_is_named(client: anthropic.Anthropic) -> None:
    ask = {"model": MODEL, "max_tokens": 40, "messages": [{"role": "user", "content": QUESTION}], "extra_body": GREEDY}
    whole = text_of(client.messages.create(**ask))
    word = whole.split()[2]
    m = client.messages.create(stop_sequences=["NEVER-SAID", word], **ask)
    assert (m.stop_reason, m.stop_sequence) == ("stop_sequence", word)
    assert text_of(m) == whole[:whole.index(word)]


def test_stream_is_anthropics_event_sequence(client: anthropic.Anthropic, base_url: str) -> None:
    body = {"max_tokens": 24, "messages": [{"role": "user", "content": QUESTION}]}
    events = stream_events(base_url, **body)
    assert shape(events) == ["message_start", "content_block_start@0", "ping", "delta:text_delta@0",
                             "content_block_stop@0", "message_delta", "message_stop"]
    start, delta = events[0]["message"], events[-2]
    whole = client.messages.create(model=MODEL, extra_body=GREEDY, **body)
    assert (start["content"], start["stop_reason"], start["usage"]["output_tokens"]) == ([], None, 0)
    assert start["usage"]["input_tokens"] == whole.usage.input_tokens + whole.usage.cache_read_input_tokens
    assert "".join(e["delta"]["text"] for e in events if e["type"] == "content_block_delta") == text_of(whole)
    assert delta["delta"] == {"stop_reason": whole.stop_reason, "stop_sequence": None}
    assert delta["usage"]["output_tokens"] == whole.usage.output_tokens
    # The SDK's own accumulation of the same stream gives the whole message.
    with client.messages.stream(model=MODEL, extra_body=GREEDY, **body) as stream:
        final = stream.get_final_message()
    assert (text_of(final), final.stop_reason, final.usage.output_tokens) == (
        text_of(whole), whole.stop_reason, whole.usage.output_tokens)


def test_events_of_odd_endings() -> None:
    """Built from scheduler outputs directly: a reply that said nothing still has a (empty) text
    block; a length stop short of max_tokens is the context running out; a stop string is named;
    a decode failure after the start ends the stream with an error event."""
    def sent(*outputs: RequestOutput) -> tuple[list[dict], MessageEvents]:
        events = MessageEvents(MessageHead(MODEL, input_tokens=7, max_tokens=10), ReplyPlan())
        return events.started() + [e for o in outputs for e in events.feed(o)], events

    usage = Usage(prompt_tokens=7, completion_tokens=1, cached_tokens=4, queue_seconds=0.0)
    empty, events = sent(RequestOutput("r", [Delta(0, "", finish_reason=FinishReason.STOP)], usage=usage))
    assert shape(empty) == ["message_start", "content_block_start@0", "ping", "content_block_stop@0",
                            "message_delta", "message_stop"]
    assert events.message["content"] == [{"type": "text", "text": ""}] and events.message["stop_reason"] == "end_turn"
    assert events.message["usage"] == {"input_tokens": 3, "output_tokens": 1, "cache_read_input_tokens": 4,
                                       "cache_creation_input_tokens": 0}
    _, events = sent(RequestOutput("r", [Delta(0, "Hi", finish_reason=FinishReason.LENGTH)], usage=usage))
    assert events.message["stop_reason"] == "model_context_window_exceeded"
    _, events = sent(RequestOutput("r", [Delta(0, "Hi", finish_reason=FinishReason.STOP, stop_sequence="!")],
                                   usage=usage))
    assert (events.message["stop_reason"], events.message["stop_sequence"]) == ("stop_sequence", "!")
    failed, _ = sent(RequestOutput("r", [Delta(0, "Hel")]), RequestOutput("r", [], error="llama_decode failed"))
    assert shape(failed) == ["message_start", "content_block_start@0", "ping", "delta:text_delta@0", "error"]
    assert failed[-1] == {"type": "error", "error": {"type": "api_error", "message": "llama_decode failed"}}
    for event in failed[:-1]:
        if event["type"] != "ping":
            STREAM_EVENT.validate_python(event)


# --- tools ---------------------------------------------------------------------------------------


def test_tool_round_trip_is_the_chat_round_trip(client: anthropic.Anthropic, base_url: str) -> None:
    """A named tool on a template that knows no tools (the generic mode), one call at a time: the
    call, then its tool_result answered in text (tool_choice none: SmolLM2 under auto may call
    again), each as chat completions serves the same turn."""
    ask = [{"role": "user", "content": "Use the tool to add 2 and 3."}]
    before = read_metrics(base_url).value("kvserve_request_success_total", finish_reason="tool_calls")
    m = client.messages.create(model=MODEL, max_tokens=80, messages=ask, tools=[ADD], extra_body=GREEDY,
                               tool_choice={"type": "tool", "name": "add", "disable_parallel_tool_use": True})
    expected = chat(base_url, ask, max_tokens=80, tools=[ADD_CHAT], parallel_tool_calls=False,
                    tool_choice={"type": "function", "function": {"name": "add"}})
    assert m.stop_reason == "tool_use" and expected.choices[0].finish_reason == "tool_calls"
    [call] = [b for b in m.content if b.type == "tool_use"]
    [chat_call] = expected.choices[0].message.tool_calls
    assert (call.name, call.input) == ("add", json.loads(chat_call.function.arguments))
    jsonschema.validate(call.input, ADD_SCHEMA)
    after = read_metrics(base_url).value("kvserve_request_success_total", finish_reason="tool_calls")
    assert after - before == 2  # the metrics count the message as the chat reply: tool_calls

    result = str(call.input["a"] + call.input["b"])
    history = [*ask, {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in m.content]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": result}]}]
    answer = client.messages.create(model=MODEL, max_tokens=60, messages=history, tools=[ADD], extra_body=GREEDY,
                                    tool_choice={"type": "none"})
    chat_history = [*ask, {"role": "assistant", "content": None, "tool_calls": [
        {"id": call.id, "type": "function", "function": {"name": "add", "arguments": json.dumps(call.input)}}]},
        {"role": "tool", "tool_call_id": call.id, "content": result}]
    expected = chat(base_url, chat_history, max_tokens=60, tools=[ADD_CHAT], tool_choice="none")
    assert [b.type for b in answer.content] == ["text"] and answer.stop_reason in ("end_turn", "max_tokens")
    assert text_of(answer) and text_of(answer) == expected.choices[0].message.content


def test_streamed_call_is_the_whole_call(client: anthropic.Anthropic, base_url: str) -> None:
    body = {"max_tokens": 80, "tools": [ADD], "messages": [{"role": "user", "content": "Add 2 and 3."}],
            "tool_choice": {"type": "any", "disable_parallel_tool_use": True}}
    events = stream_events(base_url, **body)
    assert shape(events) == ["message_start", "content_block_start@0", "ping", "delta:input_json_delta@0",
                             "content_block_stop@0", "message_delta", "message_stop"]
    block = events[1]["content_block"]
    whole = client.messages.create(model=MODEL, extra_body=GREEDY, **body)
    [call] = whole.content
    assert (block["type"], block["name"], block["input"]) == ("tool_use", "add", {})
    arguments = "".join(e["delta"]["partial_json"] for e in events if e["type"] == "content_block_delta")
    assert json.loads(arguments) == call.input and events[-2]["delta"]["stop_reason"] == "tool_use"


@pytest.fixture(scope="module")
def hermes_url(tiny) -> Iterator[str]:
    with serve(tiny("llama", "hermes"), threads=1) as url:
        yield url


@pytest.mark.parametrize("choice", [{"type": "any"}, {"type": "tool", "name": "add"}])
def test_native_template_calls_a_tool(hermes_url: str, choice: dict) -> None:
    """Random weights, a Hermes-style template: the grammar holds from the first token, so the
    reply is exactly one valid call whatever the weights."""
    with anthropic.Anthropic(base_url=hermes_url, api_key="unused", max_retries=0) as c:
        m = c.messages.create(model=MODEL, max_tokens=120, tools=[ADD], extra_body=GREEDY,
                              tool_choice={**choice, "disable_parallel_tool_use": True},
                              messages=[{"role": "user", "content": "Add 2 and 3."}])
    assert m.stop_reason == "tool_use" and [b.type for b in m.content] == ["tool_use"]
    assert m.content[0].name == "add"
    jsonschema.validate(m.content[0].input, ADD_SCHEMA)


# --- count_tokens ----------------------------------------------------------------------------------


@pytest.mark.parametrize("tools", [False, True])
def test_count_tokens_is_the_served_prompt(client: anthropic.Anthropic, tools: bool) -> None:
    body = {"model": MODEL, "system": "Be brief.", "messages": [{"role": "user", "content": QUESTION}],
            **({"tools": [ADD]} if tools else {})}
    counted = client.messages.count_tokens(**body).input_tokens
    served = client.messages.create(max_tokens=1, extra_body=GREEDY, **body).usage
    assert counted == served.input_tokens + served.cache_read_input_tokens > 0


# --- errors ----------------------------------------------------------------------------------------


def assert_anthropic_error(response: httpx.Response, status: int, kind: str) -> str:
    """Anthropic's error shape, exactly; returns the message."""
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"type", "error"} and body["type"] == "error"
    assert set(body["error"]) == {"type", "message"} and body["error"]["type"] == kind
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    return body["error"]["message"]


ASK = {"model": MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
BAD = {
    "max-tokens-0": ({**ASK, "max_tokens": 0}, "max_tokens"),
    "no-max-tokens": ({"messages": ASK["messages"]}, "max_tokens"),
    "no-messages": ({**ASK, "messages": []}, "messages"),
    "image": ({**ASK, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "text only"),
    "tool-use-from-user": ({**ASK, "messages": [{"role": "user", "content": [
        {"type": "tool_use", "id": "t", "name": "add", "input": {}}]}]}, "assistant"),
    "server-tool": ({**ASK, "tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "client tools"),
    "tool-name": ({**ASK, "tools": [{**ADD, "name": "add two"}]}, "tools[0].name"),
    "tool-schema": ({**ASK, "tools": [{**ADD, "input_schema": {"type": "object", "properties": {
        "a": {"$ref": "#/nowhere"}}}}]}, "tools[0].input_schema"),
    "choice-not-a-tool": ({**ASK, "tools": [ADD], "tool_choice": {"type": "tool", "name": "nope"}}, "nope"),
    "choice-without-tools": ({**ASK, "tool_choice": {"type": "any"}}, "tools"),
    "choice-type": ({**ASK, "tools": [ADD], "tool_choice": {"type": "required"}}, "auto, any, tool or none"),
    "temperature": ({**ASK, "temperature": 1.5}, "temperature"),
    "too-many-stops": ({**ASK, "stop_sequences": [str(i) for i in range(17)]}, "stop_sequences"),
    "too-long": ({**ASK, "messages": [{"role": "user", "content": "hi " * 20000}]}, "maximum context length"),
    "not-json": ("{", "JSON"),
}


@pytest.mark.parametrize("body,says", BAD.values(), ids=BAD.keys())
def test_bad_request(base_url: str, body: dict | str, says: str) -> None:
    sent = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, str) \
        else {"json": body}
    message = assert_anthropic_error(httpx.post(f"{base_url}/v1/messages", timeout=60, **sent), 400,
                                     "invalid_request_error")
    assert says in message


def test_sdk_raises_its_own_errors(client: anthropic.Anthropic, base_url: str) -> None:
    with pytest.raises(anthropic.BadRequestError) as bad:
        client.messages.create(model=MODEL, max_tokens=0, messages=[{"role": "user", "content": "hi"}])
    assert bad.value.status_code == 400 and bad.value.body["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.BadRequestError):  # refused before any event: a status, not a broken stream
        client.messages.create(model=MODEL, max_tokens=8, stream=True, messages=[{"role": "user", "content": ""}],
                               tools=[ADD], tool_choice={"type": "tool", "name": "nope"})
    assert_anthropic_error(httpx.get(f"{base_url}/v1/messages/nope"), 404, "not_found_error")
    assert_anthropic_error(httpx.post(f"{base_url}/v1/messages/count_tokens", json={"messages": "x"}), 400,
                           "invalid_request_error")


def test_keys_errors_and_overload_in_anthropics_shape(tiny) -> None:
    with served(tiny("llama"), threads=1, api_key="s3cret", max_body_mb=0.01) as (url, app):
        for key in ("s3cret", None):  # x-api-key (Anthropic's clients) or a bearer token (OpenAI's)
            with anthropic.Anthropic(base_url=url, api_key=key, auth_token=None if key else "s3cret",
                                     max_retries=0) as c:
                assert c.messages.create(**ASK).usage.output_tokens >= 1
        with anthropic.Anthropic(base_url=url, api_key="wrong", max_retries=0) as c:
            with pytest.raises(anthropic.AuthenticationError):
                c.messages.create(**ASK)
        key = {"x-api-key": "s3cret"}
        assert_anthropic_error(httpx.post(f"{url}/v1/messages", json=ASK), 401, "authentication_error")
        big = {**ASK, "messages": [{"role": "user", "content": "x" * 20_000}]}
        assert_anthropic_error(httpx.post(f"{url}/v1/messages", json=big, headers=key), 413, "request_too_large")
        app.state.draining = True
        try:
            assert_anthropic_error(httpx.post(f"{url}/v1/messages", json=ASK, headers=key), 503, "overloaded_error")
        finally:
            app.state.draining = False
        # The OpenAI routes keep OpenAI's shape.
        assert set(httpx.post(f"{url}/v1/chat/completions", json={}).json()) == {"error"}


# --- an agent framework ----------------------------------------------------------------------------


def test_langchain_chat_anthropic(base_url: str) -> None:
    """LangChain's ChatAnthropic pointed at kvserve: a plain answer (the chat answer), then a tool
    call it reads into `tool_calls` and a ToolMessage it sends back as a tool_result."""
    from langchain_anthropic import ChatAnthropic
    from langchain_core.messages import HumanMessage, ToolMessage

    llm = ChatAnthropic(model=MODEL, base_url=base_url, api_key="unused", temperature=0, max_tokens=32,
                        max_retries=0)
    reply = llm.invoke(QUESTION)
    assert reply.content == chat(base_url, [{"role": "user", "content": QUESTION}], max_tokens=32).choices[0] \
        .message.content
    assert reply.usage_metadata["input_tokens"] > 0

    ask = HumanMessage("Use the tool to add 2 and 3.")
    tooled = llm.bind_tools([ADD], tool_choice="add", parallel_tool_calls=False)
    called = tooled.invoke([ask])
    [call] = called.tool_calls
    assert call["name"] == "add" and called.response_metadata["stop_reason"] == "tool_use"
    jsonschema.validate(call["args"], ADD_SCHEMA)
    result = str(call["args"]["a"] + call["args"]["b"])
    answer = llm.bind_tools([ADD], tool_choice={"type": "none"}).invoke(
        [ask, called, ToolMessage(result, tool_call_id=call["id"])])
    expected = chat(base_url, [{"role": "user", "content": ask.content}, {"role": "assistant", "content": None,
                    "tool_calls": [{"id": call["id"], "type": "function",
                                    "function": {"name": "add", "arguments": json.dumps(call["args"])}}]},
                    {"role": "tool", "tool_call_id": call["id"], "content": result}],
                    max_tokens=32, tools=[ADD_CHAT], tool_choice="none")
    assert answer.text and answer.text == expected.choices[0].message.content and not answer.tool_calls

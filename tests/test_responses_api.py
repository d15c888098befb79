"""`/v1/responses` end to end with the official `openai` client and raw `httpx` against a real
kvserve serving SmolLM2: whole and streamed responses (every event checked against the SDK's own
types), continuations through `previous_response_id` that attach from the prefix cache, the store
(GET, DELETE, `store: false`), structured output, and the 400s and 404s. Greedy prompts are the
chat tests' MATH prompt, picked there for a clear margin at every step."""

from __future__ import annotations

import json
from typing import Iterator, get_args

import httpx
import openai
import pydantic
import pytest
from openai.types.responses import Response, ResponseStreamEvent

from conftest import serve
from kvserve.reply import ReplyPlan
from kvserve.scheduler.request import Delta, RequestOutput
from kvserve.server.responses_api.bodies import ResponseHead
from kvserve.server.responses_api.events import ResponseEvents
from kvserve.server.responses_api.input_items import input_items, page
from kvserve.server.responses_api.schemas import CreateResponse, MessageItem
from kvserve.server.responses_api.store import StoredResponse
from kvserve.server.responses_api.to_chat import chat_request
from test_openai_api import assert_openai_error

MODEL = "smollm2"
QUESTION = "What is 2+2?"
EVENT_TYPES = {get_args(c.model_fields["type"].annotation)[0]: c for c in get_args(get_args(ResponseStreamEvent)[0])}


@pytest.fixture(scope="module")
def client(base_url: str) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=120) as c:
        yield c


def create(base_url: str, **body) -> dict:
    """A whole response as raw JSON, checked against the SDK's `Response` type field by field."""
    r = httpx.post(f"{base_url}/v1/responses", json={"model": MODEL, **body}, timeout=120)
    assert r.status_code == 200, r.text
    Response.model_validate(r.json())
    return r.json()


def named_events(url: str, body: dict) -> Iterator[dict]:
    """The SSE events `url` streams for `body`; the `event:` line of each must name the type its
    data carries (the Responses and Messages APIs' form)."""
    with httpx.stream("POST", url, json=body, timeout=300) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        name = None
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line.removeprefix("event: ")
            elif line.startswith("data: "):
                event = json.loads(line.removeprefix("data: "))
                assert event["type"] == name
                yield event


def stream_events(base_url: str, **body) -> list[dict]:
    """The events of a streamed response, each checked against its SDK event type."""
    events = list(named_events(f"{base_url}/v1/responses", {"model": MODEL, "stream": True, **body}))
    for event in events:
        EVENT_TYPES[event["type"]].model_validate(event)
    return events


def text_of(response: dict) -> str:
    return "".join(part["text"] for item in response["output"] for part in item["content"])


# --- whole and streamed ----------------------------------------------------------------------------


def test_whole_response_is_the_chat_answer(client: openai.OpenAI, base_url: str) -> None:
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": QUESTION}],
                                          temperature=0, max_tokens=24)
    r = create(base_url, input=QUESTION, temperature=0, max_output_tokens=24, metadata={"run": "a"})
    assert r["id"].startswith("resp_") and r["object"] == "response" and r["status"] == "completed"
    assert r["model"] == client.models.list().data[0].id and r["metadata"] == {"run": "a"}
    [item] = r["output"]
    assert item["type"] == "message" and item["role"] == "assistant" and item["status"] == "completed"
    assert item["id"].startswith("msg_")
    assert text_of(r) == chat.choices[0].message.content and chat.choices[0].finish_reason == "stop"
    usage = r["usage"]
    assert usage["input_tokens"] == chat.usage.prompt_tokens
    assert usage["output_tokens"] == chat.usage.completion_tokens
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]
    # The same prompt a second time: its full pages come from the prefix cache.
    assert usage["input_tokens_details"]["cached_tokens"] > 0
    assert client.responses.create(model=MODEL, input=QUESTION, temperature=0).output_text == text_of(r)


def test_stream_events_come_in_the_documented_order(base_url: str) -> None:
    whole = create(base_url, input=QUESTION, temperature=0, max_output_tokens=24)
    events = stream_events(base_url, input=QUESTION, temperature=0, max_output_tokens=24)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    kinds = [e["type"] for e in events]
    deltas = kinds.count("response.output_text.delta")
    assert deltas > 1
    assert kinds == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        *["response.output_text.delta"] * deltas,
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.completed",
    ]
    created, final = events[0]["response"], events[-1]["response"]
    assert created["status"] == "in_progress" and created["output"] == [] and created["id"] == final["id"]
    item_id = events[2]["item"]["id"]
    for event in events[2:-1]:
        assert event["output_index"] == 0 and event.get("item_id", event.get("item", {}).get("id")) == item_id
        assert event.get("content_index", 0) == 0
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert text == events[-4]["text"] == events[-3]["part"]["text"] == text_of(final) == text_of(whole)
    assert final["output"] == [events[-2]["item"]]
    assert final["usage"]["output_tokens"] == whole["usage"]["output_tokens"]


def test_sdk_stream_helper_accumulates_the_final_response(client: openai.OpenAI, base_url: str) -> None:
    """The SDK's stream manager rebuilds the response from the events and checks their indexes."""
    with client.responses.stream(model=MODEL, input=QUESTION, temperature=0, max_output_tokens=24) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert final.status == "completed" and final.output_text == "".join(deltas)
    assert final.output_text == create(base_url, input=QUESTION, temperature=0, max_output_tokens=24)["output"][0][
        "content"][0]["text"]
    streamed = list(client.responses.create(model=MODEL, input=QUESTION, temperature=0, stream=True))
    assert streamed[-1].type == "response.completed" and streamed[-1].response.output_text == final.output_text


def test_max_output_tokens_makes_an_incomplete_response(base_url: str) -> None:
    r = create(base_url, input=QUESTION, temperature=0, max_output_tokens=3)
    assert r["status"] == "incomplete" and r["incomplete_details"] == {"reason": "max_output_tokens"}
    assert r["output"][0]["status"] == "incomplete" and r["usage"]["output_tokens"] == 3
    events = stream_events(base_url, input=QUESTION, temperature=0, max_output_tokens=3)
    assert events[-1]["type"] == "response.incomplete"
    assert events[-2]["type"] == "response.output_item.done" and events[-2]["item"]["status"] == "incomplete"
    assert text_of(events[-1]["response"]) == text_of(r)


def test_instructions_are_the_system_message(client: openai.OpenAI, base_url: str) -> None:
    system = "You answer in French."
    chat = client.chat.completions.create(model=MODEL, temperature=0, max_tokens=12, messages=[
        {"role": "system", "content": system}, {"role": "user", "content": QUESTION}])
    r = create(base_url, instructions=system, input=[{"role": "user", "content": [
        {"type": "input_text", "text": QUESTION}]}], temperature=0, max_output_tokens=12)
    assert r["instructions"] == system
    assert r["usage"]["input_tokens"] == chat.usage.prompt_tokens and text_of(r) == chat.choices[0].message.content


def test_penalties_are_served_as_in_chat(base_url: str) -> None:
    poem, penalties = "Write a poem about the sea.", {"frequency_penalty": 1.5, "presence_penalty": 1.0}
    chat = chat_request(CreateResponse(input=poem, **penalties), [])
    assert (chat.frequency_penalty, chat.presence_penalty) == (1.5, 1.0)
    penalized = create(base_url, input=poem, temperature=0, max_output_tokens=24, **penalties)
    assert text_of(penalized) != text_of(create(base_url, input=poem, temperature=0, max_output_tokens=24))


def test_logprobs_on_request(base_url: str) -> None:
    r = create(base_url, input=QUESTION, temperature=0, max_output_tokens=5,
               include=["message.output_text.logprobs"], top_logprobs=2)
    logprobs = r["output"][0]["content"][0]["logprobs"]
    assert len(logprobs) == r["usage"]["output_tokens"] == 5
    assert "".join(lp["token"] for lp in logprobs) == text_of(r)
    assert all(len(lp["top_logprobs"]) == 2 and lp["logprob"] == lp["top_logprobs"][0]["logprob"] for lp in logprobs)
    assert create(base_url, input=QUESTION, max_output_tokens=2)["output"][0]["content"][0]["logprobs"] == []


def test_logprobs_of_split_characters_are_their_own_bytes(base_url: str) -> None:
    """你 and 好 come as two tokens each: their `bytes` join into the text, and `token` writes the
    part of a character as OpenAI does ("\\xe4\\xbd"), never as U+FFFD; streamed as whole."""
    body = dict(input="What is 你好 in English?", temperature=0, max_output_tokens=10,
                include=["message.output_text.logprobs"], top_logprobs=2)
    r = create(base_url, **body)
    logprobs = r["output"][0]["content"][0]["logprobs"]
    assert "你好" in text_of(r) and b"".join(bytes(lp["bytes"]) for lp in logprobs).decode() == text_of(r)
    assert "\\xe4\\xbd" in [lp["token"] for lp in logprobs]
    for lp in [*logprobs, *(top for lp in logprobs for top in lp["top_logprobs"])]:
        assert lp["token"] == bytes(lp["bytes"]).decode(errors="backslashreplace") and "\ufffd" not in lp["token"]
    deltas = [e for e in stream_events(base_url, **body) if e["type"] == "response.output_text.delta"]
    assert [lp["token"] for e in deltas for lp in e["logprobs"]] == [lp["token"] for lp in logprobs]


def test_json_schema_format_is_enforced(client: openai.OpenAI) -> None:
    class Verdict(pydantic.BaseModel):
        correct: bool

    parsed = client.responses.parse(model=MODEL, input="Is 2+2=4? Answer in JSON.", text_format=Verdict,
                                    temperature=0, max_output_tokens=24)
    assert parsed.status == "completed" and isinstance(parsed.output_parsed, Verdict)
    assert parsed.text.format.type == "json_schema"


def test_a_failure_mid_stream_closes_the_item_then_fails_the_response() -> None:
    events = ResponseEvents(ResponseHead(CreateResponse(input="hi"), MODEL), logprobs=None, reply=ReplyPlan())
    sent = events.started() + events.feed(RequestOutput("r", [Delta(0, "Hel")])) + events.feed(
        RequestOutput("r", [], error="llama_decode failed"))
    for event in sent:
        EVENT_TYPES[event["type"]].model_validate(event)
    assert [e["type"] for e in sent] == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.done", "response.content_part.done",
        "response.output_item.done", "response.failed"]
    failed = sent[-1]["response"]
    assert failed == events.final and failed["status"] == "failed"
    assert failed["error"] == {"code": "server_error", "message": "llama_decode failed"}
    assert failed["output"][0]["status"] == "incomplete" and text_of(failed) == "Hel"


# --- continuations and the store ----------------------------------------------------------------


def test_continuation_attaches_the_earlier_turn_from_the_prefix_cache(client: openai.OpenAI, base_url: str) -> None:
    page_rows = httpx.get(f"{base_url}/server_info").json()["cache"]["page_rows"]
    first = client.responses.create(model=MODEL, input="Name a color.", temperature=0, max_output_tokens=16)
    second = client.responses.create(model=MODEL, input="Name another one.", previous_response_id=first.id,
                                     temperature=0, max_output_tokens=16)
    assert second.previous_response_id == first.id
    # The continuation is the whole conversation, rendered as a client sending it all would have it.
    spelled_out = client.responses.create(model=MODEL, temperature=0, max_output_tokens=16, input=[
        {"role": "user", "content": "Name a color."},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "Name another one."}])
    assert second.usage.input_tokens == spelled_out.usage.input_tokens
    assert second.output_text == spelled_out.output_text
    # What the first response served (its prompt and all but its last token, never evaluated) is a
    # prefix of the continuation; every full page of it attaches from the cache.
    served = first.usage.input_tokens + first.usage.output_tokens - 1
    assert second.usage.input_tokens_details.cached_tokens >= served // page_rows * page_rows > 0


def test_continuation_resumes_from_a_checkpoint_on_a_model_that_carries_state(tiny) -> None:
    """Mamba keeps no KV pages to share: the continuation resumes from a checkpoint, at the latest
    the one where the first turn's input closed, before the assistant's opening."""
    with serve(tiny("mamba"), threads=1, ctx_size=1024, parallel=2) as url:
        first = create(url, input="Name a color.", temperature=0, max_output_tokens=8)
        second = create(url, input="Another one?", previous_response_id=first["id"], temperature=0,
                        max_output_tokens=8)
        opening = httpx.post(f"{url}/tokenize", json={"prompt": "<|im_start|>assistant\n"}).json()["count"]
    close = first["usage"]["input_tokens"] - opening
    assert second["usage"]["input_tokens_details"]["cached_tokens"] >= close > 0


def test_store_get_delete(client: openai.OpenAI, base_url: str) -> None:
    r = create(base_url, input=QUESTION, max_output_tokens=4)
    assert client.responses.retrieve(r["id"]).model_dump(exclude_unset=True) == Response.model_validate(
        r).model_dump(exclude_unset=True)
    assert httpx.get(f"{base_url}/v1/responses/{r['id']}").json() == r
    assert httpx.delete(f"{base_url}/v1/responses/{r['id']}").json() == {"id": r["id"], "object": "response",
                                                                           "deleted": True}
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r["id"])
    assert_openai_error(httpx.delete(f"{base_url}/v1/responses/{r['id']}"), None, status=404)
    error = assert_openai_error(httpx.post(f"{base_url}/v1/responses", json={
        "input": "and then?", "previous_response_id": r["id"]}), "previous_response_id", status=404)
    assert r["id"] in error["message"]


def test_input_items_are_the_whole_conversation_a_response_saw(client: openai.OpenAI, base_url: str) -> None:
    """OpenAI's list of input items: a continuation's are the earlier turns (their input and output,
    output items under the ids they were answered with) then its own input; newest first by default."""
    first = client.responses.create(model=MODEL, max_output_tokens=4, instructions="Be brief.", input=[
        {"role": "developer", "content": "Answer in English."},
        {"role": "user", "content": [{"type": "input_text", "text": "Name a color."}]}])
    second = client.responses.create(model=MODEL, input="Another one?", previous_response_id=first.id,
                                     max_output_tokens=4)
    listed = client.responses.input_items.list(second.id)
    assert [(item.type, item.role) for item in listed.data] == [
        ("message", "user"), ("message", "assistant"), ("message", "user"), ("message", "developer")]
    assert listed.data[1].id == first.output[0].id and listed.data[1].content[0].text == first.output_text
    assert listed.data[0].content[0].text == "Another one?" and listed.data[3].content[0].text == "Answer in English."
    assert len({item.id for item in listed.data}) == 4 and all(item.status == "completed" for item in listed.data)
    raw = httpx.get(f"{base_url}/v1/responses/{second.id}/input_items").json()
    assert raw["object"] == "list" and raw["has_more"] is False
    assert (raw["first_id"], raw["last_id"]) == (listed.data[0].id, listed.data[-1].id)
    # The SDK pages through them by `after`, one at a time, in either order.
    assert [item.id for item in client.responses.input_items.list(second.id, order="asc", limit=1)] == [
        item.id for item in reversed(listed.data)]
    page = client.responses.input_items.list(second.id, limit=2, after=listed.data[0].id,
                                             include=["message.output_text.logprobs"])
    assert [item.id for item in page.data] == [item.id for item in listed.data[1:3]] and page.has_more
    # The first response's own listing is its input alone: never its output, nor its instructions.
    assert [item.id for item in client.responses.input_items.list(first.id)] == [item.id for item in listed.data[2:]]


@pytest.mark.parametrize("query,param", [
    ("limit=0", "limit"), ("limit=101", "limit"), ("limit=ten", "limit"), ("order=newest", "order"),
    ("after=msg_nowhere", "after"), ("before=msg_nowhere", "before"), ("include=everything", "include[0]"),
])
def test_bad_input_items_query(client: openai.OpenAI, base_url: str, query: str, param: str) -> None:
    r = client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=2)
    assert_openai_error(httpx.get(f"{base_url}/v1/responses/{r.id}/input_items?{query}"), param)


def test_input_items_and_cancel_of_an_unknown_response_are_404s(client: openai.OpenAI, base_url: str) -> None:
    for call in (client.responses.input_items.list, client.responses.cancel):
        with pytest.raises(openai.NotFoundError) as caught:
            call("resp_nowhere")
        assert "resp_nowhere" in caught.value.body["message"]
    assert_openai_error(httpx.get(f"{base_url}/v1/responses/resp_nowhere/input_items"), None, status=404)
    assert_openai_error(httpx.post(f"{base_url}/v1/responses/resp_nowhere/cancel"), None, status=404)


def test_cancel_refuses_a_response_that_did_not_run_in_the_background(client: openai.OpenAI, base_url: str) -> None:
    r = client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=2)
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.cancel(r.id)
    assert "background" in caught.value.body["message"]
    assert_openai_error(httpx.post(f"{base_url}/v1/responses/{r.id}/cancel"), None)
    assert client.responses.retrieve(r.id).status == r.status  # refused, so untouched


@pytest.mark.parametrize("order,limit,after,before,expect,has_more", [
    ("asc", 2, None, None, "ab", True),
    ("desc", 2, None, None, "ed", True),
    ("asc", 2, "b", None, "cd", True),
    ("asc", 2, None, "d", "bc", True),
    ("asc", 5, None, "c", "ab", False),
    ("desc", 5, "d", "a", "cb", False),
    ("asc", 9, "e", None, "", False),
])
def test_a_page_of_input_items(order, limit, after, before, expect: str, has_more: bool) -> None:
    items = [{"id": name} for name in "abcde"]
    listed = page(items, order, limit, after, before)
    assert "".join(item["id"] for item in listed["data"]) == expect and listed["has_more"] is has_more
    assert (listed["first_id"], listed["last_id"]) == ((expect[0], expect[-1]) if expect else (None, None))


def test_a_response_stored_without_item_ids_lists_stable_ones() -> None:
    """A store written before items kept their ids lists ids made of the response's and the place."""
    stored = StoredResponse({"id": "resp_1", "output": []}, [MessageItem(role="user", content="hi")], 0, 0.0)
    assert input_items(stored) == [{"id": "msg_1_0", "type": "message", "role": "user", "status": "completed",
                                    "content": [{"type": "input_text", "text": "hi"}]}]


def test_store_false_keeps_nothing(base_url: str) -> None:
    r = create(base_url, input=QUESTION, max_output_tokens=4, store=False)
    assert r["store"] is False
    assert_openai_error(httpx.get(f"{base_url}/v1/responses/{r['id']}"), None, status=404)
    events = stream_events(base_url, input=QUESTION, max_output_tokens=4, store=False)
    assert_openai_error(httpx.get(f"{base_url}/v1/responses/{events[-1]['response']['id']}"), None, status=404)
    streamed = stream_events(base_url, input=QUESTION, max_output_tokens=4)  # stored by default, streamed too
    assert httpx.get(f"{base_url}/v1/responses/{streamed[-1]['response']['id']}").json() == streamed[-1]["response"]


# --- function tools (SmolLM2's template knows no tools: the generic JSON mode) ------------------------


WEATHER = {"type": "function", "name": "get_weather", "description": "The current weather in a city", "strict": True,
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                          "additionalProperties": False}}
TIME = {"type": "function", "name": "get_time", "description": "The local time in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
ASK = "What is the weather in Paris?"


def calls_of(response: dict) -> list[tuple[str, dict]]:
    calls = [item for item in response["output"] if item["type"] == "function_call"]
    for call in calls:
        assert call["id"].startswith("fc_") and call["call_id"].startswith("call_") and call["status"] == "completed"
    return [(call["name"], json.loads(call["arguments"])) for call in calls]


@pytest.mark.parametrize("choice,names", [
    ("required", {"get_weather", "get_time"}),
    ({"type": "function", "name": "get_time"}, {"get_time"}),
    ({"type": "allowed_tools", "mode": "required", "tools": [{"type": "function", "name": "get_time"}]}, {"get_time"}),
], ids=["required", "named", "allowed_tools"])
def test_a_required_choice_is_a_valid_call(base_url: str, choice, names: set[str]) -> None:
    r = create(base_url, input=ASK, tools=[WEATHER, TIME], tool_choice=choice, temperature=0, max_output_tokens=60)
    assert r["status"] == "completed" and r["tool_choice"] == choice and len(r["tools"]) == 2
    calls = calls_of(r)
    assert calls and all(name in names and isinstance(args.get("city"), str) for name, args in calls)
    assert all(item["type"] == "function_call" for item in r["output"])  # no text beside a required call


def test_parallel_tool_calls_false_makes_one_call(base_url: str) -> None:
    r = create(base_url, input="Weather and time in Paris and Rome?", tools=[WEATHER, TIME], tool_choice="required",
               parallel_tool_calls=False, temperature=0, max_output_tokens=80)
    assert len(calls_of(r)) == 1 and r["parallel_tool_calls"] is False


def test_tool_choice_none_answers_in_text(base_url: str) -> None:
    r = create(base_url, input=ASK, tools=[WEATHER], tool_choice="none", temperature=0, max_output_tokens=12)
    assert [item["type"] for item in r["output"]] == ["message"] and text_of(r)


def test_streamed_call_events(base_url: str) -> None:
    body = dict(input=ASK, tools=[WEATHER, TIME], tool_choice={"type": "function", "name": "get_weather"},
                temperature=0, max_output_tokens=60)
    whole = create(base_url, **body)
    events = stream_events(base_url, **body)
    kinds = [e["type"] for e in events]
    deltas = kinds.count("response.function_call_arguments.delta")  # a call's arguments come once it is whole
    assert deltas >= 1 and [e["sequence_number"] for e in events] == list(range(len(events)))
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     *["response.function_call_arguments.delta"] * deltas,
                     "response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    added, done, final = events[2]["item"], events[-2]["item"], events[-1]["response"]
    assert added["type"] == "function_call" and added["status"] == "in_progress" and added["arguments"] == ""
    assert (added["id"], added["call_id"], added["name"]) == (done["id"], done["call_id"], done["name"])
    arguments = "".join(e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta")
    assert arguments == events[-3]["arguments"] == done["arguments"] and final["output"] == [done]
    assert all(e["item_id"] == added["id"] and e["output_index"] == 0 for e in events[3:-2])
    assert calls_of(final) == calls_of(whole) == [("get_weather", json.loads(arguments))]


def test_call_result_continuation(client: openai.OpenAI) -> None:
    """The SDK's round trip: a forced call, its output sent back through previous_response_id, an answer."""
    first = client.responses.create(model=MODEL, input=ASK, tools=[WEATHER], tool_choice="required", temperature=0,
                                    max_output_tokens=60)
    [call] = first.output
    assert call.type == "function_call" and call.name == "get_weather"
    second = client.responses.create(model=MODEL, previous_response_id=first.id, tools=[WEATHER], tool_choice="none",
                                     input=[{"type": "function_call_output", "call_id": call.call_id,
                                             "output": "Sunny, 21 C"}], temperature=0, max_output_tokens=24)
    assert second.output[0].type == "message" and second.output_text
    spelled_out = client.responses.create(model=MODEL, tools=[WEATHER], tool_choice="none", temperature=0,
                                          max_output_tokens=24, input=[
        {"role": "user", "content": ASK},
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 C"}])
    assert second.usage.input_tokens == spelled_out.usage.input_tokens and second.output_text == spelled_out.output_text
    listed = client.responses.input_items.list(second.id, order="asc").data
    assert [item.type for item in listed] == ["message", "function_call", "function_call_output"]
    assert (listed[1].id, listed[1].call_id, listed[2].call_id, listed[2].output) == (
        call.id, call.call_id, call.call_id, "Sunny, 21 C")
    assert second.usage.input_tokens_details.cached_tokens > 0


# --- errors --------------------------------------------------------------------------------------


BAD = {
    "hosted-tool": ({"input": "hi", "tools": [{"type": "web_search_preview"}]}, "tools", "web_search_preview"),
    "image": ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
              "input[0].content[0]", "text only"),
    "item-type": ({"input": [{"type": "web_search_call", "id": "w"}]}, "input[0]", "input items"),
    "reasoning-only": ({"input": [{"type": "reasoning", "id": "r", "summary": []}]}, "input", "empty"),
    "no-role": ({"input": [{"type": "message", "content": "hi"}]}, "input[0].role", "role"),
    "empty": ({"input": []}, "input", "empty"),
    "truncation-auto": ({"input": "hi", "truncation": "auto"}, "truncation", "truncation"),
    "background": ({"input": "hi", "background": True}, "background", "background"),
    "conversation": ({"input": "hi", "conversation": "conv_1"}, "conversation", "conversation"),
    "reasoning-effort": ({"input": "hi", "reasoning": {"effort": "extreme"}}, "reasoning.effort", "high"),
    "temperature": ({"input": "hi", "temperature": 3}, "temperature", "temperature"),
    "max_output_tokens": ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens", "max_output_tokens"),
    "metadata": ({"input": "hi", "metadata": {str(i): "v" for i in range(17)}}, "metadata", "16"),
    "schema-missing": ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format",
                       "schema"),
    "schema-unsupported": ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x", "schema": {
        "type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}}}}, "text.format", "json_schema"),
    "too-long": ({"input": "hi " * 20000}, "input", "maximum context length"),
    "choice-not-a-tool": ({"input": "hi", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}},
                          "tool_choice", "nope"),
    "choice-without-tools": ({"input": "hi", "tool_choice": "required"}, "tool_choice", "tools"),
    "hosted-choice": ({"input": "hi", "tools": [WEATHER], "tool_choice": {"type": "file_search"}}, "tool_choice",
                      "function"),
    "tool-name": ({"input": "hi", "tools": [{**WEATHER, "name": "get weather"}]}, "tools[0].name", "pattern"),
    "tool-schema": ({"input": "hi", "tools": [{**WEATHER, "parameters": {"type": "object", "properties": {
        "a": {"$ref": "#/nowhere"}}}}]}, "tools[0].parameters", "get_weather"),
    "tools-and-format": ({"input": "hi", "tools": [WEATHER], "text": {"format": {"type": "json_object"}}},
                         "text.format", "tools"),
}


@pytest.mark.parametrize("body,param,says", BAD.values(), ids=BAD.keys())
def test_bad_request(base_url: str, body: dict, param: str, says: str) -> None:
    error = assert_openai_error(httpx.post(f"{base_url}/v1/responses", json=body, timeout=30), param)
    assert says in error["message"]

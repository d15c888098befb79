"""A server that survives any single request.

A corpus of hostile requests against a live kvserve at its defaults (SmolLM2, its own process),
whose resident memory a watcher thread samples: the moment RSS passes its idle size plus
RSS_MARGIN, the watcher kills the server and the test fails (no address-space limit: under one,
a runaway allocation fails fast and can pass for a clean refusal). Each request must get a 2xx
or an OpenAI-shaped 4xx within REQUEST_SECONDS (the client's timeout); afterwards the server
answers /health and is idle: nothing running or waiting, no sampler chain left open.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

from kvserve.config import Settings
from kvserve.server.schemas import MAX_N, MAX_TOP_LOGPROBS
from kvserve.testing import ServerProcess, read_metrics, wait_until
from kvserve.tools.schema_budget import MAX_ALTERNATIVES, MAX_REPEAT, MAX_TOOLS

GiB = 1 << 30
RSS_MARGIN = 2 * GiB  # over the idle server's RSS: the bound no single request may push it past
REQUEST_SECONDS = 60.0  # each answer's bound (status and body; a stream's first event), on a busy 2-core box
CTX = Settings.model_fields["ctx_size"].default  # the default --ctx-size: max_tokens at its cap
PARALLEL = Settings.model_fields["parallel"].default  # the default --parallel: the most choices at once

SCHEMA = "response_format.json_schema.schema"
OK = "2xx"
REFUSED = "4xx"  # any OpenAI-shaped 4xx: a body that does not parse names no parameter
HI = [{"role": "user", "content": "hi"}]
SURROGATE = "\ud800"  # a lone surrogate: JSON can escape it, UTF-8 cannot carry it
NUL = "\u0000"  # a character no token of a vocabulary spells


@dataclass(frozen=True)
class Case:
    path: str
    body: Any
    expect: str  # OK, REFUSED, or the `param` a 400 must name
    stream: bool = False  # read the first event, then hang up


def chat(**fields: Any) -> dict:
    return {"messages": HI, "max_tokens": 1, "temperature": 0, **fields}


def formatted(schema: Any) -> dict:
    return chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}})


def tool(name: str, parameters: dict) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


def deeply_nested(body: dict, levels: int) -> bytes:
    """`body` with a schema `levels` arrays deep where it holds "DEEP": JSON text, as no encoder
    nests that far."""
    return json.dumps(body).replace('"DEEP"', '{"type": "array", "items": ' * levels + "{}" + "}" * levels).encode()


def ints(**bounds: Any) -> dict:
    return {"type": "array", "items": {"type": "integer"}, **bounds}


def deep_json(levels: int) -> bytes:
    return b'{"messages": ' + b"[" * levels + b"]" * levels + b"}"


CHAT = "/v1/chat/completions"
BIG = 10**9
CORPUS: dict[str, Case] = {
    # one schema, one bound: the converter would write each out in full
    "maxItems": Case(CHAT, formatted(ints(maxItems=BIG)), SCHEMA),
    "maxItems-float": Case(CHAT, formatted(ints(maxItems=1e9)), SCHEMA),
    "minItems": Case(CHAT, formatted(ints(minItems=BIG)), SCHEMA),
    "maxLength": Case(CHAT, formatted({"type": "string", "maxLength": BIG}), SCHEMA),
    "minLength": Case(CHAT, formatted({"type": "string", "minLength": BIG}), SCHEMA),
    "bound-not-a-number": Case(CHAT, formatted(ints(maxItems="5")), SCHEMA),
    "pattern-quantifier": Case(CHAT, formatted({"type": "string", "pattern": f"^a{{{BIG}}}$"}), SCHEMA),
    # bounds that pass one by one, but not together
    "repetitions-side-by-side": Case(CHAT, formatted({"type": "object", "properties": {
        f"field_{i}": ints(maxItems=MAX_REPEAT) for i in range(64)}}), SCHEMA),
    "allOf-copies": Case(CHAT, formatted({
        "$defs": {"D": {"type": "object", "properties": {"x": ints(maxItems=900)}}},
        "type": "object", "properties": {f"p{i}": {"allOf": [{"$ref": "#/$defs/D"}]} for i in range(200)}}), SCHEMA),
    "nested-repetitions": Case(CHAT, formatted(
        ints(maxItems=300) | {"items": ints(maxItems=300) | {"items": {"type": "string", "maxLength": 300}}}), OK),
    "nullable-repetitions": Case(CHAT, formatted({"type": "string", "pattern": "^(a?){1000}$"}), SCHEMA),
    "nested-group-repetitions": Case(CHAT, formatted({"type": "string", "pattern": "^((a?){30}){30}$"}), SCHEMA),
    "huge-enum": Case(CHAT, formatted({"enum": [f"value-{i}" for i in range(20_000)]}), SCHEMA),
    "enum-of-a-few-hundred": Case(CHAT, formatted({"enum": [f"value-{i}" for i in range(300)]}), OK),
    "huge-anyOf": Case(CHAT, formatted({"anyOf": [{"const": i} for i in range(MAX_ALTERNATIVES + 1)]}), SCHEMA),
    "huge-properties": Case(CHAT, formatted({"type": "object", "properties": {
        f"p{i}": {"type": "integer"} for i in range(5000)}}), SCHEMA),
    "huge-const": Case(CHAT, formatted({"const": "x" * (2 << 20)}), SCHEMA),
    "deep-schema": Case(CHAT, deeply_nested(formatted("DEEP"), 300), SCHEMA),
    "deeper-than-json-parses": Case(CHAT, deeply_nested(formatted("DEEP"), 5000), REFUSED),
    "recursive-ref": Case(CHAT, formatted({"type": "object", "properties": {"tree": {"$ref": "#/$defs/node"}},
                                           "$defs": {"node": {"type": "object", "properties": {
                                               "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}}}}}}), OK),
    "deep-json-body": Case(CHAT, deep_json(100_000), REFUSED),
    # tools: their parameter schemas, their number, all of them together
    "tool-maxItems": Case(CHAT, chat(tools=[tool("f", {"type": "object", "properties": {"xs": ints(maxItems=BIG)}})]),
                          "tools[0].function.parameters"),
    "tool-deep": Case(CHAT, deeply_nested(chat(tools=[tool("f", {"type": "object", "properties": {"x": "DEEP"}})]),
                                          300), "tools[0].function.parameters"),
    "thousands-of-tools": Case(CHAT, chat(tools=[tool(f"f{i}", {"type": "object"}) for i in range(5000)]), "tools"),
    "tools-too-big-together": Case(CHAT, chat(tools=[
        tool(f"tool_{i}", {"type": "object", "properties": {"values": ints(maxItems=800)}})
        for i in range(MAX_TOOLS)]), "tools"),
    "render-tool-maxItems": Case("/v1/chat/completions/render", chat(tools=[tool("f", ints(minItems=BIG))]),
                                 "tools[0].function.parameters"),
    "responses-maxItems": Case("/v1/responses", {"input": "hi", "max_output_tokens": 8, "text": {"format": {
        "type": "json_schema", "name": "x", "schema": ints(maxItems=BIG)}}}, "text.format"),
    # n x max_tokens x top_logprobs at their caps
    # n at the most the default server runs at once: one stream per choice (n up to MAX_N needs --parallel that high)
    "caps-streamed": Case(CHAT, chat(n=PARALLEL, max_tokens=CTX, logprobs=True, top_logprobs=MAX_TOP_LOGPROBS,
                                     stream=True), OK, stream=True),
    "caps-completions-streamed": Case("/v1/completions", {"prompt": "hi", "n": PARALLEL, "max_tokens": CTX,
                                                          "logprobs": MAX_TOP_LOGPROBS, "stream": True}, OK, stream=True),
    "caps-whole": Case(CHAT, chat(n=PARALLEL, max_tokens=4, logprobs=True, top_logprobs=MAX_TOP_LOGPROBS), OK),
    "n-past-the-cap": Case(CHAT, chat(n=MAX_N + 1), "n"),
    # stop strings, biases, prompts: many or long
    "too-many-stops": Case(CHAT, chat(stop=[f"s{i}" for i in range(17)]), "stop"),
    "long-stops": Case(CHAT, chat(stop=[chr(65 + i) * 65536 for i in range(16)]), OK),
    "bias-on-every-token": Case(CHAT, chat(logit_bias={str(t): -1 for t in range(49152)}), OK),
    "prompt-of-4-MiB": Case("/v1/completions", {"prompt": "hello " * (700 << 10), "max_tokens": 1}, "prompt"),
    "million-token-ids": Case("/v1/completions", {"prompt": [1] * 1_000_000, "max_tokens": 1}, "prompt"),
    "many-messages": Case(CHAT, chat(messages=[{"role": "user", "content": "hi"}] * 5_000), "messages"),
    # special-token spellings: llama.cpp's own splitting on them is quadratic in their count
    "many-tiny-messages": Case(CHAT, chat(messages=[{"role": "user", "content": "hi"}] * 100_000), "messages"),
    "markers-in-content": Case(CHAT, chat(messages=[{"role": "user", "content": "<|im_start|>" * 200_000}]), "messages"),
    # text that JSON allows and UTF-8 cannot carry
    "surrogate-content": Case(CHAT, chat(messages=[{"role": "user", "content": SURROGATE}]), "messages[0].content"),
    "surrogate-part": Case(CHAT, chat(messages=[{"role": "user", "content": [{"type": "text", "text": SURROGATE}]}]),
                           "messages[0].content[0].text"),
    "surrogate-tool-args": Case(CHAT, chat(messages=[*HI, {"role": "assistant", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": SURROGATE}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "1"}], tools=[tool("f", {"type": "object"})]),
        "messages[1].tool_calls[0].function.arguments"),
    "surrogate-tool-call-id": Case(CHAT, chat(messages=[*HI, {"role": "tool", "tool_call_id": SURROGATE,
                                                              "content": "1"}]), "messages[1].tool_call_id"),
    "surrogate-stop": Case(CHAT, chat(stop=["ok", SURROGATE]), "stop[1]"),
    "surrogate-schema": Case(CHAT, formatted({"type": "string", "pattern": f"^{SURROGATE}$"}),
                             f"{SCHEMA}.pattern"),
    "surrogate-key": Case(CHAT, chat(messages=[{"role": "user", "content": "hi", SURROGATE: 1}]), "messages[0]"),
    "surrogate-prompt": Case("/v1/completions", {"prompt": f"a{SURROGATE}b", "max_tokens": 1}, "prompt"),
    "surrogate-responses": Case("/v1/responses", {"input": [{"role": "user", "content": SURROGATE}]},
                                "input[0].content"),
    "surrogate-tokenize": Case("/tokenize", {"prompt": SURROGATE}, "prompt"),
    "surrogate-pair-is-text": Case(CHAT, chat(messages=[{"role": "user", "content": "\U0001F600"}]), OK),
    # grammars that reach a point where no token can go on: llama.cpp aborts on the token it then picks
    "unspellable-const": Case(CHAT, {**formatted({"const": NUL}), "max_tokens": 8}, REFUSED),
    "unspellable-in-two-choices": Case(CHAT, {**formatted({"const": f"ab{NUL}"}), "max_tokens": 8, "n": 2,
                                              "temperature": 1}, REFUSED),
    "unspellable-tool-argument": Case(CHAT, chat(max_tokens=60, tool_choice="required", tools=[tool("f", {
        "type": "object", "properties": {"a": {"const": NUL}}, "required": ["a"]})]), REFUSED),
    "unspellable-responses-format": Case("/v1/responses", {"input": "hi", "max_output_tokens": 8, "text": {
        "format": {"type": "json_schema", "name": "x", "schema": {"const": NUL}}}}, REFUSED),
}


class RssWatch(threading.Thread):
    """Samples the server's RSS every few milliseconds; past `limit` it kills the server at once."""

    def __init__(self, server: ServerProcess, idle: int, margin: int) -> None:
        super().__init__(daemon=True)
        self.server, self.idle, self.limit = server, idle, idle + margin
        self.peak = idle
        self.tripped = False
        self._halt = threading.Event()

    def run(self) -> None:
        while not self._halt.wait(0.005):
            rss = resident_bytes(self.server.pid)
            self.peak = max(self.peak, rss)
            if rss > self.limit:
                self.tripped = True
                self.server.kill()
                return

    def stop(self) -> None:
        self._halt.set()
        self.join()

    def report(self) -> str:
        return (f"RSS idle {self.idle / GiB:.2f} GiB, peak {self.peak / GiB:.2f} GiB, bound {self.limit / GiB:.2f} GiB"
                + ("; the watcher killed the server" if self.tripped else ""))


def resident_bytes(pid: int) -> int:
    """VmRSS of `pid` (0 once it is gone)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0
    line = next((line for line in status.splitlines() if line.startswith("VmRSS:")), "VmRSS: 0 kB")
    return int(line.split()[1]) * 1024


@pytest.fixture(scope="module")
def watched(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerProcess, RssWatch]]:
    server = ServerProcess.kvserve(tmp_path_factory.mktemp("hostile") / "kvserve.log")
    with server:
        server.wait_healthy()
        warm = httpx.post(f"{server.url}{CHAT}", json=chat(), timeout=REQUEST_SECONDS)  # the idle size after a request
        assert warm.status_code == 200, warm.text
        watch = RssWatch(server, resident_bytes(server.pid), RSS_MARGIN)
        watch.start()
        try:
            yield server, watch
        finally:
            watch.stop()
            print(f"\nhostile corpus: {watch.report()}")


def send(server: ServerProcess, case: Case) -> httpx.Response:
    """The case's answer; a stream is read up to its first event, then the client hangs up."""
    content = case.body if isinstance(case.body, bytes) else json.dumps(case.body).encode()  # escapes surrogates
    request = dict(content=content, headers={"content-type": "application/json"}, timeout=REQUEST_SECONDS)
    if not case.stream:
        return httpx.post(f"{server.url}{case.path}", **request)
    with httpx.stream("POST", f"{server.url}{case.path}", **request) as response:
        if response.status_code == 200:
            assert next(line for line in response.iter_lines() if line).startswith("data: ")
        else:
            response.read()
        return response


@pytest.mark.parametrize("name", CORPUS)
def test_hostile_request(watched: tuple[ServerProcess, RssWatch], name: str) -> None:
    server, watch = watched
    case = CORPUS[name]
    assert server.alive(), f"the server is down before this request; {watch.report()}"
    try:
        response = send(server, case)
    except httpx.HTTPError as exc:
        pytest.fail(f"{name}: no answer ({exc!r}); {watch.report()}; server log:\n{server.tail(15)}")
    assert not watch.tripped, watch.report()
    if case.expect == OK:
        assert 200 <= response.status_code < 300, response.text[:500]
        return
    assert 400 <= response.status_code < 500, f"{response.status_code}: {response.text[:500]}"
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"], error
    assert error["type"] == "invalid_request_error", error
    if case.expect != REFUSED:
        assert (response.status_code, error["param"]) == (400, case.expect), error


def test_a_grammar_with_no_way_on_ends_a_stream_with_a_400_shaped_error(
        watched: tuple[ServerProcess, RssWatch]) -> None:
    """Streamed, the dead end comes after the reply's first token went out: the stream ends with the
    request's error, typed as the client's fault, then [DONE]."""
    server, _ = watched
    body = {**formatted({"const": f"a{NUL}"}), "max_tokens": 8, "stream": True}
    with httpx.stream("POST", f"{server.url}{CHAT}", json=body, timeout=REQUEST_SECONDS) as response:
        events = [line.removeprefix("data: ") for line in response.iter_lines() if line]
    assert response.status_code == 200 and events[-1] == "[DONE]", events
    error = json.loads(events[-2])["error"]
    assert error["type"] == "invalid_request_error" and "no token" in error["message"], error
    assert server.alive()


def test_a_grammar_with_no_way_on_fails_a_streamed_response_as_the_requests_fault(
        watched: tuple[ServerProcess, RssWatch]) -> None:
    server, _ = watched
    body = {"input": "hi", "max_output_tokens": 8, "stream": True,
            "text": {"format": {"type": "json_schema", "name": "x", "schema": {"const": f"a{NUL}"}}}}
    with httpx.stream("POST", f"{server.url}/v1/responses", json=body, timeout=REQUEST_SECONDS) as response:
        events = [json.loads(line.removeprefix("data: ")) for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1]["type"] == "response.failed", events[-1]
    assert events[-1]["response"]["error"]["code"] == "invalid_prompt", events[-1]


def test_server_is_healthy_and_idle_after_the_corpus(watched: tuple[ServerProcess, RssWatch]) -> None:
    server, watch = watched

    def idle() -> bool:
        page = read_metrics(server.url)
        return (page.value("kvserve_requests_running") == 0 and page.value("kvserve_requests_waiting") == 0
                and page.value("kvserve_live_sampler_chains") == 0)

    assert httpx.get(f"{server.url}/health", timeout=REQUEST_SECONDS).status_code == 200, watch.report()
    wait_until(idle, REQUEST_SECONDS, "the server idle: nothing running or waiting, no sampler chain open")
    assert read_metrics(server.url).total("kvserve_unexpected_errors_total") == 0
    assert not watch.tripped, watch.report()


def test_an_unexpected_exception_is_an_openai_500_logged_with_the_request_id_and_counted(
        tiny, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """A bug in a route (here: preparing a chat raises) is the server's fault and no engine's: a 500
    server_error in OpenAI's shape with no traceback, the request id in its log line, and a metric."""
    from conftest import served
    from kvserve.server import prompts
    from kvserve.server.logs import RequestIdFilter
    from kvserve.testing.metrics import Metrics

    async def broken(*_: Any, **__: Any) -> None:
        raise RuntimeError("a bug with a secret in its message")

    caplog.handler.addFilter(RequestIdFilter())
    with served(tiny("llama"), threads=1, parallel=2) as (url, _):
        monkeypatch.setattr(prompts, "chat_job", broken)
        response = httpx.post(f"{url}{CHAT}", json=chat(), headers={"x-request-id": "req-broken-1"}, timeout=60)
        page = Metrics.parse(httpx.get(f"{url}/metrics").text)
    assert response.status_code == 500, response.text
    assert response.headers["x-request-id"] == "req-broken-1"
    error = response.json()["error"]
    assert (error["type"], error["code"], error["param"]) == ("server_error", "internal_error", None)
    assert "req-broken-1" in error["message"] and "secret" not in response.text and "Traceback" not in response.text
    logged = [r for r in caplog.records if r.exc_info and "secret" in str(r.exc_info[1])]
    assert [r.request_id for r in logged] == ["req-broken-1"]
    assert page.value("kvserve_unexpected_errors_total", route=CHAT) == 1
    assert page.value("kvserve_unexpected_errors_total", route="/v1/completions") == 0


def test_a_schema_is_converted_off_the_event_loop(tiny, monkeypatch: pytest.MonkeyPatch) -> None:
    """While one request's schema is being converted, the server still answers others."""
    from conftest import served
    from kvserve.server import prompts

    entered, release = threading.Event(), threading.Event()
    convert = prompts.json_gbnf

    def slow(schema: dict) -> str:
        entered.set()
        release.wait(timeout=30)  # on the loop this would hold every other request up to here
        return convert(schema)

    with served(tiny("llama"), threads=1, parallel=2) as (url, _):
        monkeypatch.setattr(prompts, "json_gbnf", slow)
        answers: list[httpx.Response] = []
        sender = threading.Thread(target=lambda: answers.append(
            httpx.post(f"{url}{CHAT}", json=formatted({"type": "integer"}), timeout=60)))
        sender.start()
        try:
            assert entered.wait(timeout=30)
            health = httpx.get(f"{url}/health", timeout=10)
        finally:
            release.set()
            sender.join()
    assert health.status_code == 200
    assert answers[0].status_code == 200, answers[0].text

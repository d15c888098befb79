"""Overload, disconnects, engine faults and request limits, against a real server on a tiny model."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import socket
import threading
import time
from typing import Callable, Iterator

import httpx
import openai
import pytest
from fastapi import FastAPI

from conftest import engine, greedy, run, served
from kvserve.llama.batch import Batch
from kvserve.llama.context import Context, DecodeError
from kvserve.scheduler.request import RequestOutput
from kvserve.scheduler.ubatch_cost import UbatchCost
from kvserve.server import generation
from kvserve.testing import read_metrics, wait_until
from test_openai_api import assert_openai_error

LONG = {"prompt": "hi", "max_tokens": 1500, "ignore_eos": True}  # runs for a while on the tiny model


@pytest.fixture(scope="module")
def server(tiny) -> Iterator[tuple[str, FastAPI]]:
    with served(tiny("llama"), threads=1, parallel=4, max_body_mb=0.01) as pair:
        yield pair


def engine_idle(app: FastAPI, timeout: float = 300) -> bool:
    """True once nothing is in flight and every sequence id not lent to the cache is free. The
    scheduler must have no work left too: mid-step, the snapshot is the previous step's; nor idle
    work: timing a ubatch size for `--speculative auto` borrows a stream between requests and gives
    it back before the size counts as timed. The timeout only bounds a hang: how soon a loaded
    machine gets there is no part of the check."""
    engine = app.state.models.only
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        snapshot = engine.scheduler.snapshot
        if (not engine.async_engine.in_flight and not engine.scheduler.has_work() and snapshot.running == 0
                and snapshot.waiting == 0 and not engine.scheduler.wants_idle()):
            return True
        time.sleep(0.02)
    return False


def test_engine_idle_waits_for_the_ubatch_timing_in_a_borrowed_stream(tiny, monkeypatch: pytest.MonkeyPatch) -> None:
    """Between requests, `--speculative auto` times a ubatch size in a stream it borrows from the
    pool. A check that read the pool then saw a live session no request owned (the soak test did,
    once in three suite runs), so `engine_idle` must not call the engine idle until that is done."""
    started, go_on = threading.Event(), threading.Event()
    real = Context.time_ubatches

    def held(self: Context, sizes: list[int], **kwargs) -> dict[int, float]:
        started.set()
        go_on.wait(60)
        return real(self, sizes, **kwargs)

    monkeypatch.setattr(Context, "time_ubatches", held)
    with served(tiny("llama"), threads=1, speculative="auto") as (_, app):
        try:
            assert started.wait(60), "no ubatch was timed while the engine idled"
            pool = app.state.models.only.pool
            assert len(pool.sessions) == 1  # the stream the timing borrowed, no request's
            assert not engine_idle(app, timeout=0.5)
        finally:
            go_on.set()  # a failed check must not leave the engine thread waiting
        assert engine_idle(app) and pool.sessions == []


def test_engine_idle_waits_for_the_borrowed_stream_after_its_last_size(tiny, monkeypatch: pytest.MonkeyPatch) -> None:
    """The last size counts as timed before the borrowed stream is given back. A check that saw
    nothing left to time called the engine idle there, and read the borrowed session as a leak
    (the soak test did, once in CI)."""
    held, go_on = threading.Event(), threading.Event()
    real = UbatchCost.add_timings

    def timed(self: UbatchCost, sizes: list[int], seconds: dict[int, float]) -> None:
        real(self, sizes, seconds)
        if self.next_to_time() is None:  # the last size: the stream is still borrowed
            held.set()
            go_on.wait(60)

    monkeypatch.setattr(UbatchCost, "add_timings", timed)
    with served(tiny("llama"), threads=1, speculative="auto") as (_, app):
        try:
            assert held.wait(120), "the ubatch sizes were not all timed while the engine idled"
            pool = app.state.models.only.pool
            assert len(pool.sessions) == 1  # still borrowed
            assert not engine_idle(app, timeout=0.5)
        finally:
            go_on.set()
        assert engine_idle(app) and pool.sessions == []


def test_non_utf8_body_is_a_400(server) -> None:
    url, _ = server
    response = httpx.post(f"{url}/v1/completions", content=b'{"prompt": "caf\xe9"}',
                          headers={"content-type": "application/json"})
    assert_openai_error(response, None)


def test_body_over_the_limit_is_a_413(server) -> None:
    url, _ = server
    response = httpx.post(f"{url}/v1/completions", json={"prompt": "x" * 20_000})
    assert response.status_code == 413
    assert response.json()["error"]["code"] == "request_too_large"


def test_more_choices_than_parallel_slots_is_a_400(server) -> None:
    """Found by the fuzz test: such a request could never be admitted and waited forever."""
    url, _ = server
    response = httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "n": 5, "max_tokens": 2}, timeout=10)
    assert "at most 4" in assert_openai_error(response, "n")["message"]


def test_request_id_is_echoed_or_made(server) -> None:
    url, _ = server
    assert httpx.get(f"{url}/health", headers={"x-request-id": "abc-123"}).headers["x-request-id"] == "abc-123"
    made = httpx.get(f"{url}/health", headers={"x-request-id": "bad id\twith spaces"}).headers["x-request-id"]
    assert made != "bad id\twith spaces" and len(made) == 32


class HeldDecodes:
    """Every llama_decode of `ctx` after the first `after` waits until `release()`: while held, the
    engine can neither answer nor finish anything, however fast the machine."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, ctx: Context, after: int = 0) -> None:
        self.decodes = 0
        self._released = threading.Event()
        real_decode, calls = ctx.decode, itertools.count()

        def held(batch: Batch) -> None:
            if next(calls) >= after:
                self._released.wait()
            self.decodes += 1
            real_decode(batch)

        monkeypatch.setattr(ctx, "decode", held)

    def release(self) -> None:
        self._released.set()


@pytest.fixture
def hold(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., HeldDecodes]]:
    """hold(ctx, after=0) -> HeldDecodes; whatever the test does, the engine is let go at its end."""
    made: list[HeldDecodes] = []

    def hold_decodes(ctx: Context, after: int = 0) -> HeldDecodes:
        made.append(HeldDecodes(monkeypatch, ctx, after))
        return made[-1]

    yield hold_decodes
    for held in made:
        held.release()


def hung_up(app: FastAPI) -> None:
    """Wait until the server has seen its client leave: the request is no longer in flight."""
    wait_until(lambda: app.state.models.only.async_engine.in_flight == 0, 30, "the server noticing the hang-up")


def aborted(url: str) -> float:
    return read_metrics(url).value("kvserve_request_success_total", finish_reason="abort")


def test_non_streamed_client_that_times_out_frees_its_sequence(server, hold) -> None:
    url, app = server
    before = aborted(url)
    held = hold(app.state.models.only.pool.ctx)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{url}/v1/completions", json=LONG, timeout=0.5)
    hung_up(app)
    held.release()
    assert engine_idle(app) and held.decodes < LONG["max_tokens"], "the abandoned request kept running"
    assert app.state.models.only.pool.sessions == []
    assert aborted(url) == before + 1  # counted as what it was: aborted by its client


def test_openai_stream_that_times_out_frees_its_sequence(server, hold) -> None:
    """The engine stalls mid-stream (decodes after the fifth are held); the client's read timeout
    fires, it hangs up, and the sequence is freed one step after the engine moves again."""
    url, app = server
    before = aborted(url)
    held = hold(app.state.models.only.pool.ctx, after=5)
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=0.5)
    chunks = 0
    with pytest.raises(openai.APITimeoutError):
        for _ in client.completions.create(model="m", stream=True, prompt=LONG["prompt"],
                                           max_tokens=LONG["max_tokens"], extra_body={"ignore_eos": True}):
            chunks += 1
    assert chunks >= 3  # it timed out mid-stream, not before it began
    hung_up(app)
    held.release()
    assert engine_idle(app) and held.decodes < LONG["max_tokens"], "the abandoned stream kept running"
    assert app.state.models.only.pool.sessions == []
    wait_until(lambda: aborted(url) == before + 1, 30, "the abandoned stream counted as aborted")


def fail_next_decode(monkeypatch: pytest.MonkeyPatch, ctx: Context) -> None:
    """The context's next llama_decode fails as llama.cpp reports it; later ones run."""
    real_decode = ctx.decode
    failures = iter([True])

    def flaky(batch: Batch) -> None:
        if next(failures, False):
            raise DecodeError("injected")
        real_decode(batch)

    monkeypatch.setattr(ctx, "decode", flaky)


def test_failed_decode_fails_only_its_batch(server, monkeypatch: pytest.MonkeyPatch) -> None:
    url, app = server
    fail_next_decode(monkeypatch, app.state.models.only.pool.ctx)
    response = httpx.post(f"{url}/v1/completions", json={"prompt": "hello", "max_tokens": 4}, timeout=30)
    assert response.status_code == 500
    error = response.json()["error"]
    assert error["type"] == "server_error" and "decode failed" in error["message"]
    after = httpx.post(f"{url}/v1/completions", json={"prompt": "hello", "max_tokens": 4}, timeout=30)
    assert after.status_code == 200 and after.json()["usage"]["completion_tokens"] == 4
    assert engine_idle(app) and app.state.models.only.pool.sessions == []


def test_burst_past_the_queue_gets_429s(tiny, hold) -> None:
    """2 running + 4 waiting are accepted; the other 14 of a burst of 20 are turned away at once. The
    engine is held until each request is answered or in flight, so none finishes and makes room."""
    with served(tiny("llama"), threads=1, parallel=2, max_queue=4) as (url, app):
        held = hold(app.state.models.only.pool.ctx)

        async def burst() -> list[httpx.Response]:
            async with httpx.AsyncClient(timeout=120) as client:
                body = {**LONG, "max_tokens": 300}
                posts = [asyncio.create_task(client.post(f"{url}/v1/completions", json=body)) for _ in range(20)]
                await asyncio.to_thread(
                    wait_until, lambda: sum(p.done() for p in posts) + app.state.models.only.async_engine.in_flight == 20,
                    60, "each request answered or in flight")
                held.release()
                return await asyncio.gather(*posts)

        responses = asyncio.run(burst())
        codes = sorted(r.status_code for r in responses)
        assert codes == [200] * 6 + [429] * 14
        for r in responses:
            if r.status_code == 429:
                assert r.headers["retry-after"] == "1" and r.json()["error"]["type"] == "rate_limit_error"
            else:
                assert r.json()["usage"]["completion_tokens"] == 300
        assert engine_idle(app)


def test_request_waiting_past_the_queue_timeout_gets_503(tiny, hold) -> None:
    """The first request takes the one slot and cannot finish (decodes after its first are held);
    the second waits past the queue timeout, and the step after the release fails it."""
    queue_timeout = 0.3
    # `off`: `auto` times step sizes with decodes of its own while idle, and `after` counts the request's
    with served(tiny("llama"), threads=1, parallel=1, queue_timeout=queue_timeout, speculative="off") as (url, app):
        engine = app.state.models.only
        held = hold(engine.pool.ctx, after=1)

        async def two() -> list[httpx.Response]:
            async with httpx.AsyncClient(timeout=120) as client:
                first = asyncio.create_task(client.post(f"{url}/v1/completions", json=LONG))
                await asyncio.to_thread(wait_until, lambda: engine.scheduler.snapshot.running == 1, 30, "first running")
                short = {"prompt": "hi", "max_tokens": 2}
                second = asyncio.create_task(client.post(f"{url}/v1/completions", json=short))
                await asyncio.to_thread(wait_until, lambda: engine.async_engine.in_flight == 2, 30, "second queued")
                queued_by = time.monotonic()  # the second arrived before this
                # A queue timeout is a duration: this waits it out, which no machine's speed shortens.
                while time.monotonic() - queued_by <= queue_timeout:
                    await asyncio.sleep(0.05)
                held.release()
                return [await first, await second]

        first, second = asyncio.run(two())
        assert first.status_code == 200
        assert second.status_code == 503 and "overloaded" in second.json()["error"]["message"]
        assert second.json()["error"]["code"] == "queue_timeout"
        assert engine_idle(app)


def _beside(e, *requests, watched=None) -> tuple[dict[str, RequestOutput], list[int]]:
    """Submit `requests` in order and step until each ended: each one's last output, and the tokens
    `watched` (by default the last request) generated."""
    watched = watched or requests[-1]
    for request in requests:
        e.scheduler.submit(request)
    ends: dict[str, RequestOutput] = {}
    tokens: list[int] = []
    while len(ends) < len(requests):
        for output in e.scheduler.step():
            if output.request_id == watched.id:
                tokens += [t for d in output.deltas for t in d.token_ids]
            if output.usage is not None or output.error is not None:
                ends[output.request_id] = output
    return ends, tokens


def test_failed_decode_leaves_requests_outside_the_batch_alone(tiny, monkeypatch: pytest.MonkeyPatch) -> None:
    """With one slot, the second request waits outside the batch that fails, then runs as if alone."""
    with engine(tiny("llama"), parallel=1, prefix_cache=False) as e:
        prompt = e.model.tokenize("The capital of France is", add_special=True)
        reference = greedy(prompt, max_tokens=8)
        expected = run(e, [reference])[reference.id]
        fail_next_decode(monkeypatch, e.pool.ctx)
        doomed, bystander = greedy(prompt, max_tokens=8), greedy(prompt, max_tokens=8)
        ends, tokens = _beside(e, doomed, bystander)
        assert "decode failed" in ends[doomed.id].error and ends[doomed.id].status == 500
        assert ends[bystander.id].error is None and tokens == expected
        assert e.pool.sessions == [] and e.pool.ctx.seq_pos_max(0) == -1


def test_a_grammar_dead_end_fails_its_request_alone(tiny) -> None:
    """An n = 2 request whose schema asks for a character no token spells: both choices reach the
    dead end in one step. The first ends the request with a 400; its sibling's row in that step is
    not sampled, and a request decoding beside them runs as if alone."""
    from llama_cpp.llama_grammar import json_schema_to_gbnf

    from kvserve.llama.sampler import SamplingParams

    with engine(tiny("llama"), parallel=4) as e:
        prompt = e.model.tokenize("The capital of France is", add_special=True)
        reference = greedy(prompt, max_tokens=12)
        expected = run(e, [reference])[reference.id]
        grammar = json_schema_to_gbnf('{"const": "ab\\u0000"}')
        doomed = dataclasses.replace(greedy(prompt, max_tokens=8, n=2),
                                     params=SamplingParams(temperature=0.0, grammar=grammar))
        bystander = greedy(prompt, max_tokens=12)
        ends, tokens = _beside(e, bystander, doomed, watched=bystander)
        assert ends[doomed.id].status == 400 and "no token" in ends[doomed.id].error, ends[doomed.id]
        assert ends[bystander.id].error is None and tokens == expected
        assert e.scheduler.snapshot.live_samplers == 0 and e.pool.sessions == []


def test_a_queue_timeout_shorter_than_the_load_does_not_stop_the_server(tiny) -> None:
    """--queue-timeout bounds how long a request waits; the load at start is no request."""
    with served(tiny("llama"), queue_timeout=0.001) as (url, _):
        assert httpx.get(f"{url}/health", timeout=30).status_code == 200


def test_a_request_that_a_long_step_kept_waiting_takes_a_free_slot_rather_than_timing_out(tiny) -> None:
    """The queue timeout ends requests no slot could take: one that arrived during a step longer
    than the timeout, with a slot free, starts at the next step."""
    with engine(tiny("llama"), parallel=2, queue_timeout=0.05) as e:
        request = greedy(e.model.tokenize("The capital of France is", add_special=True), max_tokens=4)
        e.scheduler.submit(request)
        time.sleep(0.2)  # as if a long decode ran meanwhile
        outputs = []
        while e.scheduler.has_work():
            outputs += e.scheduler.step()
        assert [o.error for o in outputs if o.error] == [] and request.state.admitted_at is not None


def test_stream_whose_client_leaves_before_it_begins_frees_its_sequence(server, hold, monkeypatch) -> None:
    """The client hangs up after the first output is ready but before the stream's body is read
    (here: held until then). Starlette sees the hang-up and cancels the task sending the body before
    it ran, but anyio delivers a cancellation only to a started task: the body's generator begins,
    and the cancellation closes its outputs, which aborts the request at once (not at max_tokens)."""
    url, app = server
    real = generation._unless_disconnected

    async def first_output_then_hang_up(request, work):
        result = await real(request, work)
        if isinstance(result, RequestOutput):  # the first output, peeked before the status is chosen
            await generation._disconnected(request)
        return result

    monkeypatch.setattr(generation, "_unless_disconnected", first_output_then_hang_up)
    held = hold(app.state.models.only.pool.ctx, after=2)  # the request cannot end by itself
    body = json.dumps({**LONG, "stream": True}).encode()
    with socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1]))) as client:
        client.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                       b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        wait_until(lambda: app.state.models.only.async_engine.in_flight == 1, 30, "the request running")
        time.sleep(0.2)  # its first output is ready
    wait_until(lambda: app.state.models.only.async_engine.in_flight == 0, 5, "the request aborted")
    held.release()
    assert engine_idle(app) and held.decodes < LONG["max_tokens"], "the abandoned stream kept running"
    assert app.state.models.only.pool.sessions == []

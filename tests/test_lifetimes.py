"""Every native object a request makes is freed exactly once, whichever way the request ends.

The count is llama.cpp's, not memory: `live_samplers()` goes up when a chain is allocated and down
when it is freed, so a path that forgets `close` leaves it above zero, and a double free would drive
it below.
"""

from __future__ import annotations

from typing import Iterator

import httpx
import pytest

from conftest import engine, greedy, run, serve
from kvserve.llama.batch import Batch
from kvserve.llama.context import DecodeError
from kvserve.llama.sampler import SamplingParams, live_samplers
from kvserve.scheduler.engine import Engine
from kvserve.scheduler.request import FinishReason, Request, RequestOutput
from kvserve.testing import read_metrics
from test_batching import no_slot_every

PROMPT_TEXT = "The quick brown fox jumps over the lazy dog. " * 3


@pytest.fixture
def tiny_engine(tiny) -> Iterator[Engine]:
    assert live_samplers() == 0, "an earlier test leaked a sampler chain"
    with engine(tiny("llama"), ctx_size=512, parallel=4, batch_size=64) as e:
        yield e
    assert live_samplers() == 0


def prompt(e: Engine, n: int = 40) -> list[int]:
    return e.model.tokenize(PROMPT_TEXT, add_special=True)[:n]


def step_until(e: Engine, done, max_steps: int = 2_000) -> list[RequestOutput]:
    outputs: list[RequestOutput] = []
    for _ in range(max_steps):
        outputs += e.scheduler.step()
        if done(outputs):
            return outputs
    raise AssertionError("the condition was never met")


def ended(request: Request):
    return lambda outputs: any(o.request_id == request.id and (o.usage or o.error) for o in outputs)


def test_finished_by_length_and_with_siblings(tiny_engine: Engine) -> None:
    e = tiny_engine
    sampled = Request(id="n3", prompt=prompt(e), params=SamplingParams(temperature=0.8, top_p=0.9,
                      repeat_penalty=1.1, seed=1), max_tokens=5, n=3)
    run(e, [greedy(prompt(e), max_tokens=4), sampled])
    assert live_samplers() == 0


def test_stopped_by_a_stop_string(tiny_engine: Engine) -> None:
    e = tiny_engine
    alone = greedy(prompt(e), max_tokens=12)
    text = e.model.detokenize(run(e, [alone])[alone.id])
    stop = text[len(text) // 3: len(text) // 3 + 3]
    assert stop.strip(), text
    request = Request(id="stop", prompt=prompt(e), params=SamplingParams(temperature=0.0), max_tokens=200, n=2,
                      stop_strings=[stop])
    run(e, [request])
    assert [c.finish_reason for c in request.state.choices] == [FinishReason.STOP] * 2
    assert all(c.n_generated < 12 for c in request.state.choices)
    assert live_samplers() == 0


def test_cancelled_running_and_waiting(tiny_engine: Engine) -> None:
    e = tiny_engine
    running = decoding(e)
    assert live_samplers() == 1
    e.scheduler.abort(running.id)
    step_until(e, ended(running))
    assert live_samplers() == 0


def test_aborted_at_shutdown(tiny_engine: Engine) -> None:
    e = tiny_engine
    requests = [greedy(prompt(e), max_tokens=500, ignore_eos=True) for _ in range(6)]  # 4 run, 2 wait
    for request in requests:
        e.scheduler.submit(request)
    step_until(e, lambda _: len(e.scheduler.running) == 4)
    assert live_samplers() == 4
    e.scheduler.release_all()
    assert live_samplers() == 0


def decoding(e: Engine) -> Request:
    """A request that is running and has generated a few tokens (so its chain has sampled)."""
    request = greedy(prompt(e), max_tokens=500, ignore_eos=True)
    e.scheduler.submit(request)
    step_until(e, lambda _: request.state.choices and request.state.choices[0].n_generated >= 3)
    return request


def test_failed_by_a_decode_error(tiny_engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    e = tiny_engine
    request = decoding(e)

    def failing(batch: Batch) -> None:
        raise DecodeError(-1)

    monkeypatch.setattr(e.pool.ctx, "decode", failing)
    outputs = step_until(e, ended(request))
    assert "decode failed" in outputs[-1].error
    assert live_samplers() == 0


def test_failed_by_an_engine_bug(tiny_engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    e = tiny_engine
    request = decoding(e)
    monkeypatch.setattr(e.scheduler.planner, "plan", lambda outputs: 1 / 0)
    step_until(e, ended(request))
    assert live_samplers() == 0


def test_rejected_before_it_ran(tiny_engine: Engine) -> None:
    """A prompt bigger than the context never gets a chain; one preempted and then too big for what is
    left would have, so the rejection path ends it like any other."""
    e = tiny_engine
    too_big = greedy([1] + [5] * 600, max_tokens=2)
    outputs = run_expecting_error(e, too_big)
    assert outputs.status == 400
    assert live_samplers() == 0


def run_expecting_error(e: Engine, request: Request) -> RequestOutput:
    e.scheduler.submit(request)
    outputs = step_until(e, ended(request))
    assert outputs[-1].error is not None
    return outputs[-1]


def test_preempted_keeps_its_chain_and_frees_it_once(tiny, monkeypatch: pytest.MonkeyPatch) -> None:
    """Steps that find no KV slot send the newest request back to the queue with its sampler (penalty
    history intact), and every chain is freed once at the end."""
    with engine(tiny("llama"), ctx_size=256, batch_size=64) as e:
        params = SamplingParams(temperature=0.0, repeat_penalty=1.3, frequency_penalty=0.2)
        base = prompt(e)
        alone = []
        for i in range(8):
            request = Request(id=f"alone{i}", prompt=base[: 30 + i], params=params, max_tokens=30)
            alone.append(run(e, [request])[request.id])
        no_slot_every(e, 7, monkeypatch)
        requests = [Request(id=f"together{i}", prompt=base[: 30 + i], params=params, max_tokens=30)
                    for i in range(8)]
        together = run(e, requests)
        assert e.scheduler.preemptions > 0
        assert [together[r.id] for r in requests] == alone  # a rebuilt chain would forget the penalties
        assert live_samplers() == 0


def test_live_count_reaches_the_metrics(tiny) -> None:
    with serve(tiny("llama"), threads=1) as url:
        body = {"prompt": "hi", "max_tokens": 3, "n": 2, "response_format": {"type": "json_object"}}
        assert httpx.post(f"{url}/v1/completions", json=body, timeout=60).status_code == 200
        metrics = read_metrics(url)
    assert metrics.value("kvserve_live_sampler_chains") == 0
    assert metrics.value("kvserve_live_kv_sessions") == 0  # every stream given back (its rows kept for reuse)

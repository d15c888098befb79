"""Requests never wait on KV rows nobody will free, and a stall, if one happens anyway, is reported.

A stall seen in a soak (a prompt admitted into a full shared cache sat at zero free cells) cannot
happen with a stream per sequence: a request starts only with a stream of its own, and the rows an
idle stream keeps for a next turn go as soon as a new request needs the stream. Checked here step
by step, with every stream holding rows.
"""

from __future__ import annotations

import logging
import threading
from typing import Iterator

import httpx
import pytest

from conftest import engine, greedy, run, served
from kvserve.llama.batch import Batch
from kvserve.scheduler.kv_manager import Room
from kvserve.testing import read_metrics


def test_two_prompts_admitted_while_every_stream_keeps_rows_both_finish(tiny) -> None:
    with engine(tiny("llama"), ctx_size=256, parallel=2, batch_size=256) as e:
        for i in range(2):  # unique histories the idle streams keep
            run(e, [greedy([1] + [(7 * i + j) % 200 + 3 for j in range(200)], max_tokens=2)])
        assert e.pool.used_cells > 400 and e.pool.live_sessions == 0
        a = greedy([1] + [(11 * j) % 200 + 5 for j in range(100)], max_tokens=2)
        b = greedy([1] + [(13 * j) % 200 + 7 for j in range(100)], max_tokens=2)
        run(e, [a, b], max_steps=50)  # raises if they do not finish


class _Flag(logging.Handler):
    """Sets an event when a record containing `text` is logged."""

    def __init__(self, text: str) -> None:
        super().__init__()
        self.text = text
        self.seen = threading.Event()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if self.text in record.getMessage():
            self.messages.append(record.getMessage())
            self.seen.set()


@pytest.fixture
def stall_log() -> Iterator[_Flag]:
    flag = _Flag("engine stall")
    logger = logging.getLogger("kvserve.scheduler")
    logger.addHandler(flag)
    yield flag
    logger.removeHandler(flag)


def test_a_stuck_step_is_reported_once_with_the_state(tiny, stall_log: _Flag, monkeypatch) -> None:
    """A decode that does not come back: the watchdog logs one warning that names the waiting
    request, counts the stall, and the oldest waiting request's age shows in /metrics."""
    release = threading.Event()
    with served(tiny("llama"), threads=1, parallel=1, stall_seconds=0.5) as (url, app):
        ctx = app.state.models.only.pool.ctx
        real_decode = ctx.decode

        def stuck(batch: Batch) -> None:
            release.wait(60)
            real_decode(batch)

        monkeypatch.setattr(ctx, "decode", stuck)
        with httpx.Client(timeout=60) as client:
            done = []
            body = {"prompt": "hi", "max_tokens": 2}
            threads = [threading.Thread(target=lambda: done.append(client.post(f"{url}/v1/completions", json=body)))
                       for _ in range(2)]
            for thread in threads:
                thread.start()
            try:
                assert stall_log.seen.wait(30), "no stall was reported"
                metrics = read_metrics(url)
            finally:
                release.set()
            for thread in threads:
                thread.join(60)
    assert [r.status_code for r in done] == [200, 200]
    assert len(stall_log.messages) == 1
    assert "has not come back from one step" in stall_log.messages[0]
    assert metrics.value("kvserve_engine_stalls_total") == 1
    assert metrics.value("kvserve_oldest_waiting_seconds") > 0


def test_a_scheduler_that_moves_nothing_describes_what_waits(tiny, stall_log: _Flag, monkeypatch) -> None:
    """Steps keep running but admit nothing: the report says what the waiting request waits for."""
    with served(tiny("llama"), threads=1, stall_seconds=0.5) as (url, app):
        scheduler = app.state.models.only.scheduler
        monkeypatch.setattr(scheduler.kv, "room_for", lambda request, n: Room.LATER)
        with httpx.Client(timeout=60) as client:
            result = []
            thread = threading.Thread(
                target=lambda: result.append(client.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 2})))
            thread.start()
            assert stall_log.seen.wait(30), "no stall was reported"
            monkeypatch.undo()
            thread.join(60)
    assert result[0].status_code == 200
    assert "waits" in stall_log.messages[0] and "for a free KV stream" in stall_log.messages[0]

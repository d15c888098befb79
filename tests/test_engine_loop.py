"""The engine loop against a real server: a step's outputs reach their readers before the next step
starts, so a chunk is sent between decodes rather than beside one."""

from __future__ import annotations

import httpx
import pytest

from conftest import served


@pytest.mark.parametrize("stream", [True, False])
def test_each_steps_outputs_are_taken_before_the_next_step(tiny, stream: bool) -> None:
    with served(tiny("llama"), threads=1, parallel=2) as (url, app):
        engine = app.state.models.only.async_engine
        real, untaken = engine.call, []

        async def call(fn):  # on the event loop, as the loop hands the engine thread its next step
            if fn == engine._step:
                untaken.append(sum(not s.taken for s in engine._streams.values()))
            return await real(fn)

        engine.call = call
        body = {"prompt": "hi", "max_tokens": 24, "ignore_eos": True, "temperature": 0, "stream": stream}
        with httpx.Client(timeout=60) as client:
            reply = client.post(f"{url}/v1/completions", json=body)
        assert reply.status_code == 200
        assert len(untaken) >= 24
        assert untaken.count(0) == len(untaken), untaken

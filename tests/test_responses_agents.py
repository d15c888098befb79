"""The OpenAI Agents SDK's Responses model against kvserve: test_agents' two-tool agent runs to its
final output, whole and streamed, sending the whole conversation each turn or chaining the turns
through `previous_response_id` (the server's store).

Unlike the Chat Completions model, the Responses model raises on a reply cut at its token limit
(`incomplete`). SmolLM2's last answer sometimes repeats one sentence until cut (the call ids in its
prompt are random, so greedy decoding differs from run to run), so these runs set a frequency
penalty, a field kvserve accepts on /v1/responses as vLLM does."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest
from agents import Runner, RunResult, RunResultStreaming

from conftest import serve
from test_agents import check_run, weather_agent


@pytest.fixture(scope="module")
def base_url(smollm2: Path) -> Iterator[str]:
    with serve(smollm2, threads=1) as url:
        yield url


async def run(base_url: str, calls: list[tuple[str, Any]], streamed: bool,
              chained: bool) -> RunResult | RunResultStreaming:
    agent = weather_agent(base_url, calls, api="responses")
    agent.model_settings = dataclasses.replace(agent.model_settings, extra_body={"frequency_penalty": 0.5})
    question = "What is the weather in Paris?"
    if not streamed:
        return await Runner.run(agent, question, max_turns=4, auto_previous_response_id=chained)
    result = Runner.run_streamed(agent, question, max_turns=4, auto_previous_response_id=chained)
    async for _ in result.stream_events():
        pass
    return result


@pytest.mark.parametrize("streamed", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("chained", [False, True], ids=["full-input", "previous_response_id"])
def test_agent_runs_to_its_final_output(base_url: str, streamed: bool, chained: bool) -> None:
    calls: list[tuple[str, Any]] = []
    result = asyncio.run(run(base_url, calls, streamed, chained))
    check_run(calls, result.final_output, result.new_items)
    stored = [httpx.get(f"{base_url}/v1/responses/{r.response_id}").json() for r in result.raw_responses]
    assert [r["status"] for r in stored] == ["completed"] * 3
    if chained:  # each turn continued the one before it from the store, and attached it from the cache
        assert [r["previous_response_id"] for r in stored] == [None] + [r["id"] for r in stored[:-1]]
        assert all(r["usage"]["input_tokens_details"]["cached_tokens"] > 0 for r in stored[1:])

"""The OpenAI Agents SDK's Responses model against kvserve: test_agents' steered two-tool agent runs
to its final output, whole and streamed, sending the whole conversation each turn or chaining the
turns through `previous_response_id` (the server's store). (Its other agent, left to `auto` after
the first call, may call tools until max_turns: a near-tie for SmolLM2 that the run order flips.)

Unlike the Chat Completions model, the Responses model raises on a reply cut at its token limit
(`incomplete`). SmolLM2's last answer sometimes repeats one sentence until cut (the call ids in its
prompt are random, so greedy decoding differs from run to run; a CI run saw it cut at 120 tokens
with a penalty of 0.5), so these runs set a frequency penalty of 1.0, a field kvserve accepts on
/v1/responses as vLLM does, and allow 240 tokens."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import httpx
import pytest
from agents import Agent, OpenAIResponsesModel, Runner, RunResult, RunResultStreaming
from openai import AsyncOpenAI

from test_agents import weather_agent

QUESTION = "What is the weather in Paris?"


def responses_agent(base_url: str, calls: list[tuple[str, Any]]) -> Agent:
    """test_agents' agent, served through /v1/responses."""
    agent = weather_agent(base_url, calls)
    client = AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=300)
    settings = dataclasses.replace(agent.model_settings, max_tokens=240, extra_body={"frequency_penalty": 1.0})
    return agent.clone(model=OpenAIResponsesModel(model="smollm2", openai_client=client), model_settings=settings)


async def run(agent: Agent, streamed: bool, chained: bool) -> RunResult | RunResultStreaming:
    if not streamed:
        return await Runner.run(agent, QUESTION, max_turns=4, auto_previous_response_id=chained)
    result = Runner.run_streamed(agent, QUESTION, max_turns=4, auto_previous_response_id=chained)
    async for _ in result.stream_events():
        pass
    return result


def check_store(base_url: str, result: RunResult | RunResultStreaming, chained: bool) -> None:
    """Every turn was stored; chained, each continued the one before it and attached it from the cache."""
    stored = [httpx.get(f"{base_url}/v1/responses/{r.response_id}").json() for r in result.raw_responses]
    assert all(r["status"] == "completed" for r in stored)
    previous = [r["previous_response_id"] for r in stored]
    assert previous == ([None] + [r["id"] for r in stored[:-1]] if chained else [None] * len(stored))
    if chained:
        assert all(r["usage"]["input_tokens_details"]["cached_tokens"] > 0 for r in stored[1:])


@pytest.mark.parametrize("streamed", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("chained", [False, True], ids=["full-input", "previous_response_id"])
def test_steered_agent_runs_to_its_final_output(base_url: str, streamed: bool, chained: bool) -> None:
    calls: list[tuple[str, Any]] = []
    result = asyncio.run(run(responses_agent(base_url, calls), streamed, chained))
    # the functions ran, so the SDK parsed and validated their arguments; the city is the question's
    assert [name for name, _ in calls] == ["get_weather", "to_fahrenheit"] and calls[0][1] == "Paris"
    kinds = [type(item).__name__ for item in result.new_items]
    assert kinds == ["ToolCallItem", "ToolCallOutputItem", "ToolCallItem", "ToolCallOutputItem", "MessageOutputItem"]
    assert isinstance(result.final_output, str) and result.final_output.strip()
    check_store(base_url, result, chained)

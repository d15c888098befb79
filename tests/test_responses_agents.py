"""The OpenAI Agents SDK's Responses model against kvserve: an agent with two function tools runs
to its final output, whole and streamed, sending the whole conversation each turn or chaining
turns through `previous_response_id`.

SmolLM2-135M, asked freely, calls a tool again and again; each tool here is offered until it has
been called once, so that every run ends within three turns: a forced call, a free turn with one
tool left, and a turn with none, which can only be answered in text."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Iterator

import httpx
import pytest
from agents import (
    Agent, ModelSettings, OpenAIResponsesModel, Runner, RunResult, RunResultStreaming, function_tool,
    set_tracing_disabled,
)
from agents.items import MessageOutputItem, ToolCallItem, ToolCallOutputItem
from openai import AsyncOpenAI

from conftest import serve

QUESTION = "What is the weather and the local time in Paris?"


@pytest.fixture(scope="module")
def base_url(smollm2: Path) -> Iterator[str]:
    set_tracing_disabled(True)  # the SDK would export traces to OpenAI
    with serve(smollm2, threads=1) as url:
        yield url


def weather_agent(client: AsyncOpenAI, called: list[str]) -> Agent:
    def not_yet(name: str):
        return lambda context, agent: name not in called

    @function_tool(is_enabled=not_yet("get_weather"))
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        called.append("get_weather")
        return f"Sunny and 21 C in {city}."

    @function_tool(is_enabled=not_yet("get_time"))
    def get_time(city: str) -> str:
        """The local time in a city."""
        called.append("get_time")
        return f"It is 14:05 in {city}."

    return Agent(name="assistant", instructions="Use the tools, then answer in one sentence.",
                 tools=[get_weather, get_time], model=OpenAIResponsesModel("smollm2", client),
                 model_settings=ModelSettings(tool_choice="get_weather", temperature=0, max_tokens=80))


async def run_agent(base_url: str, streamed: bool, chained: bool) -> tuple[RunResult | RunResultStreaming, list[str]]:
    called: list[str] = []
    async with AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=120) as client:
        agent = weather_agent(client, called)
        if not streamed:
            return await Runner.run(agent, QUESTION, max_turns=3, auto_previous_response_id=chained), called
        result = Runner.run_streamed(agent, QUESTION, max_turns=3, auto_previous_response_id=chained)
        async for _ in result.stream_events():
            pass
        return result, called


@pytest.mark.parametrize("streamed", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("chained", [False, True], ids=["full-input", "previous_response_id"])
def test_agent_with_two_tools_reaches_its_final_output(base_url: str, streamed: bool, chained: bool) -> None:
    result, called = asyncio.run(run_agent(base_url, streamed, chained))
    assert isinstance(result.final_output, str) and result.final_output.strip()
    assert called[0] == "get_weather" and len(set(called)) == len(called)  # forced first, each at most once
    items = result.new_items
    calls = [i for i in items if isinstance(i, ToolCallItem)]
    outputs = [i for i in items if isinstance(i, ToolCallOutputItem)]
    assert len(calls) == len(outputs) == len(called) and isinstance(items[-1], MessageOutputItem)
    assert [c.raw_item.name for c in calls] == called
    responses = [httpx.get(f"{base_url}/v1/responses/{r.response_id}").json() for r in result.raw_responses]
    assert all(r["status"] == "completed" for r in responses)
    if chained:  # each turn continued the one before it, from the server's store
        previous = [r["previous_response_id"] for r in responses]
        assert previous == [None] + [r["id"] for r in responses[:-1]]

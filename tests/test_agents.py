"""The OpenAI Agents SDK, through its Chat Completions model, runs an agent with two function tools
to its final output against kvserve serving SmolLM2.

SmolLM2-135M cannot plan a tool sequence on its own (left to `auto`, it calls the same tool turn
after turn), so the agent program steers each turn with `tool_choice`, as an application with a
fixed workflow does: first get_weather, then to_fahrenheit, then no tool. kvserve guarantees each
forced call by grammar; everything else is the SDK's own loop: it parses the calls, runs the Python
functions, sends their results back and takes the last reply as the final output.
"""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path
from typing import Any, Iterator, Literal

import pytest
from agents import (
    Agent,
    AgentHooks,
    ModelSettings,
    OpenAIChatCompletionsModel,
    OpenAIResponsesModel,
    RunContextWrapper,
    Runner,
    Tool,
    function_tool,
    set_tracing_disabled,
)
from openai import AsyncOpenAI

from conftest import serve

set_tracing_disabled(True)  # the SDK would export traces to OpenAI


@pytest.fixture(scope="module")
def base_url(smollm2: Path) -> Iterator[str]:
    with serve(smollm2, threads=1) as url:
        yield url


class Steps(AgentHooks):
    """Forces the next tool once a tool has run; after the last one, no tool."""

    def __init__(self, order: list[str]) -> None:
        self.order = order
        self.ran: list[str] = []

    async def on_tool_end(self, context: RunContextWrapper, agent: Agent, tool: Tool, result: Any) -> None:
        self.ran.append(tool.name)
        following = self.order[len(self.ran)] if len(self.ran) < len(self.order) else "none"
        agent.model_settings = dataclasses.replace(agent.model_settings, tool_choice=following)


def weather_agent(base_url: str, calls: list[tuple[str, Any]], api: Literal["chat", "responses"] = "chat") -> Agent:
    @function_tool
    def get_weather(city: str) -> str:
        """The current weather in a city, in degrees Celsius."""
        calls.append(("get_weather", city))
        return f"It is 21 degrees Celsius and sunny in {city}."

    @function_tool
    def to_fahrenheit(celsius: float) -> str:
        """Convert a temperature from Celsius to Fahrenheit."""
        calls.append(("to_fahrenheit", celsius))
        return f"{celsius * 9 / 5 + 32:.1f} degrees Fahrenheit"

    client = AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=300)
    order = ["get_weather", "to_fahrenheit"]
    model = OpenAIChatCompletionsModel if api == "chat" else OpenAIResponsesModel
    return Agent(
        name="weather",
        instructions="You answer questions about the weather in Fahrenheit. Use the tools.",
        tools=[get_weather, to_fahrenheit],
        model=model(model="smollm2", openai_client=client),
        model_settings=ModelSettings(tool_choice=order[0], parallel_tool_calls=False, temperature=0, max_tokens=120),
        reset_tool_choice=False,  # Steps decides the next choice
        hooks=Steps(order),
    )


def check_run(calls: list[tuple[str, Any]], final_output: Any, items: list) -> None:
    assert [name for name, _ in calls] == ["get_weather", "to_fahrenheit"]
    assert isinstance(calls[0][1], str) and calls[0][1]  # the SDK parsed and validated the arguments
    assert isinstance(calls[1][1], float)
    kinds = [type(item).__name__ for item in items]
    assert kinds == ["ToolCallItem", "ToolCallOutputItem", "ToolCallItem", "ToolCallOutputItem", "MessageOutputItem"]
    assert isinstance(final_output, str) and final_output.strip()


def test_agent_runs_to_its_final_output(base_url: str) -> None:
    calls: list[tuple[str, Any]] = []
    result = asyncio.run(Runner.run(weather_agent(base_url, calls), "What is the weather in Paris?", max_turns=4))
    check_run(calls, result.final_output, result.new_items)


def test_streamed_agent_runs_to_its_final_output(base_url: str) -> None:
    """The SDK's streaming path assembles calls from deltas and raises on an id or name that changes."""
    calls: list[tuple[str, Any]] = []

    async def run() -> Any:
        result = Runner.run_streamed(weather_agent(base_url, calls), "What is the weather in Paris?", max_turns=4)
        async for _ in result.stream_events():
            pass
        return result

    result = asyncio.run(run())
    check_run(calls, result.final_output, result.new_items)

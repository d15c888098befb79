"""The OpenAI Agents SDK, through its Chat Completions model, runs an agent with two function tools
to its final output against kvserve serving SmolLM2 (the generic JSON mode), streamed and not; and
one with the SDK's default loop (`required`, then `auto`) against Qwen2.5-Coder-0.5B.

The agent runs a fixed workflow, as an application that knows its steps does: it steers each turn
with `tool_choice` (get_weather, then to_fahrenheit, then no tool), because SmolLM2-135M cannot plan
two steps itself; kvserve's grammar makes each forced turn a valid call. The loop is the SDK's: it
parses the calls, runs the Python functions, sends their results back and takes the last reply as
the final output. (Left to `auto` after a first forced call, as the SDK's defaults do, SmolLM2 may
call tools until max_turns: whether it answers is a near-tie that the run order flips, so that
agent is not a test.)
"""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path
from typing import Any, Iterator

import pytest
from agents import (
    Agent,
    AgentHooks,
    ModelSettings,
    OpenAIChatCompletionsModel,
    RunContextWrapper,
    Runner,
    Tool,
    function_tool,
    set_tracing_disabled,
)
from openai import AsyncOpenAI

from conftest import serve

set_tracing_disabled(True)  # the SDK would export traces to OpenAI


class Steps(AgentHooks):
    """Forces the next tool once a tool has run; after the last one, no tool."""

    def __init__(self, order: list[str]) -> None:
        self.order = order
        self.ran: list[str] = []

    async def on_tool_end(self, context: RunContextWrapper, agent: Agent, tool: Tool, result: Any) -> None:
        self.ran.append(tool.name)
        following = self.order[len(self.ran)] if len(self.ran) < len(self.order) else "none"
        agent.model_settings = dataclasses.replace(agent.model_settings, tool_choice=following)


def weather_tools(calls: list[tuple[str, Any]]) -> list[Tool]:
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

    return [get_weather, to_fahrenheit]


def weather_agent(base_url: str, calls: list[tuple[str, Any]]) -> Agent:
    client = AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=300)
    order = ["get_weather", "to_fahrenheit"]
    return Agent(
        name="weather",
        instructions="You answer questions about the weather. Use the tools.",
        tools=weather_tools(calls),
        model=OpenAIChatCompletionsModel(model="smollm2", openai_client=client),
        model_settings=ModelSettings(tool_choice=order[0], parallel_tool_calls=False,
                                     temperature=0, max_tokens=120),
        reset_tool_choice=False,
        hooks=Steps(order),
    )


async def run_agent(agent: Agent, streamed: bool) -> Any:
    question = "What is the weather in Paris?"
    if not streamed:
        return await Runner.run(agent, question, max_turns=4)
    # The SDK's streaming path assembles calls from deltas and raises on an id or name that changes.
    result = Runner.run_streamed(agent, question, max_turns=4)
    async for _ in result.stream_events():
        pass
    return result


@pytest.mark.parametrize("streamed", [False, True], ids=["whole", "streamed"])
def test_agent_with_a_steered_workflow(base_url: str, streamed: bool) -> None:
    calls: list[tuple[str, Any]] = []
    result = asyncio.run(run_agent(weather_agent(base_url, calls), streamed))
    # the functions ran, so the SDK parsed and validated their arguments; the city is the question's
    assert [name for name, _ in calls] == ["get_weather", "to_fahrenheit"] and calls[0][1] == "Paris"
    kinds = [type(item).__name__ for item in result.new_items]
    assert kinds == ["ToolCallItem", "ToolCallOutputItem", "ToolCallItem", "ToolCallOutputItem", "MessageOutputItem"]
    assert isinstance(result.final_output, str) and result.final_output.strip()


# --- Qwen2.5-Coder: the calls a real Hermes-style model writes ------------------------------------


@pytest.fixture(scope="module")
def qwen_url(qwen_coder: Path) -> Iterator[str]:
    with serve(qwen_coder, threads=2, ctx_size=2048) as url:
        yield url


def test_agent_with_the_sdks_defaults_reaches_an_answer(qwen_url: str) -> None:
    """The SDK's own loop: `required` makes turn 1 a call (Qwen2.5-Coder writes `add_numbers(2, 3)`),
    then `reset_tool_choice` turns the choice to `auto`. Given the result, this 0.5B model writes the
    bare object `{"name": "add_numbers", "arguments": ...}` as plain text, where its template asks for
    `<tool_call>` tags: that text is the answer, not a call, so the run ends at turn 2 rather than
    calling again until `MaxTurnsExceeded`."""
    calls: list[tuple[int, int]] = []

    @function_tool
    def add_numbers(a: int, b: int) -> int:
        """Add two integers."""
        calls.append((a, b))
        return a + b

    client = AsyncOpenAI(base_url=f"{qwen_url}/v1", api_key="unused", max_retries=0, timeout=900)
    agent = Agent(name="calculator", instructions="Use the tools.", tools=[add_numbers],
                  model=OpenAIChatCompletionsModel(model="qwen", openai_client=client),
                  model_settings=ModelSettings(tool_choice="required", temperature=0, max_tokens=40),
                  reset_tool_choice=True)
    result = asyncio.run(Runner.run(agent, "What is 2 + 3?", max_turns=4))
    assert calls == [(2, 3)]
    kinds = [type(item).__name__ for item in result.new_items]
    assert kinds == ["ToolCallItem", "ToolCallOutputItem", "MessageOutputItem"]
    assert isinstance(result.final_output, str) and result.final_output.strip()

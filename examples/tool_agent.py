"""A small tool-using agent against a running kvserve, with only the standard library.

The loop every agent framework runs: send the conversation and the tools, run the calls the model
makes, send their results back, stop at a reply without calls. The first turn requires a call
(kvserve enforces it by grammar); a small model may keep calling, so the last allowed turn sets
tool_choice to none and the model answers from what the tools returned.

Run: kvserve &  then  python examples/tool_agent.py [--url http://127.0.0.1:8000] [question]
"""

from __future__ import annotations

import argparse
import json
import urllib.request
from typing import Any, Callable


def get_weather(city: str) -> str:
    return f"It is 21 degrees Celsius and sunny in {city}."


def to_fahrenheit(celsius: float) -> str:
    return f"{celsius * 9 / 5 + 32:.1f} degrees Fahrenheit"


FUNCTIONS: dict[str, Callable[..., str]] = {"get_weather": get_weather, "to_fahrenheit": to_fahrenheit}
TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "The current weather in a city, in degrees Celsius.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
    {"type": "function", "function": {
        "name": "to_fahrenheit", "description": "Convert a temperature from Celsius to Fahrenheit.",
        "parameters": {"type": "object", "properties": {"celsius": {"type": "number"}}, "required": ["celsius"]}}},
]


def chat(url: str, messages: list[dict[str, Any]], tool_choice: str) -> dict[str, Any]:
    body = {"messages": messages, "tools": TOOLS, "tool_choice": tool_choice, "temperature": 0, "max_tokens": 200}
    request = urllib.request.Request(f"{url}/v1/chat/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=300) as response:
        return json.load(response)["choices"][0]["message"]


def run_agent(url: str, question: str, max_turns: int = 4) -> str:
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You answer questions about the weather. Use the tools."},
        {"role": "user", "content": question},
    ]
    for turn in range(max_turns):
        choice = "required" if turn == 0 else "none" if turn == max_turns - 1 else "auto"
        message = chat(url, messages, choice)
        messages.append(message)
        if not message.get("tool_calls"):
            return message["content"]
        for call in message["tool_calls"]:
            arguments = json.loads(call["function"]["arguments"])
            result = FUNCTIONS[call["function"]["name"]](**arguments)
            print(f"called {call['function']['name']}({arguments}) -> {result}")
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": result})
    raise RuntimeError("unreachable: the last turn has tool_choice none")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("question", nargs="?", default="What is the weather in Paris?")
    args = parser.parse_args()
    print(f"answer: {run_agent(args.url, args.question)}")


if __name__ == "__main__":
    main()

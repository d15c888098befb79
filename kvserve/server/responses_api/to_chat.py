"""A Responses request as the chat request kvserve already serves: items become chat messages,
`text.format` a `response_format`, and errors about chat fields name the Responses field instead."""

from __future__ import annotations

import re
from contextlib import AbstractContextManager
from typing import Any

from pydantic import ValidationError

from kvserve.server.errors import invalid, invalid_body, respelled
from kvserve.server.responses_api.schemas import (
    CreateResponse, FunctionCallItem, FunctionCallOutputItem, FunctionChoice, InputItem, MessageItem, ReasoningItem,
    TextFormat, ToolChoice, content_text,
)
from kvserve.server.schemas import ChatCompletionRequest

# How chat's parameters are spelled in a Responses request: chat message indexes do not count
# input items, so no index is kept; a tool's fields sit on the tool itself, not in `function`.
_RESPONSES_PARAMS = (
    (re.compile(r"^messages\b.*"), "input"),
    (re.compile(r"^response_format\b.*"), "text.format"),
    (re.compile(r"^max_completion_tokens$"), "max_output_tokens"),
    (re.compile(r"^reasoning_effort$"), "reasoning.effort"),
    (re.compile(r"^(tools\[\d+\])\.function"), r"\1"),
)


def chat_request(body: CreateResponse, history: list[InputItem]) -> ChatCompletionRequest:
    """The chat request for `body` continuing `history` (the items of the responses before it)."""
    messages = [{"role": "system", "content": body.instructions}] if body.instructions else []
    messages += chat_messages(history + body.items)
    if not messages:
        raise invalid("the input is empty", "input")
    fields = {
        "messages": messages,
        "model": body.model,  # an adapter's name picks it
        "max_completion_tokens": body.max_output_tokens,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "frequency_penalty": body.frequency_penalty,
        "presence_penalty": body.presence_penalty,
        "logprobs": body.wants_logprobs,
        "top_logprobs": body.top_logprobs if body.wants_logprobs else None,  # without include, none are returned
        "response_format": _response_format(body.text.format),
        "user": body.user,
        "cache_salt": body.cache_salt,
        "reasoning_effort": body.reasoning.effort if body.reasoning else None,
        "reasoning_budget": body.reasoning_budget,
        **_tool_fields(body),
    }
    with in_responses_terms():
        try:
            return ChatCompletionRequest.model_validate({k: v for k, v in fields.items() if v is not None})
        except ValidationError as exc:
            raise invalid_body(exc.errors()) from exc


def chat_messages(items: list[InputItem]) -> list[dict[str, Any]]:
    """Chat messages in order; function calls in a row (and the text before them) are one assistant
    turn, and reasoning items the thinking of the assistant turn that follows them."""
    messages: list[dict[str, Any]] = []
    reasoning = ""  # of the next assistant turn
    for item in items:
        if isinstance(item, ReasoningItem):
            reasoning += item.text
        elif isinstance(item, MessageItem):
            messages.append({"role": item.role, "content": content_text(item.content)})
            if item.role == "assistant" and reasoning:
                messages[-1]["reasoning_content"], reasoning = reasoning, ""
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            if messages and messages[-1]["role"] == "assistant" and not reasoning:
                messages[-1].setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
                if reasoning:
                    messages[-1]["reasoning_content"], reasoning = reasoning, ""
        elif isinstance(item, FunctionCallOutputItem):
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": content_text(item.output)})
    return messages


def _tool_fields(body: CreateResponse) -> dict[str, Any]:
    """Chat's `tools`, `tool_choice` and `parallel_tool_calls`; without tools only the choices
    that ask for no call are served (they are the default)."""
    choice = body.tool_choice
    if not body.tools:
        return {} if choice in ("auto", "none") else {"tool_choice": _chat_choice(choice)}
    tools = [{"type": "function", "function": tool.model_dump(exclude={"type"})} for tool in body.tools]
    return {"tools": tools, "tool_choice": _chat_choice(choice), "parallel_tool_calls": body.parallel_tool_calls}


def _chat_choice(choice: ToolChoice) -> str | dict[str, Any]:
    if isinstance(choice, str):
        return choice
    if isinstance(choice, FunctionChoice):
        return {"type": "function", "function": {"name": choice.name}}
    named = [{"type": "function", "function": {"name": tool.name}} for tool in choice.tools]
    return {"type": "allowed_tools", "allowed_tools": {"mode": choice.mode, "tools": named}}


def _response_format(text: TextFormat) -> dict[str, Any]:
    if text.type != "json_schema":
        return {"type": text.type}
    return {"type": "json_schema", "json_schema": {"name": text.name, "schema": text.schema_, "strict": text.strict}}


def in_responses_terms() -> AbstractContextManager[None]:
    """Errors raised inside (by code shared with chat) name Responses parameters."""
    return respelled(_RESPONSES_PARAMS)

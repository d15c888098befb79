"""A Messages request as the chat request kvserve already serves: blocks become chat messages,
tools and the tool choice chat's, and errors about chat fields name the Messages field instead."""

from __future__ import annotations

import json
import re
from contextlib import AbstractContextManager
from typing import Any

from pydantic import ValidationError

from kvserve.server.errors import invalid_body, respelled
from kvserve.server.messages_api.schemas import (
    AnyChoice, CountTokens, CreateMessage, InputMessage, NamedChoice, NoChoice, TextBlock, ThinkingBlock,
    ThinkingDisabled, ThinkingEnabled, ToolResultBlock, ToolUseBlock,
)
from kvserve.server.schemas import ChatCompletionRequest

# How chat's parameters are spelled in a Messages request: chat message indexes do not count
# Messages' (a tool result is a message of its own), so none is kept.
_MESSAGES_PARAMS = (
    (re.compile(r"^messages\b.*"), "messages"),
    (re.compile(r"^(tools\[\d+\])\.function\.parameters"), r"\1.input_schema"),
    (re.compile(r"^(tools\[\d+\])\.function"), r"\1"),
    (re.compile(r"^max_completion_tokens$"), "max_tokens"),
    (re.compile(r"^stop$"), "stop_sequences"),
    (re.compile(r"^parallel_tool_calls$"), "tool_choice.disable_parallel_tool_use"),
    (re.compile(r"^user$"), "metadata.user_id"),
    (re.compile(r"^cache_salt$"), "metadata.cache_salt"),
    (re.compile(r"^reasoning_budget$"), "thinking.budget_tokens"),
)


def chat_request(body: CountTokens) -> ChatCompletionRequest:
    """The chat request `body` is served (or counted) as."""
    messages = [{"role": "system", "content": _text(body.system)}] if body.system else []
    for message in body.messages:
        messages += chat_messages(message)
    fields: dict[str, Any] = {"messages": messages, "model": body.model,  # an adapter's name picks it
                              **_tool_fields(body), **_thinking_fields(body.thinking)}
    if isinstance(body, CreateMessage):
        fields.update(max_completion_tokens=body.max_tokens, stop=body.stop_sequences, temperature=body.temperature,
                      top_p=body.top_p, top_k=body.top_k, user=body.metadata and body.metadata.user_id,
                      cache_salt=body.metadata and body.metadata.cache_salt)
    with in_messages_terms():
        try:
            return ChatCompletionRequest.model_validate({k: v for k, v in fields.items() if v is not None})
        except ValidationError as exc:
            raise invalid_body(exc.errors()) from exc


def chat_messages(message: InputMessage) -> list[dict[str, Any]]:
    """One message's blocks as chat messages, in order: an assistant's text and calls are one
    message; a user's tool results are tool messages, its text a user message between them."""
    if isinstance(message.content, str):
        return [{"role": message.role, "content": message.content}]
    out: list[dict[str, Any]] = []
    for block in message.content:
        if isinstance(block, ToolResultBlock):
            content = _text(block.content)
            out.append({"role": "tool", "tool_call_id": block.tool_use_id,
                        "content": f"Error: {content}" if block.is_error else content})
            continue
        if not out or out[-1]["role"] != message.role:
            out.append({"role": message.role, "content": []})
        if isinstance(block, TextBlock):
            out[-1]["content"].append({"type": "text", "text": block.text})
        elif isinstance(block, ThinkingBlock):
            out[-1]["reasoning_content"] = out[-1].get("reasoning_content", "") + block.thinking
        elif isinstance(block, ToolUseBlock):
            call = {"id": block.id, "type": "function",
                    "function": {"name": block.name, "arguments": json.dumps(block.input, ensure_ascii=False)}}
            out[-1].setdefault("tool_calls", []).append(call)
    return out or [{"role": message.role, "content": ""}]


def _thinking_fields(thinking: ThinkingEnabled | ThinkingDisabled | None) -> dict[str, Any]:
    """`enabled`: its budget; `disabled`: the template told not to think (where it has that
    switch) and a budget of nothing, so thinking a model starts anyway is closed at once."""
    if isinstance(thinking, ThinkingEnabled):
        return {"reasoning_budget": thinking.budget_tokens}
    if isinstance(thinking, ThinkingDisabled):
        return {"reasoning_budget": 0, "chat_template_kwargs": {"enable_thinking": False}}
    return {}


def _text(content: str | list[TextBlock]) -> str:
    return content if isinstance(content, str) else "".join(block.text for block in content)


def _tool_fields(body: CountTokens) -> dict[str, Any]:
    """Chat's `tools`, `tool_choice` and `parallel_tool_calls`."""
    choice = body.tool_choice
    chat_choice: Any = None
    if isinstance(choice, NoChoice):
        chat_choice = "none"
    elif isinstance(choice, AnyChoice):
        chat_choice = "required"
    elif isinstance(choice, NamedChoice):
        chat_choice = {"type": "function", "function": {"name": choice.name}}
    elif choice is not None:
        chat_choice = "auto"
    if not body.tools:
        return {} if chat_choice in (None, "auto", "none") else {"tool_choice": chat_choice}
    tools = [{"type": "function", "function": {"name": t.name, "description": t.description,
                                               "parameters": t.input_schema}} for t in body.tools]
    parallel = not (choice is not None and not isinstance(choice, NoChoice) and choice.disable_parallel_tool_use)
    return {"tools": tools, "tool_choice": chat_choice, "parallel_tool_calls": parallel}


def in_messages_terms() -> AbstractContextManager[None]:
    """Errors raised inside (by code shared with chat) name Messages parameters."""
    return respelled(_MESSAGES_PARAMS)

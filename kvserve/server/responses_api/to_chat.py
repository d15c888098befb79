"""A Responses request as the chat request kvserve already serves: items become chat messages,
`text.format` a `response_format`, and errors about chat fields name the Responses field instead."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

from pydantic import ValidationError

from kvserve.server.errors import APIError, invalid, invalid_body
from kvserve.server.responses_api.schemas import (
    CreateResponse, FunctionCallItem, FunctionCallOutputItem, InputItem, MessageItem, TextFormat, content_text,
)
from kvserve.server.schemas import ChatCompletionRequest

# Chat parameters (and their prefixes) that a Responses request spells differently.
_RESPONSES_PARAM = {"messages": "input", "response_format": "text.format", "max_completion_tokens": "max_output_tokens"}


def chat_request(body: CreateResponse, history: list[InputItem]) -> ChatCompletionRequest:
    """The chat request for `body` continuing `history` (the items of the responses before it)."""
    messages = [{"role": "system", "content": body.instructions}] if body.instructions else []
    messages += chat_messages(history + body.items)
    if not messages:
        raise invalid("the input is empty", "input")
    fields = {
        "messages": messages,
        "max_completion_tokens": body.max_output_tokens,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "logprobs": body.wants_logprobs,
        "top_logprobs": body.top_logprobs,
        "response_format": _response_format(body.text.format),
        "user": body.user,
    }
    with in_responses_terms():
        try:
            return ChatCompletionRequest.model_validate({k: v for k, v in fields.items() if v is not None})
        except ValidationError as exc:
            raise invalid_body(exc.errors()) from exc


def chat_messages(items: list[InputItem]) -> list[dict[str, Any]]:
    """Chat messages in order; function calls in a row (and the text before them) are one assistant turn."""
    messages: list[dict[str, Any]] = []
    for item in items:
        if isinstance(item, MessageItem):
            messages.append({"role": item.role, "content": content_text(item.content)})
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            if messages and messages[-1]["role"] == "assistant":
                messages[-1].setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif isinstance(item, FunctionCallOutputItem):
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": content_text(item.output)})
    return messages


def _response_format(text: TextFormat) -> dict[str, Any]:
    if text.type != "json_schema":
        return {"type": text.type}
    return {"type": "json_schema", "json_schema": {"name": text.name, "schema": text.schema_, "strict": text.strict}}


@contextmanager
def in_responses_terms() -> Iterator[None]:
    """Errors raised inside (by code shared with chat) name Responses parameters."""
    try:
        yield
    except APIError as exc:
        raise _renamed(exc) from exc


def _renamed(error: APIError) -> APIError:
    detail = error.body["error"]
    param = detail["param"]
    for chat, responses in _RESPONSES_PARAM.items():
        if param is not None and (param == chat or param.startswith((f"{chat}.", f"{chat}["))):
            param = responses  # chat message indexes do not count input items, so no index is kept
            break
    return APIError(error.status, detail["message"], type=detail["type"], param=param, code=detail["code"],
                    headers=error.headers)

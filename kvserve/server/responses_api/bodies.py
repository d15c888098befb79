"""The response object of the Responses API and its output items, as JSON-ready dicts."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from kvserve.scheduler.request import Usage
from kvserve.server.responses_api.schemas import (
    CreateResponse, FunctionCallItem, InputItem, MessageItem, ReasoningItem, TextContent, TextFormat,
)


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


# An item's id begins with its type's prefix, whoever made it: an answer's output or an input item.
ITEM_ID_PREFIXES = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}


def new_item_id(item_type: str) -> str:
    return new_id(ITEM_ID_PREFIXES[item_type])


@dataclass
class ResponseHead:
    """What a response says whatever its state: its id, the model, and the request's settings echoed."""

    request: CreateResponse
    model: str
    id: str = field(default_factory=lambda: new_id("resp"))
    created_at: int = field(default_factory=lambda: int(time.time()))

    def body(self, status: str, output: list[dict], usage: Usage | None = None, *,
             error: dict | None = None, incomplete: dict | None = None) -> dict:
        r = self.request
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "background": False,
            "error": error,
            "incomplete_details": incomplete,
            "instructions": r.instructions,
            "max_output_tokens": r.max_output_tokens,
            "metadata": r.metadata or {},
            "model": self.model,
            "output": output,
            "parallel_tool_calls": r.parallel_tool_calls,
            "previous_response_id": r.previous_response_id,
            # the effort asked (told to the template); no summary is written
            "reasoning": {"effort": r.reasoning.effort, "summary": None} if r.reasoning is not None else None,
            "store": r.store,
            "temperature": 1.0 if r.temperature is None else r.temperature,
            "text": {"format": _format_body(r.text.format)},
            "tool_choice": r.tool_choice if isinstance(r.tool_choice, str) else r.tool_choice.model_dump(),
            "tools": [tool.model_dump() for tool in r.tools],
            "top_logprobs": r.top_logprobs or 0,
            "top_p": 1.0 if r.top_p is None else r.top_p,
            "truncation": "disabled",
            "usage": usage_body(usage) if usage is not None else None,
            "user": r.user,
        }


def _format_body(text: TextFormat) -> dict[str, Any]:
    if text.type != "json_schema":
        return {"type": text.type}
    return {"type": "json_schema", "name": text.name, "schema": text.schema_, "description": text.description,
            "strict": text.strict}


def usage_body(usage: Usage) -> dict:
    return {
        "input_tokens": usage.prompt_tokens,
        # kvserve's prefix cache is implicit: prompts are cached as they are served, nothing is
        # written on request, and OpenAI counts cache writes only for requested (explicit) caching.
        "input_tokens_details": {"cached_tokens": usage.cached_tokens, "cache_write_tokens": 0},
        "output_tokens": usage.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": usage.reasoning_tokens},
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
    }


def output_text(text: str, logprobs: list[dict]) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs}


def message_item(item_id: str, status: str, content: list[dict]) -> dict:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": content}


def reasoning_item(item_id: str, status: str, text: str | None) -> dict:
    """The thinking of a reply, as OpenAI returns an open model's: its text as `reasoning_text`
    content (None: none yet), no summary, nothing encrypted."""
    content = [] if text is None else [reasoning_text(text)]
    return {"type": "reasoning", "id": item_id, "summary": [], "content": content, "encrypted_content": None,
            "status": status}


def reasoning_text(text: str) -> dict:
    return {"type": "reasoning_text", "text": text}


def function_call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict:
    return {"type": "function_call", "id": item_id, "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}


def as_input(item: dict) -> InputItem:
    """An output item as the input item a continuation reads it back as, under the same id."""
    if item["type"] == "function_call":
        return FunctionCallItem(type="function_call", id=item["id"], call_id=item["call_id"], name=item["name"],
                                arguments=item["arguments"])
    if item["type"] == "reasoning":
        return ReasoningItem.model_validate(item)
    text = "".join(part["text"] for part in item["content"])
    return MessageItem(id=item["id"], role="assistant", content=[TextContent(type="output_text", text=text)])

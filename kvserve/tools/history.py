"""A conversation with earlier calls and their results, as the chat template expects it.

Templates that know tools get OpenAI's message shapes with the arguments parsed to objects (what
they were written against; arguments that are not valid JSON stay a string, which the template
prints as text). A template that knows nothing of tools gets the calls as the JSON the generic
mode asks the model to write, and each result as a user message.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

from kvserve.tools.formats import ToolFormat

_ALPHANUMERIC = "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"


@dataclass(frozen=True)
class HistoryCall:
    id: str
    name: str
    arguments: str  # JSON text, as the client sent it back


@dataclass(frozen=True)
class ChatTurn:
    """One message of a conversation: `tool_calls` on assistant turns, `tool_call_id` on tool results."""

    role: str  # system, user, assistant or tool
    content: str = ""
    tool_calls: tuple[HistoryCall, ...] = ()
    tool_call_id: str | None = None
    reasoning: str = ""  # an assistant turn's thinking, for templates that keep (or drop) it themselves


def template_messages(fmt: ToolFormat, turns: list[ChatTurn]) -> list[dict[str, Any]]:
    names = {call.id: call.name for turn in turns for call in turn.tool_calls}
    if fmt is ToolFormat.GENERIC:
        return [_generic_message(turn, names) for turn in turns]
    return [_tool_aware_message(fmt, turn, names) for turn in turns]


def _tool_aware_message(fmt: ToolFormat, turn: ChatTurn, names: dict[str, str]) -> dict[str, Any]:
    message: dict[str, Any] = {"role": turn.role, "content": turn.content, **_reasoning(turn)}
    if turn.tool_calls:
        message["tool_calls"] = [
            {"id": _call_id(fmt, c.id), "type": "function",
             "function": {"name": c.name, "arguments": _arguments(c.arguments)}}
            for c in turn.tool_calls
        ]
    if turn.role == "tool":
        message["tool_call_id"] = _call_id(fmt, turn.tool_call_id or "")
        message["name"] = names.get(turn.tool_call_id or "", "")
    return message


def _generic_message(turn: ChatTurn, names: dict[str, str]) -> dict[str, Any]:
    if turn.role == "tool":
        name = names.get(turn.tool_call_id or "", "a tool")
        return {"role": "user", "content": f"Result of {name} (call {turn.tool_call_id}):\n{turn.content}"}
    if turn.tool_calls:
        calls = [{"name": c.name, "arguments": _arguments(c.arguments)} for c in turn.tool_calls]
        written = json.dumps({"tool_calls": calls}, ensure_ascii=False)
        return {"role": turn.role, "content": f"{turn.content}\n{written}" if turn.content else written,
                **_reasoning(turn)}
    return {"role": turn.role, "content": turn.content, **_reasoning(turn)}


def _reasoning(turn: ChatTurn) -> dict[str, Any]:
    """An earlier turn's thinking under the names templates read it by (Qwen3 and R1 distills:
    `reasoning_content`, gpt-oss: `thinking`); a template that names neither drops it."""
    return {"reasoning_content": turn.reasoning, "thinking": turn.reasoning} if turn.reasoning else {}


def _arguments(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


def _call_id(fmt: ToolFormat, call_id: str) -> str:
    """Mistral's templates refuse any id but nine alphanumerics; a digest keeps call and result paired."""
    if fmt is not ToolFormat.MISTRAL:
        return call_id
    number = int.from_bytes(hashlib.sha256(call_id.encode()).digest()[:8], "big")
    return "".join(_ALPHANUMERIC[(number // 62**i) % 62] for i in range(9))

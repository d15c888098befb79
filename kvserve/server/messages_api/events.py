"""A message built from the scheduler's outputs, as the event sequence Anthropic's Messages API
streams; a whole (non-streamed) message is the same build with the events dropped, so both agree."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

from kvserve.scheduler.request import Delta, FinishReason, RequestOutput, Usage
from kvserve.server.errors import anthropic_error_body
from kvserve.reply import Ended, ReasoningDelta, ReplyEvent, ReplyPlan
from kvserve.tools import ArgumentsDelta, CallStarted
from kvserve.tools.parser import TOOL_CALLS

# Chat's finish reason (after the tool parser's reading) as Anthropic's stop reason; a plain stop
# is `end_turn`, or `stop_sequence` when a stop sequence ended it.
_STOP_REASONS = {"length": "max_tokens", TOOL_CALLS: "tool_use"}


@dataclass(frozen=True)
class MessageHead:
    model: str
    input_tokens: int  # the whole prompt, as message_start reports it before the cache's share is known
    max_tokens: int  # as asked: a reply cut short of it ran out of context
    id: str = field(default_factory=lambda: f"msg_{uuid.uuid4().hex}")

    def body(self, content: list[dict], stop_reason: str | None, stop_sequence: str | None, usage: dict) -> dict:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": content,
                "stop_reason": stop_reason, "stop_sequence": stop_sequence, "usage": usage}


def usage_body(usage: Usage) -> dict:
    """Anthropic's split of the prompt: `input_tokens` are those read after the cache's share
    (`cache_read_input_tokens`, what the prefix cache attached). kvserve caches every prompt as it
    serves it, so nothing counts as a requested cache write."""
    return {"input_tokens": usage.prompt_tokens - usage.cached_tokens, "output_tokens": usage.completion_tokens,
            "cache_read_input_tokens": usage.cached_tokens, "cache_creation_input_tokens": 0}


@dataclass
class _OpenBlock:
    """The content block being written: text, thinking, or a tool call when `call` is set."""

    index: int
    kind: str = "text"  # text, thinking or tool_use
    call: CallStarted | None = None
    text: str = ""  # the text, the thinking, or the call's input as JSON text

    def body(self) -> dict:
        if self.kind == "thinking":
            return {"type": "thinking", "thinking": self.text, "signature": ""}
        if self.call is None:
            return {"type": "text", "text": self.text}
        return {"type": "tool_use", "id": self.call.id, "name": self.call.name, "input": _input(self.text)}


def _input(arguments: str) -> dict:
    """A call's input as an object; a call cut short (by max_tokens) has the input `{}`."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


class MessageEvents:
    """The events of one message in Anthropic's documented order, and the message they add up to.

    Invariants: `message_start` comes first and a `ping` right after the first
    `content_block_start`; blocks are indexed 0, 1, 2, ... in order, at most one is open, and each
    is stopped before the next starts and before `message_delta` (the stop reason and the final,
    cumulative usage), which `message_stop` follows; a message has at least one block (an empty
    text block when the model said nothing). The reply is read once (`ReplyReader`): its thinking
    becomes `thinking` blocks (their signature empty: nothing here signs them), its answer text
    blocks, its calls `tool_use` blocks. `message` (set by the last output) is the whole message;
    an engine error ends the events with an `error` event instead.
    """

    def __init__(self, head: MessageHead, reply: ReplyPlan) -> None:
        self.head = head
        self.content: list[dict] = []
        self.message: dict | None = None
        self.finish_reasons: list[str] = []  # chat's finish reason of the reply, once it ended
        self._reader = reply.reader()
        self._block: _OpenBlock | None = None
        self._finish: Delta | None = None  # the delta that ended the reply
        self._chat_reason = FinishReason.STOP.value

    def started(self) -> list[dict]:
        usage = {"input_tokens": self.head.input_tokens, "output_tokens": 0, "cache_read_input_tokens": 0,
                 "cache_creation_input_tokens": 0}
        return [{"type": "message_start", "message": self.head.body([], None, None, usage)}]

    def feed(self, output: RequestOutput) -> list[dict]:
        """The events one scheduler output adds; the last output (usage or error) ends the message."""
        if output.error is not None:
            return [anthropic_error_body(output.status, output.error)]
        events: list[dict] = []
        for delta in output.deltas:
            pieces = self._reader.feed(delta.text)
            if delta.finish_reason is not None:
                self._finish = delta
                pieces += self._reader.finish(delta.finish_reason.value)
            for piece in pieces:
                events += self._piece(piece)
        if output.usage is not None:
            events += self._finished(output.usage)
        return events

    def _piece(self, piece: ReplyEvent) -> list[dict]:
        if isinstance(piece, Ended):
            self._chat_reason = piece.finish_reason
            return []
        if isinstance(piece, CallStarted):
            return self._close() + self._open("tool_use", piece)
        if isinstance(piece, ArgumentsDelta):
            self._block.text += piece.text
            return [self._delta({"type": "input_json_delta", "partial_json": piece.text})]
        kind, field = ("thinking", "thinking") if isinstance(piece, ReasoningDelta) else ("text", "text")
        events = [] if self._block is not None and self._block.kind == kind else self._close() + self._open(kind)
        self._block.text += piece.text
        return events + [self._delta({"type": f"{kind}_delta", field: piece.text})]

    def _delta(self, delta: dict, block: _OpenBlock | None = None) -> dict:
        return {"type": "content_block_delta", "index": (block or self._block).index, "delta": delta}

    def _open(self, kind: str = "text", call: CallStarted | None = None) -> list[dict]:
        self._block = block = _OpenBlock(len(self.content), kind, call)
        start = {"type": "tool_use", "id": call.id, "name": call.name, "input": {}} if call else block.body()
        events = [{"type": "content_block_start", "index": block.index, "content_block": start}]
        return events + [{"type": "ping"}] if block.index == 0 else events

    def _close(self) -> list[dict]:
        block, self._block = self._block, None
        if block is None:
            return []
        self.content.append(block.body())
        signed = [self._delta({"type": "signature_delta", "signature": ""}, block)] if block.kind == "thinking" else []
        return signed + [{"type": "content_block_stop", "index": block.index}]

    def _finished(self, usage: Usage) -> list[dict]:
        events = self._open() if not self.content and self._block is None else []
        events += self._close()
        chat_reason = self._chat_reason
        self.finish_reasons.append(chat_reason)
        stop_sequence = self._finish.stop_sequence if self._finish is not None else None
        stop_reason = _STOP_REASONS.get(chat_reason, "stop_sequence" if stop_sequence else "end_turn")
        if stop_reason == "max_tokens" and usage.completion_tokens < self.head.max_tokens:
            stop_reason = "model_context_window_exceeded"
        if stop_reason != "stop_sequence":
            stop_sequence = None
        self.message = self.head.body(self.content, stop_reason, stop_sequence, usage_body(usage))
        return events + [
            {"type": "message_delta", "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
             "usage": self.message["usage"]},
            {"type": "message_stop"},
        ]

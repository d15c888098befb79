"""A response built from the scheduler's outputs, as the event sequence the Responses API streams;
a whole (non-streamed) response is the same build with the events dropped, so both agree."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from kvserve.scheduler.request import Delta, FinishReason, RequestOutput
from kvserve.server.responses import LogprobFormatter
from kvserve.server.responses_api.bodies import (
    ResponseHead, function_call_item, message_item, new_id, output_text,
)
from kvserve.tools import ArgumentsDelta, CallStarted, ContentDelta, ToolEvent, ToolPlan


@dataclass
class _OpenItem:
    """The output item being written: a message, or a function call when `call` is set."""

    id: str
    output_index: int
    call: CallStarted | None = None
    text: str = ""  # the message's text, or the call's arguments
    logprobs: list[dict] = field(default_factory=list)


class ResponseEvents:
    """The events of one response, in the documented order, and the response they add up to.

    Invariants: sequence numbers run 0, 1, 2, ... without gaps; at most one output item is open and
    it is closed (its `.done` events sent) before the next opens and before the terminal event;
    `output` holds the closed items in order, and `final` (set by the terminal event) is the whole
    response. With tools, the reply is split by the tools' parser: its content becomes messages,
    its calls `function_call` items; logprobs belong to content only (a call's item has none), so
    those of call syntax are dropped.
    """

    def __init__(self, head: ResponseHead, logprobs: LogprobFormatter | None, tools: ToolPlan | None) -> None:
        self.head = head
        self.output: list[dict] = []
        self.final: dict | None = None
        self._logprobs = logprobs  # None: the client did not ask for them
        self._parser = tools.parser() if tools is not None else None
        self._sequence = itertools.count()
        self._item: _OpenItem | None = None
        self._unplaced_logprobs: list[dict] = []  # of text the parser holds back
        self._finish: FinishReason | None = None
        self.finish_reasons: list[str] = []  # chat's finish reason of the reply, once it ended

    def started(self) -> list[dict]:
        body = self.head.body("in_progress", [])
        return [self._event("response.created", response=body), self._event("response.in_progress", response=body)]

    def feed(self, output: RequestOutput) -> list[dict]:
        """The events one scheduler output adds; the last output (usage or error) ends the response."""
        if output.error is not None:
            return self._failed(output.error)
        events: list[dict] = []
        for delta in output.deltas:
            if self._logprobs is not None:
                self._unplaced_logprobs += self._logprobs.chat(delta.logprobs)
            for piece in self._pieces(delta):
                events += self._piece(piece)
            self._finish = delta.finish_reason or self._finish
        if output.usage is not None:
            events += self._finished(output)
        return events

    def _pieces(self, delta: Delta) -> list[ToolEvent]:
        if self._parser is None:
            # An empty delta that carries logprobs (a token that ends no character) is still sent.
            return [ContentDelta(delta.text)] if delta.text or delta.logprobs else []
        return self._parser.feed(delta.text) + (self._parser.finish() if delta.finish_reason is not None else [])

    def _piece(self, piece: ToolEvent) -> list[dict]:
        if isinstance(piece, ContentDelta):
            return self._text(piece.text)
        if isinstance(piece, CallStarted):
            self._unplaced_logprobs = []
            return self._close("completed") + self._open_call(piece)
        item = self._item
        item.text += piece.text
        return [self._event("response.function_call_arguments.delta", item_id=item.id,
                            output_index=item.output_index, delta=piece.text)]

    def _event(self, kind: str, **fields: object) -> dict:
        return {"type": kind, "sequence_number": next(self._sequence), **fields}

    def _text(self, delta: str) -> list[dict]:
        opened = self._item is not None and self._item.call is None
        events = [] if opened else self._close("completed") + self._open_message()
        item, logprobs = self._item, self._unplaced_logprobs
        self._unplaced_logprobs = []
        item.text += delta
        item.logprobs += logprobs
        return events + [self._event("response.output_text.delta", item_id=item.id, output_index=item.output_index,
                                     content_index=0, delta=delta, logprobs=logprobs)]

    def _open_message(self) -> list[dict]:
        self._item = item = _OpenItem(new_id("msg"), len(self.output))
        return [
            self._event("response.output_item.added", output_index=item.output_index,
                        item=message_item(item.id, "in_progress", [])),
            self._event("response.content_part.added", item_id=item.id, output_index=item.output_index,
                        content_index=0, part=output_text("", [])),
        ]

    def _open_call(self, call: CallStarted) -> list[dict]:
        self._item = item = _OpenItem(new_id("fc"), len(self.output), call)
        return [self._event("response.output_item.added", output_index=item.output_index,
                            item=function_call_item(item.id, call.id, call.name, "", "in_progress"))]

    def _close(self, status: str) -> list[dict]:
        item, self._item = self._item, None
        if item is None:
            return []
        where = {"item_id": item.id, "output_index": item.output_index}
        if item.call is not None:
            done = function_call_item(item.id, item.call.id, item.call.name, item.text, status)
            self.output.append(done)
            return [
                self._event("response.function_call_arguments.done", **where, name=item.call.name,
                            arguments=item.text),
                self._event("response.output_item.done", output_index=item.output_index, item=done),
            ]
        part = output_text(item.text, item.logprobs)
        done = message_item(item.id, status, [part])
        self.output.append(done)
        return [
            self._event("response.output_text.done", **where, content_index=0, text=item.text,
                        logprobs=item.logprobs),
            self._event("response.content_part.done", **where, content_index=0, part=part),
            self._event("response.output_item.done", output_index=item.output_index, item=done),
        ]

    def _finished(self, output: RequestOutput) -> list[dict]:
        cut = self._finish == FinishReason.LENGTH
        if self._finish is not None:
            reason = self._finish.value
            self.finish_reasons.append(self._parser.finish_reason(reason) if self._parser else reason)
        status = "incomplete" if cut else "completed"
        # A response says something even when the model stopped at once: an empty message.
        events = self._open_message() if not self.output and self._item is None else []
        events += self._close(status)
        incomplete = {"reason": "max_output_tokens"} if cut else None
        self.final = self.head.body(status, self.output, output.usage, incomplete=incomplete)
        return events + [self._event(f"response.{status}", response=self.final)]

    def _failed(self, message: str) -> list[dict]:
        events = self._close("incomplete")
        self.final = self.head.body("failed", self.output, error={"code": "server_error", "message": message})
        return events + [self._event("response.failed", response=self.final)]

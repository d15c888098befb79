"""A response built from the scheduler's outputs, as the event sequence the Responses API streams;
a whole (non-streamed) response is the same build with the events dropped, so both agree."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from kvserve.scheduler.request import Delta, FinishReason, RequestOutput
from kvserve.server.responses import LogprobFormatter
from kvserve.reply import Ended, ReasoningDelta, ReplyEvent, ReplyPlan
from kvserve.server.responses_api.bodies import (
    ResponseHead, function_call_item, message_item, new_item_id, output_text, reasoning_item, reasoning_text,
)
from kvserve.tools import CallStarted, ContentDelta


@dataclass
class _OpenItem:
    """The output item being written: a message, a reasoning item, or a function call when `call` is set."""

    id: str
    output_index: int
    kind: str = "message"  # message, reasoning or function_call
    call: CallStarted | None = None
    text: str = ""  # the message's text, the thinking, or the call's arguments
    logprobs: list[dict] = field(default_factory=list)


class ResponseEvents:
    """The events of one response, in the documented order, and the response they add up to.

    Invariants: sequence numbers run 0, 1, 2, ... without gaps; at most one output item is open and
    it is closed (its `.done` events sent) before the next opens and before the terminal event;
    `output` holds the closed items in order, and `final` (set by the terminal event) is the whole
    response. The reply is read once (`ReplyReader`): its thinking becomes `reasoning` items, its
    answer messages, its calls `function_call` items; logprobs belong to answer text only (a
    call's or a reasoning item has none), so those of call syntax and thinking are dropped.
    """

    def __init__(self, head: ResponseHead, logprobs: LogprobFormatter | None, reply: ReplyPlan) -> None:
        self.head = head
        self.output: list[dict] = []
        self.final: dict | None = None
        self._logprobs = logprobs  # None: the client did not ask for them
        self._reader = reply.reader()
        self._sequence = itertools.count()
        self._item: _OpenItem | None = None
        self._unplaced_logprobs: list[dict] = []  # of text the parser holds back
        self._finish: FinishReason | None = None
        self._chat_reason: str | None = None  # as the reader ended the reply
        self.finish_reasons: list[str] = []  # chat's finish reason of the reply, once it ended

    def started(self) -> list[dict]:
        body = self.head.body("in_progress", [])
        return [self._event("response.created", response=body), self._event("response.in_progress", response=body)]

    def feed(self, output: RequestOutput) -> list[dict]:
        """The events one scheduler output adds; the last output (usage or error) ends the response."""
        if output.error is not None:
            return self._failed(output.error, output.status)
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

    def _pieces(self, delta: Delta) -> list[ReplyEvent]:
        events = self._reader.feed(delta.text)
        if delta.finish_reason is not None:
            events += self._reader.finish(delta.finish_reason.value)
        # A plain reply's delta that carries only logprobs (a token that ends no character) is still sent.
        if delta.logprobs and self._reader.plain and not any(isinstance(e, ContentDelta) for e in events):
            events.insert(0, ContentDelta(""))
        return events

    def _piece(self, piece: ReplyEvent) -> list[dict]:
        if isinstance(piece, Ended):
            self._chat_reason = piece.finish_reason
            return []
        if isinstance(piece, ContentDelta):
            return self._text(piece.text)
        if isinstance(piece, ReasoningDelta):
            return self._reasoning(piece.text)
        if isinstance(piece, CallStarted):
            self._unplaced_logprobs = []
            return self._close("completed") + self._open_call(piece)
        item = self._item
        item.text += piece.text
        return [self._event("response.function_call_arguments.delta", item_id=item.id,
                            output_index=item.output_index, delta=piece.text)]

    def _event(self, kind: str, **fields: object) -> dict:
        return {"type": kind, "sequence_number": next(self._sequence), **fields}

    def _reasoning(self, delta: str) -> list[dict]:
        opened = self._item is not None and self._item.kind == "reasoning"
        events = [] if opened else self._close("completed") + self._open_reasoning()
        item = self._item
        item.text += delta
        self._unplaced_logprobs = []
        return events + [self._event("response.reasoning_text.delta", item_id=item.id, output_index=item.output_index,
                                     content_index=0, delta=delta)]

    def _open_reasoning(self) -> list[dict]:
        self._item = item = _OpenItem(new_item_id("reasoning"), len(self.output), "reasoning")
        return [
            self._event("response.output_item.added", output_index=item.output_index,
                        item=reasoning_item(item.id, "in_progress", None)),
            self._event("response.content_part.added", item_id=item.id, output_index=item.output_index,
                        content_index=0, part=reasoning_text("")),
        ]

    def _text(self, delta: str) -> list[dict]:
        opened = self._item is not None and self._item.kind == "message"
        events = [] if opened else self._close("completed") + self._open_message()
        item, logprobs = self._item, self._unplaced_logprobs
        self._unplaced_logprobs = []
        item.text += delta
        item.logprobs += logprobs
        return events + [self._event("response.output_text.delta", item_id=item.id, output_index=item.output_index,
                                     content_index=0, delta=delta, logprobs=logprobs)]

    def _open_message(self) -> list[dict]:
        self._item = item = _OpenItem(new_item_id("message"), len(self.output))
        return [
            self._event("response.output_item.added", output_index=item.output_index,
                        item=message_item(item.id, "in_progress", [])),
            self._event("response.content_part.added", item_id=item.id, output_index=item.output_index,
                        content_index=0, part=output_text("", [])),
        ]

    def _open_call(self, call: CallStarted) -> list[dict]:
        self._item = item = _OpenItem(new_item_id("function_call"), len(self.output), "function_call", call)
        return [self._event("response.output_item.added", output_index=item.output_index,
                            item=function_call_item(item.id, call.id, call.name, "", "in_progress"))]

    def _close(self, status: str) -> list[dict]:
        item, self._item = self._item, None
        if item is None:
            return []
        where = {"item_id": item.id, "output_index": item.output_index}
        if item.kind == "reasoning":
            done = reasoning_item(item.id, status, item.text)
            self.output.append(done)
            return [
                self._event("response.reasoning_text.done", **where, content_index=0, text=item.text),
                self._event("response.content_part.done", **where, content_index=0, part=reasoning_text(item.text)),
                self._event("response.output_item.done", output_index=item.output_index, item=done),
            ]
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
        if self._chat_reason is not None:
            self.finish_reasons.append(self._chat_reason)
        status = "incomplete" if cut else "completed"
        # A response answers even when the model stopped at once, or only thought: an empty message.
        answered = any(item["type"] != "reasoning" for item in self.output) or (
            self._item is not None and self._item.kind != "reasoning")
        events = [] if answered else self._close(status) + self._open_message()
        events += self._close(status)
        incomplete = {"reason": "max_output_tokens"} if cut else None
        self.final = self.head.body(status, self.output, output.usage, incomplete=incomplete)
        return events + [self._event(f"response.{status}", response=self.final)]

    def _failed(self, message: str, status: int) -> list[dict]:
        """The response failed: the request's fault below 500 (OpenAI's `invalid_prompt`), else the server's."""
        events = self._close("incomplete")
        code = "invalid_prompt" if status < 500 else "server_error"
        self.final = self.head.body("failed", self.output, error={"code": code, "message": message})
        return events + [self._event("response.failed", response=self.final)]

"""A response built from the scheduler's outputs, as the event sequence the Responses API streams;
a whole (non-streamed) response is the same build with the events dropped, so both agree."""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass, field

from kvserve.scheduler.request import FinishReason, RequestOutput
from kvserve.server.responses import LogprobFormatter
from kvserve.server.responses_api.bodies import ResponseHead, message_item, new_id, output_text


def sse_event(event: dict) -> str:
    return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n"


@dataclass
class _OpenMessage:
    id: str
    output_index: int
    text: str = ""
    logprobs: list[dict] = field(default_factory=list)


class ResponseEvents:
    """The events of one response, in the documented order, and the response they add up to.

    Invariants: sequence numbers run 0, 1, 2, ... without gaps; at most one output item is open and
    it is closed (its `.done` events sent) before the terminal event; `output` holds the closed
    items in order, and `final` (set by the terminal event) is the response whole.
    """

    def __init__(self, head: ResponseHead, logprobs: LogprobFormatter | None) -> None:
        self.head = head
        self.output: list[dict] = []
        self.final: dict | None = None
        self._logprobs = logprobs  # None: the client did not ask for them
        self._sequence = itertools.count()
        self._message: _OpenMessage | None = None
        self._finish: FinishReason | None = None

    def started(self) -> list[dict]:
        body = self.head.body("in_progress", [])
        return [self._event("response.created", response=body), self._event("response.in_progress", response=body)]

    def feed(self, output: RequestOutput) -> list[dict]:
        """The events one scheduler output adds; the last output (usage or error) ends the response."""
        if output.error is not None:
            return self._failed(output.error)
        events: list[dict] = []
        for delta in output.deltas:
            if delta.text or delta.logprobs:
                events += self._text(delta.text, self._logprobs.chat(delta.logprobs) if self._logprobs else [])
            self._finish = delta.finish_reason or self._finish
        if output.usage is not None:
            events += self._finished(output)
        return events

    def _event(self, kind: str, **fields: object) -> dict:
        return {"type": kind, "sequence_number": next(self._sequence), **fields}

    def _text(self, delta: str, logprobs: list[dict]) -> list[dict]:
        events = [] if self._message is not None else self._open_message()
        message = self._message
        message.text += delta
        message.logprobs += logprobs
        return events + [self._event("response.output_text.delta", item_id=message.id,
                                     output_index=message.output_index, content_index=0, delta=delta,
                                     logprobs=logprobs)]

    def _open_message(self) -> list[dict]:
        self._message = message = _OpenMessage(new_id("msg"), len(self.output))
        return [
            self._event("response.output_item.added", output_index=message.output_index,
                        item=message_item(message.id, "in_progress", [])),
            self._event("response.content_part.added", item_id=message.id, output_index=message.output_index,
                        content_index=0, part=output_text("", [])),
        ]

    def _close_message(self, status: str) -> list[dict]:
        message, self._message = self._message, None
        if message is None:
            return []
        part = output_text(message.text, message.logprobs)
        item = message_item(message.id, status, [part])
        self.output.append(item)
        where = {"item_id": message.id, "output_index": message.output_index, "content_index": 0}
        return [
            self._event("response.output_text.done", **where, text=message.text, logprobs=message.logprobs),
            self._event("response.content_part.done", **where, part=part),
            self._event("response.output_item.done", output_index=message.output_index, item=item),
        ]

    def _finished(self, output: RequestOutput) -> list[dict]:
        cut = self._finish == FinishReason.LENGTH
        status = "incomplete" if cut else "completed"
        # A response says something even when the model stopped at once: an empty message.
        events = self._open_message() if not self.output and self._message is None else []
        events += self._close_message(status)
        incomplete = {"reason": "max_output_tokens"} if cut else None
        self.final = self.head.body(status, self.output, output.usage, incomplete=incomplete)
        return events + [self._event(f"response.{status}", response=self.final)]

    def _failed(self, message: str) -> list[dict]:
        events = self._close_message("incomplete")
        self.final = self.head.body("failed", self.output, error={"code": "server_error", "message": message})
        return events + [self._event("response.failed", response=self.final)]

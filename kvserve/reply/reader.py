"""One choice's reply as neutral events: the reasoning splitter first, then the tool-call parser
over the answer part only; every API's body, whole or streamed, is a translation of these events.

Events: `ContentDelta` (answer text), `ReasoningDelta`, `CallStarted` (a call's id and whole
name), `ArgumentsDelta`, and `Ended` last, with the finish reason in chat's terms (`tool_calls`
for a reply that stopped after its calls).

Invariant (the property tests check it): feeding a reply whole or in pieces cut anywhere yields
the same events once adjacent deltas of one kind are merged (`merged`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union

from kvserve.reply.reasoning import Answer, ReasoningSplitter, ReasoningSyntax
from kvserve.tools import ArgumentsDelta, CallStarted, ContentDelta, ToolCallParser, ToolPlan


@dataclass(frozen=True)
class ReasoningDelta:
    text: str


@dataclass(frozen=True)
class Ended:
    finish_reason: str  # chat's: stop, length, tool_calls, ...


ReplyEvent = Union[ContentDelta, ReasoningDelta, CallStarted, ArgumentsDelta, Ended]


@dataclass(frozen=True)
class ReplyPlan:
    """How a chat request's reply is read: its reasoning syntax (None: no thinking is split off)
    and its tool plan (None: the answer is text)."""

    reasoning: ReasoningSyntax | None = None
    tools: ToolPlan | None = None

    def reader(self) -> "ReplyReader":
        return ReplyReader(self)


class ReplyReader:
    """Feed a choice's text as it comes, then `finish` it with the scheduler's finish reason."""

    def __init__(self, plan: ReplyPlan) -> None:
        self._splitter: ReasoningSplitter | None = plan.reasoning.splitter() if plan.reasoning else None
        self._parser: ToolCallParser | None = plan.tools.parser() if plan.tools else None
        self._ended = False

    def feed(self, text: str) -> list[ReplyEvent]:
        if not text:
            return []
        if self._splitter is None:
            return self._answer(text)
        return self._parts(self._splitter.feed(text))

    def finish(self, reason: str) -> list[ReplyEvent]:
        """The last events of the reply, `Ended` among them; later calls return nothing."""
        if self._ended:
            return []
        self._ended = True
        events = self._parts(self._splitter.finish()) if self._splitter is not None else []
        if self._parser is not None:
            events += self._parser.finish()
            reason = self._parser.finish_reason(reason)
        return merged(events) + [Ended(reason)]

    @property
    def plain(self) -> bool:
        """The reply is text as generated: nothing split off, nothing parsed."""
        return self._splitter is None and self._parser is None

    def _parts(self, parts: list) -> list[ReplyEvent]:
        events: list[ReplyEvent] = []
        for part in parts:
            events += self._answer(part.text) if isinstance(part, Answer) else [ReasoningDelta(part.text)]
        return merged(events)

    def _answer(self, text: str) -> list[ReplyEvent]:
        if self._parser is None:
            return [ContentDelta(text)] if text else []
        return list(self._parser.feed(text))


def merged(events: list[ReplyEvent]) -> list[ReplyEvent]:
    """Adjacent deltas of one kind (and one call) as one."""
    out: list[ReplyEvent] = []
    for event in events:
        last = out[-1] if out else None
        if isinstance(event, (ContentDelta, ReasoningDelta)) and type(last) is type(event):
            out[-1] = type(event)(last.text + event.text)
        elif isinstance(event, ArgumentsDelta) and isinstance(last, ArgumentsDelta) and last.index == event.index:
            out[-1] = ArgumentsDelta(event.index, last.text + event.text)
        else:
            out.append(event)
    return out


__all__ = ["ArgumentsDelta", "CallStarted", "ContentDelta", "Ended", "ReasoningDelta", "ReplyEvent", "ReplyPlan",
           "ReplyReader", "merged"]

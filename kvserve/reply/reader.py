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

from kvserve.reply.reasoning import Answer, Call, ReasoningSplitter, ReasoningSyntax
from kvserve.tools import ArgumentsDelta, CallStarted, ContentDelta, ToolCallParser, ToolFormat, ToolPlan
from kvserve.tools.parser import TOOL_CALLS, is_json_object
from kvserve.tools.spec import new_call_id


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
        harmony = plan.tools is not None and plan.tools.format is ToolFormat.HARMONY
        # harmony's calls are messages, which the splitter reads: no parser looks at the answer
        self._parser: ToolCallParser | None = plan.tools.parser() if plan.tools and not harmony else None
        self._callable = frozenset(t.name for t in plan.tools.callable) if harmony and plan.tools else frozenset()
        self._calls = 0  # harmony calls reported
        self._ended = False

    def feed(self, text: str) -> list[ReplyEvent]:
        if not text:
            return []
        if self._splitter is None:
            return self._answer(text)
        return self._parts(self._splitter.feed(text), None)

    def finish(self, reason: str) -> list[ReplyEvent]:
        """The last events of the reply, `Ended` among them; later calls return nothing."""
        if self._ended:
            return []
        self._ended = True
        events = self._parts(self._splitter.finish(), reason) if self._splitter is not None else []
        if self._parser is not None:
            events += self._parser.finish()
            reason = self._parser.finish_reason(reason)
        elif self._calls and reason == "stop":
            reason = TOOL_CALLS
        return merged(events) + [Ended(reason)]

    @property
    def plain(self) -> bool:
        """The reply is text as generated: nothing split off, nothing parsed."""
        return self._splitter is None and self._parser is None

    def _parts(self, parts: list, reason: str | None) -> list[ReplyEvent]:
        events: list[ReplyEvent] = []
        for part in parts:
            if isinstance(part, Answer):
                events += self._answer(part.text)
            elif isinstance(part, Call):
                events += self._call(part, reason)
            else:
                events.append(ReasoningDelta(part.text))
        return merged(events)

    def _call(self, call: Call, reason: str | None) -> list[ReplyEvent]:
        """A harmony message to a recipient: a call when it names a callable function and its
        arguments are a JSON object; one the reply was cut inside (`length`) is dropped; any other
        is text of its channel (an unknown recipient's, a builtin tool's)."""
        _, _, name = call.recipient.partition("functions.")
        if call.recipient.startswith("functions.") and name in self._callable:
            if not call.closed and reason == "length":
                return []
            if is_json_object(call.arguments):
                index, self._calls = self._calls, self._calls + 1
                return [CallStarted(index, new_call_id(), name), ArgumentsDelta(index, call.arguments)]
        if call.channel == "analysis":
            return [ReasoningDelta(call.arguments)] if call.arguments else []
        return self._answer(call.arguments)

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

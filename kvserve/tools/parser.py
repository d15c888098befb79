"""Generated text to content and tool calls, as it streams.

The parser is a character-driven state machine per format. It holds back only what could still be
call syntax (the start of an opening marker, whitespace before it, a call whose name is not yet
read), so content streams as generated and no byte of a reported call's syntax reaches it. Text
that looked like a call but is not one (free text the grammar never constrained) is content.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Generator, Iterable, Union

from kvserve.tools.formats import ToolFormat
from kvserve.tools.spec import ToolCall, new_call_id

TOOL_CALLS = "tool_calls"  # the finish reason of a reply that called tools


@dataclass(frozen=True)
class ContentDelta:
    text: str


@dataclass(frozen=True)
class CallStarted:
    index: int
    id: str
    name: str


@dataclass(frozen=True)
class ArgumentsDelta:
    index: int
    text: str


ToolEvent = Union[ContentDelta, CallStarted, ArgumentsDelta]

_WS = " \t\n\r"
_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}
_REPLACEMENT = "\ufffd"

# Each step receives the next character (None: the text ended) and returns the first one it did not consume.
Steps = Generator[None, Union[str, None], Union[str, None]]


class _NotACall(Exception):
    """What followed the opening is not a call of a known tool."""


class _Ended(Exception):
    """The text ended inside call syntax."""


@dataclass
class _Call:
    id: str
    name: str
    arguments: list[str] = field(default_factory=list)


class ToolCallParser:
    """Feed generated text in any split; each `feed` returns the events that are now certain.

    Invariants: every call gets exactly one `CallStarted` (its id and whole name), before any of
    its `ArgumentsDelta`s; content never holds syntax of a reported call; whatever the split, the
    events concatenate to the same content, calls and arguments.
    """

    def __init__(self, fmt: ToolFormat, names: Iterable[str]) -> None:
        self._fmt = fmt
        self._names = frozenset(names)
        self._calls: list[_Call] = []
        self._events: list[ToolEvent] = []
        self._content: list[str] = []
        self._pending = ""  # content held back: trailing whitespace and a possible start of the marker
        self._held_ws = ""  # whitespace before a possible call: dropped if it is one
        self._raw: list[str] | None = None  # text of a possible call, while it may still be content
        self._current: str | None = None
        self._done = False
        self._machine = self._run()
        next(self._machine)

    @property
    def calls(self) -> list[ToolCall]:
        return [ToolCall(c.id, c.name, "".join(c.arguments)) for c in self._calls]

    @property
    def content(self) -> str:
        return "".join(self._content)

    def finish_reason(self, reason: str) -> str:
        """A reply that stopped after its calls finished for them."""
        return TOOL_CALLS if self._calls and reason == "stop" else reason

    def feed(self, text: str) -> list[ToolEvent]:
        for ch in text:
            if self._raw is not None:
                self._raw.append(ch)
            self._current = ch
            self._machine.send(ch)
        return self._take()

    def finish(self) -> list[ToolEvent]:
        if not self._done:
            self._done = True
            with contextlib.suppress(StopIteration):
                self._machine.send(None)
            if self._pending and not (self._calls and self._pending.isspace()):
                self._emit_content(self._pending)
            self._pending = ""
        return self._take()

    # -- events ----------------------------------------------------------------------------------

    def _take(self) -> list[ToolEvent]:
        merged: list[ToolEvent] = []
        for event in self._events:
            last = merged[-1] if merged else None
            if isinstance(event, ContentDelta) and isinstance(last, ContentDelta):
                merged[-1] = ContentDelta(last.text + event.text)
            elif isinstance(event, ArgumentsDelta) and isinstance(last, ArgumentsDelta) and last.index == event.index:
                merged[-1] = ArgumentsDelta(event.index, last.text + event.text)
            else:
                merged.append(event)
        self._events = []
        return merged

    def _emit_content(self, text: str) -> None:
        if text:
            self._content.append(text)
            self._events.append(ContentDelta(text))

    def _start_call(self, name: str) -> int:
        """The call is certain: what was held for it is syntax, not content."""
        self._raw = None
        self._held_ws = ""
        self._calls.append(_Call(new_call_id(), name))
        self._events.append(CallStarted(len(self._calls) - 1, self._calls[-1].id, name))
        return len(self._calls) - 1

    def _arguments(self, index: int, ch: str) -> None:
        self._calls[index].arguments.append(ch)
        self._events.append(ArgumentsDelta(index, ch))

    def _give_back(self) -> None:
        """A possible call was not one: its text (and the whitespace before it) is content."""
        if self._raw is not None:
            self._emit_content(self._held_ws + "".join(self._raw))
        self._raw = None
        self._held_ws = ""

    # -- the machine -----------------------------------------------------------------------------

    def _run(self) -> Steps:
        opening = self._fmt.opening
        leading = opening is None  # LLAMA3 and GENERIC: only the reply's start can be a call
        if leading:
            self._raw = []
        ch = yield
        while ch is not None:
            try:
                if leading:
                    leading = False
                    ch = yield from self._leading_reply(ch)
                else:
                    ch = yield from self._content_then_calls(ch, opening)
            except _NotACall:
                started = self._raw is None
                self._give_back()
                ch = self._current if started else (yield)
            except _Ended:
                self._give_back()
                return None
        return None

    def _leading_reply(self, ch: str | None) -> Steps:
        ch = yield from self._ws(ch)
        if self._fmt is ToolFormat.GENERIC:
            return (yield from self._generic_reply(ch))
        if ch != "{":
            raise _NotACall
        return (yield from self._call(ch))

    def _content_then_calls(self, ch: str | None, opening: str | None) -> Steps:
        if not (yield from self._read_content(ch, opening)):
            return None
        self._raw = list(opening)
        ch = yield  # the character after the marker
        if self._fmt is ToolFormat.HERMES:
            ch = yield from self._call(ch)
            return (yield from self._literal("</tool_call>", ch))
        ch = yield from self._literal("[", ch)  # MISTRAL: a JSON array of calls
        ch = yield from self._call(ch)
        ch = yield from self._ws(ch)
        while ch == ",":
            ch = yield from self._call((yield))
            ch = yield from self._ws(ch)
        return (yield from self._literal("]", ch))

    def _read_content(self, ch: str | None, opening: str | None) -> Generator[None, Union[str, None], bool]:
        """Content up to and including the opening marker: True once it is read, False at the end."""
        while ch is not None:
            self._pending += ch
            if opening is not None and self._pending.endswith(opening):
                self._held_ws = self._pending[: -len(opening)]  # only whitespace: the rest went out
                self._pending = ""
                return True
            cut = self._safe_length(opening)
            self._emit_content(self._pending[:cut])
            self._pending = self._pending[cut:]
            ch = yield
        return False

    def _safe_length(self, opening: str | None) -> int:
        """How much of the pending content can be neither the marker's start nor whitespace before it."""
        pending = self._pending
        keep = next((k for k in range(min(len(pending), len(opening or "") - 1), 0, -1)
                     if pending.endswith(opening[:k])), 0) if opening else 0
        cut = len(pending) - keep
        while cut > 0 and pending[cut - 1] in _WS:
            cut -= 1
        return cut

    def _generic_reply(self, ch: str | None) -> Steps:
        """`{"tool_calls": [call, ...]}`, or `{"response": "..."}` whose string is the content."""
        if ch != "{":
            raise _NotACall
        ch = yield from self._ws((yield))
        key, ch = yield from self._string(ch)
        ch = yield from self._literal(":", ch)
        ch = yield from self._ws(ch)
        if key == "response" and ch == '"':
            self._raw = None
            _, ch = yield from self._string(ch, self._emit_content)
        elif key == "tool_calls" and ch == "[":
            ch = yield from self._call((yield))
            ch = yield from self._ws(ch)
            while ch == ",":
                ch = yield from self._call((yield))
                ch = yield from self._ws(ch)
            ch = yield from self._literal("]", ch)
        else:
            raise _NotACall
        return (yield from self._literal("}", ch))

    def _call(self, ch: str | None) -> Steps:
        """`{"name": "<tool>", "<arguments key>": <value>}`, the value streamed as it comes."""
        ch = yield from self._literal("{", ch)
        ch = yield from self._key("name", ch)
        name, ch = yield from self._string(ch)
        if name not in self._names:
            raise _NotACall
        ch = yield from self._literal(",", ch)
        ch = yield from self._key(self._fmt.arguments_key, ch)
        index = self._start_call(name)
        ch = yield from self._value(ch, index)
        return (yield from self._literal("}", ch))

    def _key(self, key: str, ch: str | None) -> Steps:
        ch = yield from self._ws(ch)
        found, ch = yield from self._string(ch)
        if found != key:
            raise _NotACall
        ch = yield from self._literal(":", ch)
        return (yield from self._ws(ch))

    def _value(self, ch: str | None, index: int) -> Steps:
        """One JSON value, copied to the call's arguments; ends after its last character."""
        depth, in_string, escaped = 0, False, False
        while True:
            if ch is None:
                raise _Ended
            if in_string:
                self._arguments(index, ch)
                if escaped:
                    escaped = False
                elif ch == "\\":
                    escaped = True
                elif ch == '"':
                    in_string = False
                    if depth == 0:
                        return (yield)
            elif ch in "{[":
                depth += 1
                self._arguments(index, ch)
            elif ch in "}]" or (depth == 0 and (ch in _WS or ch == ",")):
                if depth == 0:
                    return ch  # the end of a number or literal
                depth -= 1
                self._arguments(index, ch)
                if depth == 0:
                    return (yield)
            else:
                in_string = ch == '"'
                self._arguments(index, ch)
            ch = yield

    def _string(self, ch: str | None, sink=None) -> Steps:
        """A JSON string starting at `ch`: returns (its text, the next character). `sink` gets the
        decoded characters as they come; a lone surrogate escape becomes U+FFFD."""
        if ch != '"':
            raise _NotACall
        text: list[str] = []
        put = sink or text.append
        high: int | None = None  # a high surrogate waiting for its low half
        while True:
            ch = yield
            if ch is None:
                raise _Ended
            if ch == '"':
                break
            code = None
            if ch == "\\":
                escape = yield
                if escape == "u":
                    code = yield from self._hex4()
                elif escape in _ESCAPES:
                    ch = _ESCAPES[escape]
                else:
                    raise _Ended if escape is None else _NotACall
            if high is not None:
                if code is not None and 0xDC00 <= code < 0xE000:
                    put(chr(0x10000 + ((high - 0xD800) << 10) + code - 0xDC00))
                    high = None
                    continue
                put(_REPLACEMENT)
                high = None
            if code is None:
                put(ch)
            elif 0xD800 <= code < 0xDC00:
                high = code
            else:
                put(_REPLACEMENT if 0xDC00 <= code < 0xE000 else chr(code))
        if high is not None:
            put(_REPLACEMENT)
        return "".join(text), (yield)

    def _hex4(self) -> Generator[None, Union[str, None], int]:
        digits = ""
        for _ in range(4):
            ch = yield
            if ch is None:
                raise _Ended
            digits += ch
        try:
            return int(digits, 16)
        except ValueError:
            raise _NotACall from None

    def _ws(self, ch: str | None) -> Steps:
        while ch is not None and ch in _WS:
            ch = yield
        if ch is None:
            raise _Ended
        return ch

    def _literal(self, text: str, ch: str | None) -> Steps:
        """`text` after optional whitespace; returns the character after it."""
        ch = yield from self._ws(ch)
        for expected in text:
            if ch != expected:
                raise _Ended if ch is None else _NotACall
            ch = yield
        return ch

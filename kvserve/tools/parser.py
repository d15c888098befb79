"""Generated text to content and tool calls, as it streams.

The parser is a character-driven state machine per format. It holds back only what could still be
call syntax (the start of an opening, whitespace before it, a call not yet complete), so content
streams as generated and no byte of a reported call's syntax reaches it. Text that looked like a
call but is not one (free text the grammar never constrained) is content: the first character of
the false opening goes out and the rest is read again, so a real opening inside it is still found.

A call is reported whole once its closing brace is read, and only if its arguments are a JSON
object: a reply never carries a call whose arguments do not parse. A call the text ends inside is
dropped once it was certain (a known tool's name, then the arguments key): its text is syntax, not
content, and the reply's finish reason (`length`, or a stop sequence's `stop`) says it was cut.
Before that point such text is content.

Hermes models write their calls in variants besides `<tool_call>{...}</tool_call>`: another tag
(`formats.HERMES_TAGS`), or a Markdown fence (```` ```json ````) around a tag. Both are calls. A
bare or fenced `{"name": ..., "arguments": ...}` object without a tag is content
(`ToolFormat.openings` says why).
"""

from __future__ import annotations

import collections
import contextlib
import json
from dataclasses import dataclass, field
from typing import Generator, Iterable, Union

from kvserve.tools.formats import FENCE, FENCE_LANGUAGES, HERMES_TAGS, ToolFormat
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
# The same, for a step that also returns what it read.
Reads = Generator[None, Union[str, None], tuple[str, Union[str, None]]]


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

    def __init__(self, fmt: ToolFormat, names: Iterable[str], forced: bool = False) -> None:
        """`forced`: the reply must call (its grammar holds it to call syntax from the start)."""
        self._fmt = fmt
        self._names = frozenset(names)
        self._forced = forced
        self._calls: list[_Call] = []
        self._events: list[ToolEvent] = []
        self._content: list[str] = []
        self._pending = ""  # content held back: trailing whitespace and a possible start of the marker
        self._pending_ws = 0  # how many of `_pending`'s first characters are known to be whitespace
        self.examined = 0  # characters the content scan looked at: each once, and each held whitespace once more
        self._held_ws = ""  # whitespace before a possible call: dropped if it is one
        self._raw: list[str] | None = None  # text of a possible call, while it may still be content
        self._open: _Call | None = None  # a certain call whose closing brace is not read yet
        self._queue: collections.deque[str] = collections.deque()  # text to read, false openings first
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
        self._queue.extend(text)
        self._read_queue()
        return self._take()

    def _read_queue(self) -> None:
        while self._queue:
            ch = self._queue.popleft()
            if self._raw is not None:
                self._raw.append(ch)
            self._current = ch
            self._machine.send(ch)

    def finish(self) -> list[ToolEvent]:
        if not self._done:
            self._done = True
            while True:  # the end; a false opening's text read again ends it again
                self._current = None
                with contextlib.suppress(StopIteration):
                    self._machine.send(None)
                if not self._queue:
                    break
                self._read_queue()
            if self._pending and not self._forced and not (self._calls and self._pending.isspace()):
                self._emit_content(self._pending)  # a forced reply's is the start of its marker
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

    def _start_call(self, name: str) -> None:
        """The call is certain: cut from here on, it is dropped."""
        self._open = _Call(new_call_id(), name)

    def _commit_call(self) -> None:
        """The call's closing brace: reported whole if its arguments are a JSON object, and what
        was held for it is syntax, not content."""
        call, self._open = self._open, None
        assert call is not None
        if not is_json_object("".join(call.arguments)):
            raise _NotACall
        self._raw = None
        self._held_ws = ""
        self._calls.append(call)
        index = len(self._calls) - 1
        self._events += [CallStarted(index, call.id, call.name), ArgumentsDelta(index, "".join(call.arguments))]

    def _give_back(self) -> None:
        """A possible call was not one: the whitespace before it and its first character are
        content, and the rest of its text is read again."""
        raw = self._raw or []
        self._emit_content(self._held_ws + "".join(raw[:1]))
        self._queue.extendleft(reversed(raw[1:]))
        self._raw, self._held_ws, self._open = None, "", None

    def _ended(self) -> None:
        """The text ended inside call syntax: a certain call is dropped; so is what a forced reply,
        or one that already called, held (it was opening a call: syntax, not text); anything else
        held is content."""
        held = self._held_ws + "".join(self._raw or [])
        if self._open is None and not self._forced and not self._calls:
            self._emit_content(held)
        self._raw, self._held_ws, self._open = None, "", None

    # -- the machine -----------------------------------------------------------------------------

    def _run(self) -> Steps:
        openings = self._fmt.openings
        leading = not openings  # LLAMA3 and GENERIC: only the reply's start can be a call
        if leading:
            self._raw = []
        ch = yield
        while ch is not None:
            try:
                if leading:
                    leading = False
                    ch = yield from self._leading_reply(ch)
                else:
                    ch = yield from self._content_then_calls(ch, openings)
            except _NotACall:
                held = self._raw is not None
                self._give_back()
                ch = (yield) if held else self._current  # after a reported call, this character is content
            except _Ended:
                self._ended()
                return None
        return None

    def _leading_reply(self, ch: str | None) -> Steps:
        ch = yield from self._ws(ch)
        if self._fmt is ToolFormat.GENERIC:
            return (yield from self._generic_reply(ch))
        return (yield from self._call(ch))

    def _content_then_calls(self, ch: str | None, openings: tuple[str, ...]) -> Steps:
        opening = yield from self._read_content(ch, openings)
        if opening is None:
            return None
        self._raw = list(opening)
        ch = yield  # the character after the opening
        if self._fmt is ToolFormat.MISTRAL:
            return (yield from self._call_list(ch))
        if opening == FENCE:
            return (yield from self._fenced(ch))
        ch = yield from self._call(ch)
        return (yield from self._literal(f"</{opening[1:-1]}>", ch))

    def _call_list(self, ch: str | None) -> Steps:
        """`[call, ...]`."""
        ch = yield from self._literal("[", ch)
        ch = yield from self._call(ch)
        ch = yield from self._ws(ch)
        while ch == ",":
            ch = yield from self._call((yield))
            ch = yield from self._ws(ch)
        return (yield from self._literal("]", ch))

    def _fenced(self, ch: str | None) -> Steps:
        """After the fence: a language and a newline, a call in a tag, the closing fence."""
        _, ch = yield from self._one_of(tuple(f"{language}\n" for language in FENCE_LANGUAGES), ch)
        tag, ch = yield from self._one_of(tuple(f"<{tag}>" for tag in HERMES_TAGS), (yield from self._ws(ch)))
        ch = yield from self._call(ch)
        ch = yield from self._literal(f"</{tag[1:-1]}>", ch)
        return (yield from self._literal(FENCE, ch))

    def _one_of(self, texts: tuple[str, ...], ch: str | None) -> Reads:
        """One of `texts` (none a prefix of another), from `ch` on: returns (it, the next character)."""
        read = ""
        while read not in texts:
            if ch is None:
                raise _Ended
            read += ch
            if not any(text.startswith(read) for text in texts):
                raise _NotACall
            ch = yield
        return read, ch

    def _read_content(self, ch: str | None, openings: tuple[str, ...]) -> Steps:
        """Content up to and including an opening: returns it once read, None at the end."""
        while ch is not None:
            self.examined += 1
            self._pending += ch
            opening = next((o for o in openings if self._pending.endswith(o)), None)
            if opening is not None:
                self._held_ws = self._pending[: -len(opening)]  # only whitespace: the rest went out
                self._pending, self._pending_ws = "", 0
                return opening
            cut = self._safe_length(openings)
            self._emit_content(self._pending[:cut])
            self._pending = self._pending[cut:]
            ch = yield
        return None

    def _safe_length(self, openings: tuple[str, ...]) -> int:
        """How much of the pending content can be neither an opening's start nor whitespace before it.
        The whitespace already known to lead it is not walked again: a long run costs its length."""
        pending = self._pending
        keep = max((k for opening in openings for k in range(1, min(len(pending), len(opening) - 1) + 1)
                    if pending.endswith(opening[:k])), default=0)
        cut = len(pending) - keep
        known = min(self._pending_ws, cut)
        while cut > known and pending[cut - 1] in _WS:
            cut -= 1
            self.examined += 1
        if cut == known:  # all of it whitespace
            cut = 0
        self._pending_ws = len(pending) - keep - cut
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
        """`{"name": "<tool>", "<arguments key>": <object>}`, reported at its closing brace."""
        if self._raw is None:  # a call after a reported one: its text is held again
            self._raw = [ch] if ch is not None else []
        ch = yield from self._literal("{", ch)
        return (yield from self._call_body(ch))

    def _call_body(self, ch: str | None) -> Steps:
        """A call after its opening brace."""
        ch = yield from self._key("name", ch)
        name, ch = yield from self._string(ch)
        if name not in self._names:
            raise _NotACall
        ch = yield from self._literal(",", ch)
        ch = yield from self._key(self._fmt.arguments_key, ch)
        self._start_call(name)
        ch = yield from self._value(ch)
        ch = yield from self._ws(ch)
        if ch != "}":
            raise _NotACall
        self._commit_call()
        return (yield)

    def _key(self, key: str, ch: str | None) -> Steps:
        ch = yield from self._ws(ch)
        found, ch = yield from self._string(ch)
        if found != key:
            raise _NotACall
        ch = yield from self._literal(":", ch)
        return (yield from self._ws(ch))

    def _value(self, ch: str | None) -> Steps:
        """One JSON value, copied to the open call's arguments; ends after its last character."""
        assert self._open is not None
        arguments = self._open.arguments
        depth, in_string, escaped = 0, False, False
        while True:
            if ch is None:
                raise _Ended
            if in_string:
                arguments.append(ch)
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
                arguments.append(ch)
            elif ch in "}]" or (depth == 0 and (ch in _WS or ch == ",")):
                if depth == 0:
                    return ch  # the end of a number or literal
                depth -= 1
                arguments.append(ch)
                if depth == 0:
                    return (yield)
            else:
                in_string = ch == '"'
                arguments.append(ch)
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


def is_json_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text, parse_constant=_reject), dict)
    except ValueError:
        return False


def _reject(constant: str) -> None:
    raise ValueError(f"{constant} is not JSON")

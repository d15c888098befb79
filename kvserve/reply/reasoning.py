"""A reasoning model's reply split into its thinking and its answer, as it streams.

Formats (`ReasoningFormat`):
- `deepseek`: the thinking is a `<think>…</think>` block at the start of the reply (DeepSeek-R1
  and its distills, Qwen3, SmolLM3, Magistral). A template may open the block itself, in the
  generation prompt (R1 distills, Qwen3 with `enable_thinking`): the reply then starts inside it.
- `harmony`: gpt-oss's channels; the `analysis` channel is thinking, every other channel's
  message (`final`, and `commentary` without a recipient: a preamble, meant for the user) is
  answer. A message with a recipient (`to=functions.NAME`, before or after its `<|channel|>`) is a
  tool call: its body, the arguments, comes out whole as a `Call` when the message ends (at
  `<|call|>`, `<|end|>`, `<|return|>`, or the end of the reply, where `closed` is False). Headers
  and the tokens around them are dropped. A prompt may open the analysis itself
  (`starts_open`: it ends in `<|channel|>analysis<|message|>`), or leave the reply to write its
  header after `<|start|>assistant`, recipient first.
- `none`: the text as generated, all of it answer.

The splitter holds back only what could still be a tag. Whitespace around the thinking (after its
opening, before and after its closing) belongs to neither part. A reply cut off inside its
thinking ends with all of it as reasoning and an empty answer. Whatever the split of the text
into pieces, the pieces add up to the same reasoning and answer.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass
from typing import Union

_WS = " \t\n\r"


class ReasoningFormat(str, enum.Enum):
    NONE = "none"
    DEEPSEEK = "deepseek"
    HARMONY = "harmony"


THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
# gpt-oss's harmony tokens: a message is <|start|>{role}<|channel|>{channel}<|message|>{body}<|end|>;
# the last one ends with <|return|> (or <|call|> for a tool call), both of which end generation.
H_START, H_CHANNEL, H_MESSAGE, H_END = "<|start|>", "<|channel|>", "<|message|>", "<|end|>"
H_RETURN, H_CALL, H_CONSTRAIN = "<|return|>", "<|call|>", "<|constrain|>"
ANALYSIS_OPEN = f"{H_CHANNEL}analysis{H_MESSAGE}"
HARMONY_TAGS = (H_START, H_CHANNEL, H_MESSAGE, H_END, H_RETURN, H_CALL, H_CONSTRAIN)
_TAGS = {ReasoningFormat.NONE: (), ReasoningFormat.DEEPSEEK: (THINK_OPEN, THINK_CLOSE), ReasoningFormat.HARMONY: HARMONY_TAGS}


@dataclass(frozen=True)
class ReasoningSyntax:
    """How one request's reply carries its thinking: the format, whether the prompt opened the
    thinking block already (the reply then starts inside it), and (harmony) whether the reply must
    call a tool after it (its close then leaves the next message's header to the model)."""

    format: ReasoningFormat
    starts_open: bool = False
    calls_next: bool = False

    @property
    def close_text(self) -> str:
        """What the server writes to end the thinking when its budget runs out."""
        if self.format is ReasoningFormat.HARMONY:
            head = f"{H_END}{H_START}assistant"
            return head if self.calls_next else f"{head}{H_CHANNEL}final{H_MESSAGE}"
        return f"\n{THINK_CLOSE}\n\n"

    def splitter(self) -> "ReasoningSplitter":
        return ReasoningSplitter(self)


@dataclass(frozen=True)
class Reasoning:
    text: str


@dataclass(frozen=True)
class Answer:
    text: str


@dataclass(frozen=True)
class Call:
    """A harmony message addressed to `recipient` (e.g. `functions.get_weather`): its body whole;
    `closed`: a closing token ended it (else the reply did)."""

    recipient: str
    channel: str
    arguments: str
    closed: bool


Part = Union[Reasoning, Answer, Call]


class _TagScanner:
    """Text into plain text and whole tags; a tail that may still become a tag is held back."""

    def __init__(self, tags: tuple[str, ...]) -> None:
        self._tags = tags
        self._longest = max((len(t) for t in tags), default=0)
        self._held = ""
        self.examined = 0  # characters looked at, the held tail again each time: O(1) per character

    def feed(self, text: str) -> list[str | tuple[str]]:
        """Plain text as `str`, a tag as a 1-tuple."""
        text = self._held + text
        self.examined += len(text)
        out: list[str | tuple[str]] = []
        start = 0
        i = text.find("<")
        while i >= 0:
            tag = next((t for t in self._tags if text.startswith(t, i)), None)
            if tag is not None:
                out += [text[start:i], (tag,)]
                start = i + len(tag)
                i = text.find("<", start)
                continue
            if len(text) - i < self._longest and any(t.startswith(text[i:]) for t in self._tags):  # a tag's start
                break
            i = text.find("<", i + 1)
        end = i if i >= 0 else len(text)
        out.append(text[start:end])
        self._held = text[end:]
        return [piece for piece in out if piece]

    def finish(self) -> str:
        held, self._held = self._held, ""
        return held

    @property
    def holding(self) -> bool:
        return bool(self._held)


class _State(enum.Enum):
    START = "start"  # nothing but whitespace yet: a thinking block may still open
    THINKING = "thinking"
    ANSWER_LEAD = "answer lead"  # just after the thinking: whitespace here is dropped
    ANSWER = "answer"
    HEADER = "header"  # harmony: inside a message's header
    BODY = "body"  # harmony: inside a message's body


class ReasoningSplitter:
    """Feed a reply's text in any split; each `feed` returns the parts now certain.

    Invariants: the parts of any split concatenate (reasoning with reasoning, answer with answer)
    to those of the whole text fed at once; `thinking` says whether the text so far ends inside
    the thinking (what the budget counts).
    """

    def __init__(self, syntax: ReasoningSyntax) -> None:
        self._format = syntax.format
        harmony = self._format is ReasoningFormat.HARMONY
        self._scanner = _TagScanner(_TAGS[self._format])
        self._state = _State.THINKING if syntax.starts_open and not harmony else _State.START
        self._held_ws = ""  # whitespace inside the thinking, out only if more thinking follows
        self._thought = False  # some reasoning went out: leading whitespace is no longer dropped
        self._header = ""  # harmony: the current message's header text
        self._channel_is_analysis = False
        self._recipient: str | None = None  # harmony: the current message's, if it is a call
        self._call_body: list[str] = []
        self._parts: list[Part] = []
        if harmony and syntax.starts_open:  # the prompt opened the analysis body
            self._state, self._channel_is_analysis = _State.BODY, True

    @property
    def thinking(self) -> bool:
        if self._format is ReasoningFormat.HARMONY:
            return self._channel_is_analysis and self._state in (_State.BODY, _State.HEADER)
        return self._state is _State.THINKING

    @property
    def answering(self) -> bool:
        """Past the thinking: neither in it nor at a start where it may still open."""
        return not self.thinking and self._state not in (_State.START, _State.THINKING)

    @property
    def holding(self) -> bool:
        """A tag (or, at the start, a header) may have begun: text is held back."""
        return self._scanner.holding or (self._state is _State.START and bool(self._held_ws))

    @property
    def examined(self) -> int:
        """Characters the tag scanner looked at so far."""
        return self._scanner.examined

    def feed(self, text: str) -> list[Part]:
        if self._format is ReasoningFormat.NONE:
            return [Answer(text)] if text else []
        for piece in self._scanner.feed(text):
            if isinstance(piece, tuple):
                self._tag(piece[0])
            else:
                self._text(piece)
        return self._take()

    def finish(self) -> list[Part]:
        """The end of the reply: a partial tag is text of the part it was in."""
        if self._format is not ReasoningFormat.NONE:
            rest = self._scanner.finish()
            if rest:
                self._text(rest)
            if self._state is _State.START and self._held_ws:
                self._answer(self._held_ws)
            if self._recipient is not None:
                self._end_message(closed=False)
            self._held_ws = ""
        return self._take()

    # -- parts -----------------------------------------------------------------------------------

    def _take(self) -> list[Part]:
        merged: list[Part] = []
        for part in self._parts:
            if merged and type(merged[-1]) is type(part) and not isinstance(part, Call):
                merged[-1] = type(part)(merged[-1].text + part.text)
            else:
                merged.append(part)
        self._parts = []
        return merged

    def _answer(self, text: str) -> None:
        if text:
            self._parts.append(Answer(text))

    def _reasoning(self, text: str) -> None:
        """Thinking text, less its leading whitespace; trailing whitespace waits for what follows."""
        body = text.rstrip(_WS)
        if not self._thought:
            body = body.lstrip(_WS)
            if not body:
                return
        if body:
            self._parts.append(Reasoning(self._held_ws + body))
            self._thought = True
            self._held_ws = ""
        self._held_ws += text[len(text.rstrip(_WS)):] if body else text

    # -- the machine -----------------------------------------------------------------------------

    def _text(self, text: str) -> None:
        state = self._state
        if state is _State.START:
            lead = (self._held_ws + text).lstrip(_WS)
            if not lead or (self._format is ReasoningFormat.HARMONY and _RECIPIENT_LEAD.startswith(lead)):
                self._held_ws += text  # harmony: perhaps a header after the prompt's `<|start|>assistant`
                return
            text, self._held_ws = self._held_ws + text, ""
            if self._format is ReasoningFormat.HARMONY and lead.startswith(_RECIPIENT_LEAD):
                self._state, self._header = _State.HEADER, text
                return
            self._state = _State.ANSWER
            if self._format is ReasoningFormat.HARMONY:  # a reply with no header at all
                self._answer(text)
                return
            state = _State.ANSWER
        if state is _State.THINKING:
            self._reasoning(text)
        elif state is _State.ANSWER_LEAD:
            text = text.lstrip(_WS)
            if text:
                self._state = _State.ANSWER
                self._answer(text)
        elif state is _State.ANSWER:
            self._answer(text)
        elif state is _State.HEADER:
            self._header += text
        elif state is _State.BODY:
            if self._recipient is not None:
                self._call_body.append(text)
            elif self._channel_is_analysis:
                self._reasoning(text)
            else:
                self._answer(text)

    def _tag(self, tag: str) -> None:
        if self._format is ReasoningFormat.HARMONY:
            self._harmony_tag(tag)
            return
        state = self._state
        if state is _State.START and tag == THINK_OPEN:
            self._held_ws = ""
            self._state = _State.THINKING
        elif state is _State.START and tag == THINK_CLOSE:  # a close with nothing thought
            self._held_ws = ""
            self._state = _State.ANSWER_LEAD
        elif state is _State.THINKING and tag == THINK_CLOSE:
            self._held_ws = ""
            self._state = _State.ANSWER_LEAD
        else:  # a tag where it means nothing is text
            self._text(tag)

    def _harmony_tag(self, tag: str) -> None:
        state = self._state
        if tag in (H_START, H_CHANNEL) and state in (_State.START, _State.ANSWER, _State.BODY, _State.HEADER):
            if state is _State.START:
                self._header, self._held_ws = self._held_ws, ""
            elif state is not _State.HEADER:
                self._end_message(closed=False)
                self._header = ""
            self._header += tag
            self._state = _State.HEADER
        elif tag == H_MESSAGE and state is _State.HEADER:
            self._channel_is_analysis = _channel(self._header) == "analysis"
            self._recipient = _recipient(self._header)
            self._state = _State.BODY
        elif tag in (H_END, H_RETURN, H_CALL) and state is _State.BODY:
            self._end_message(closed=True)
            self._state = _State.ANSWER
        elif state is _State.HEADER:
            self._header += tag
        elif state is _State.START:
            self._state = _State.ANSWER  # a stray token: the reply is not in channels
        # any other tag (one between messages, a constrain in a body) is syntax, dropped

    def _end_message(self, closed: bool) -> None:
        if self._recipient is not None:
            self._parts.append(Call(self._recipient, _channel(self._header), "".join(self._call_body), closed))
        self._held_ws = ""
        self._channel_is_analysis = False
        self._recipient, self._call_body = None, []


_RECIPIENT_LEAD = "to="
_RECIPIENT = re.compile(r"(?:^|[\s>])to=([^\s<]+)")


def _channel(header: str) -> str:
    """The channel named in a harmony header: `<|start|>assistant<|channel|>analysis to=...`."""
    _, _, after = header.rpartition(H_CHANNEL)
    return after.split(H_CONSTRAIN)[0].split(" ")[0].strip(_WS)


def _recipient(header: str) -> str | None:
    """Whom a harmony message is addressed to, before or after its channel: `to=functions.NAME`."""
    found = _RECIPIENT.search(header)
    return found.group(1) if found else None

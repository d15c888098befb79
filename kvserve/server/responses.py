"""OpenAI response bodies, whole or as SSE chunks, built from the scheduler's outputs."""

from __future__ import annotations

import codecs
import json
import time
from dataclasses import dataclass, field
from typing import AsyncIterator

from kvserve.llama.model import Model
from kvserve.llama.sampler import TokenLogprobs
from kvserve.scheduler.request import Delta, Request, RequestOutput, Usage
from kvserve.server.errors import engine_error
from kvserve.reply import Ended, ReasoningDelta, ReplyEvent, ReplyPlan, ReplyReader
from kvserve.tools import CallStarted, ContentDelta


def sse(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)}\n\n"


def sse_event(event: dict) -> str:
    """An SSE event whose `event:` line names its `type` (the Responses and Messages APIs' form)."""
    return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n"


def usage_body(usage: Usage) -> dict:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
        "completion_tokens_details": {
            "reasoning_tokens": usage.reasoning_tokens,
            # a `prediction`'s tokens, as speculative decoding verified them
            "accepted_prediction_tokens": usage.accepted_prediction_tokens,
            "rejected_prediction_tokens": usage.rejected_prediction_tokens,
        },
    }


@dataclass
class Shape:
    """What differs between chat and text completions."""

    chat: bool
    model_name: str
    request: Request
    reply: ReplyPlan = field(default_factory=ReplyPlan)  # how a chat's reply is read: reasoning, tools
    created: int = field(default_factory=lambda: int(time.time()))
    finish_reasons: list[str] = field(default_factory=list)  # each choice's, as its body said it, once said

    @property
    def object(self) -> str:
        return "chat.completion" if self.chat else "text_completion"

    def head(self) -> dict:
        return {"id": self.request.id, "object": self.object, "created": self.created, "model": self.model_name}


def token_string(piece: bytes, partial_prefix: str = "") -> str:
    """A token's string in logprobs: its text where its bytes are whole UTF-8 characters; else, as
    OpenAI writes a token holding part of a character, its text with each stray byte as `\\xNN`
    after `partial_prefix` (chat and Responses: none, b"\\xf0\\x9f\\x92" is "\\xf0\\x9f\\x92"; legacy
    completions: "bytes:"). Never U+FFFD: that would stand for every such token alike."""
    try:
        return piece.decode("utf-8")
    except UnicodeDecodeError:
        return partial_prefix + piece.decode("utf-8", errors="backslashreplace")


class LogprobFormatter:
    """Logprobs as OpenAI's APIs give them; a `bytes` list is the token's own bytes, so a client
    joins a reply's into its text."""

    def __init__(self, model: Model) -> None:
        self._model = model

    def chat(self, items: list[TokenLogprobs]) -> list[dict]:
        return [
            {**self._entry(i.token, i.logprob), "top_logprobs": [self._entry(t, lp) for t, lp in i.top]}
            for i in items
        ]

    def _entry(self, token: int, logprob: float) -> dict:
        piece = self._model.piece(token, special=True)
        return {"token": token_string(piece), "logprob": logprob, "bytes": list(piece)}

    def offsets(self) -> TextOffsets:
        return TextOffsets(self._model)

    def text(self, items: list[TokenLogprobs], offsets: TextOffsets) -> dict:
        return {
            "tokens": [self._text_token(i.token) for i in items],
            "token_logprobs": [i.logprob for i in items],
            "top_logprobs": [{self._text_token(t): lp for t, lp in i.top} for i in items],
            "text_offset": [offsets.start(i.token) for i in items],
        }

    def _text_token(self, token: int) -> str:
        return token_string(self._model.piece(token, special=True), partial_prefix="bytes:")


class TextOffsets:
    """Where each token of one choice starts in its text, in characters.

    Counted from the decoded bytes, not from token texts: a token holding part of a UTF-8 character
    prints as U+FFFD on its own, and counting that would run the offsets past the text. A token that
    continues a character starts where the character does. Whole and streamed responses feed the
    same tokens in the same order, so they report the same offsets.
    """

    def __init__(self, model: Model) -> None:
        self._model = model
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._chars = 0

    def start(self, token: int) -> int:
        start = self._chars
        self._chars += len(self._decoder.decode(self._model.piece(token)))
        return start


@dataclass
class _ChoiceText:
    text: str = ""
    finish_reason: str | None = None
    logprobs: list[TokenLogprobs] = field(default_factory=list)


async def collect(shape: Shape, outputs: AsyncIterator[RequestOutput], logprobs: LogprobFormatter) -> dict:
    """A whole (non-streamed) response: for chat, its stream's chunks collected."""
    if shape.chat:
        return await _collect_chat(shape, outputs, logprobs)
    choices = [_ChoiceText() for _ in range(shape.request.n)]
    usage: Usage | None = None
    async for output in outputs:
        if output.error is not None:
            raise engine_error(output.error, output.status, output.code)
        for delta in output.deltas:
            c = choices[delta.index]
            c.text += delta.text
            c.logprobs += delta.logprobs
            c.finish_reason = delta.finish_reason.value if delta.finish_reason else c.finish_reason
        usage = output.usage or usage
    want_logprobs = shape.request.logprobs is not None
    body_choices = []
    for index, c in enumerate(choices):
        body_choices.append({
            "index": index,
            "text": c.text,
            "logprobs": logprobs.text(c.logprobs, logprobs.offsets()) if want_logprobs else None,
            "finish_reason": c.finish_reason,
        })
        shape.finish_reasons.append(c.finish_reason)
    return {**shape.head(), "choices": body_choices, "usage": usage_body(usage)}


@dataclass
class _Message:
    """A chat choice folded from its chunks' deltas."""

    content: str = ""
    reasoning: str = ""
    calls: list[dict] = field(default_factory=list)
    logprobs: list[dict] = field(default_factory=list)
    finish_reason: str | None = None

    def add(self, choice: dict) -> None:
        delta = choice["delta"]
        self.content += delta.get("content") or ""
        self.reasoning += delta.get("reasoning_content") or ""
        for call in delta.get("tool_calls", []):
            if "id" in call:
                self.calls.append({"id": call["id"], "type": "function",
                                   "function": {"name": call["function"]["name"], "arguments": ""}})
            self.calls[call["index"]]["function"]["arguments"] += call["function"]["arguments"]
        if choice["logprobs"] is not None:
            self.logprobs += choice["logprobs"]["content"]
        self.finish_reason = choice["finish_reason"] or self.finish_reason

    def body(self, index: int, want_logprobs: bool) -> dict:
        message: dict = {"role": "assistant", "content": self.content or (None if self.calls else "")}
        if self.reasoning:
            message["reasoning_content"] = self.reasoning
        if self.calls:
            message["tool_calls"] = self.calls
        return {"index": index, "message": message,
                "logprobs": {"content": self.logprobs} if want_logprobs else None, "finish_reason": self.finish_reason}


async def _collect_chat(shape: Shape, outputs: AsyncIterator[RequestOutput], logprobs: LogprobFormatter) -> dict:
    readers = [shape.reply.reader() for _ in range(shape.request.n)]
    messages = [_Message() for _ in range(shape.request.n)]
    usage: Usage | None = None
    async for output in outputs:
        if output.error is not None:
            raise engine_error(output.error, output.status, output.code)
        for delta in output.deltas:
            for choice in _chat_chunk_choices(shape, delta, logprobs, readers[delta.index]):
                messages[delta.index].add(choice)
        usage = output.usage or usage
    want = shape.request.logprobs is not None
    return {**shape.head(), "choices": [m.body(i, want) for i, m in enumerate(messages)], "usage": usage_body(usage)}


async def stream(
    shape: Shape, outputs: AsyncIterator[RequestOutput], logprobs: LogprobFormatter, include_usage: bool,
    continuous_usage: bool = False,
) -> AsyncIterator[str]:
    """SSE chunks: a role delta first (chat), text deltas as sampled, a finish per choice, usage, [DONE].
    With `continuous_usage`, every chunk's usage is the prompt's tokens and the tokens sampled so far."""
    head = {**shape.head(), "object": "chat.completion.chunk" if shape.chat else "text_completion"}
    extra = {"usage": _running_usage(shape, 0) if continuous_usage else None} if include_usage else {}
    sampled = 0
    if shape.chat:
        for index in range(shape.request.n):
            delta = {"role": "assistant", "content": ""}
            yield sse({**head, "choices": [{"index": index, "delta": delta, "logprobs": None, "finish_reason": None}], **extra})
    offsets = [logprobs.offsets() for _ in range(shape.request.n)]
    readers = [shape.reply.reader() for _ in range(shape.request.n)] if shape.chat else []
    async for output in outputs:
        if output.error is not None:
            yield sse(engine_error(output.error, output.status, output.code).body)
            break
        if continuous_usage:  # the last output's usage counts what its deltas do not (an end of generation)
            sampled = (output.usage.completion_tokens if output.usage
                       else sampled + sum(len(d.token_ids) for d in output.deltas))
            extra = {"usage": _running_usage(shape, sampled)}
        for delta in output.deltas:
            if readers:
                for choice in _chat_chunk_choices(shape, delta, logprobs, readers[delta.index]):
                    yield sse({**head, "choices": [choice], **extra})
            elif delta.text or delta.finish_reason is not None or delta.logprobs:
                choice = _text_chunk_choice(shape, delta, logprobs, offsets)
                yield sse({**head, "choices": [choice], **extra})
        if output.usage is not None and include_usage:
            yield sse({**head, "choices": [], "usage": usage_body(output.usage)})
    yield sse("[DONE]")


def _running_usage(shape: Shape, sampled: int) -> dict:
    prompt = len(shape.request.prompt)
    return {"prompt_tokens": prompt, "completion_tokens": sampled, "total_tokens": prompt + sampled}


def _text_chunk_choice(shape: Shape, delta: Delta, logprobs: LogprobFormatter, offsets: list[TextOffsets]) -> dict:
    reason = delta.finish_reason.value if delta.finish_reason else None
    if reason is not None:
        shape.finish_reasons.append(reason)
    lp = logprobs.text(delta.logprobs, offsets[delta.index]) if shape.request.logprobs is not None else None
    return {"index": delta.index, "text": delta.text, "logprobs": lp, "finish_reason": reason}


def _chat_chunk_choices(shape: Shape, delta: Delta, logprobs: LogprobFormatter, reader: ReplyReader) -> list[dict]:
    """One chunk per event the reader found in this delta: content, reasoning, a call's head (id,
    type and whole name, once), or a fragment of its arguments. Logprobs ride on the first chunk,
    the finish reason on the last."""
    events = reader.feed(delta.text)
    if delta.finish_reason is not None:
        events += reader.finish(delta.finish_reason.value)
    ended = next((e for e in events if isinstance(e, Ended)), None)
    bodies = [_event_delta(event) for event in events if not isinstance(event, Ended)]
    if not bodies and (ended is not None or delta.logprobs):
        bodies = [{}]
    choices = [{"index": delta.index, "delta": body, "logprobs": None, "finish_reason": None} for body in bodies]
    if choices and shape.request.logprobs is not None:
        choices[0]["logprobs"] = {"content": logprobs.chat(delta.logprobs)}
    if ended is not None:
        choices[-1]["finish_reason"] = ended.finish_reason
        shape.finish_reasons.append(ended.finish_reason)
    return choices


def _event_delta(event: ReplyEvent) -> dict:
    if isinstance(event, ContentDelta):
        return {"content": event.text}
    if isinstance(event, ReasoningDelta):
        return {"reasoning_content": event.text}
    if isinstance(event, CallStarted):
        head = {"index": event.index, "id": event.id, "type": "function",
                "function": {"name": event.name, "arguments": ""}}
        return {"tool_calls": [head]}
    return {"tool_calls": [{"index": event.index, "function": {"arguments": event.text}}]}

"""Where a chat prompt may stop its prefill: marks found by rendering the model's own template with
sentinel contents, so they hold for any template, not one hard-coded family.

A mark is a token count. A checkpoint at a mark is reusable by any later prompt that starts with
the same tokens, so marks sit where conversations agree:
- `head`: the template's leading tokens before the first message's content (any system prompt);
- `opening`: everything before the first user message's content (any question, this system prompt);
- `stable`: the end of the last complete earlier turn (the next turn repeats it exactly);
- `close`: right after the last message, before the generation prompt.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from kvserve.llama.chat_template import ChatTemplate
from kvserve.llama.model import Model

_SENTINEL = "\u2063kvserve-mark\u2063"  # invisible separator: never produced by a real template


class MarkKind(str, enum.Enum):
    """Who can reuse a checkpoint taken at a mark; the state cache evicts conversation ones first."""

    OPENING = "opening"  # every conversation on this system prompt (`head`, `opening`)
    CONVERSATION = "conversation"  # this conversation's next turns (`stable`, `close`)


@dataclass(frozen=True)
class Mark:
    position: int  # tokens before it
    kind: MarkKind


@dataclass
class Chat:
    """A conversation rendered with one model's template."""

    template: ChatTemplate
    messages: list[dict[str, str]] = field(default_factory=list)


@dataclass(frozen=True)
class MarkedTurn:
    tokens: list[int]
    head: int
    opening: int
    stable: int
    close: int

    def checkpoint_marks(self) -> list[Mark]:
        """Each distinct useful mark, shallowest first. A prefill stopped at a mark must leave at
        least one prompt token to evaluate, so the model can produce the next logits."""
        marks = [(self.head, MarkKind.OPENING), (self.opening, MarkKind.OPENING),
                 (self.stable, MarkKind.CONVERSATION), (self.close, MarkKind.CONVERSATION)]
        seen: dict[int, MarkKind] = {}
        for position, kind in marks:
            if 0 < position < len(self.tokens) and position not in seen:
                seen[position] = kind
        return [Mark(position, kind) for position, kind in sorted(seen.items())]


def create_chat_renderer(model: Model, system: str | None = None) -> Chat:
    chat = Chat(ChatTemplate.from_model(model))
    if system is not None:
        chat.messages.append({"role": "system", "content": system})
    return chat


def add_user(chat: Chat, text: str) -> None:
    chat.messages.append({"role": "user", "content": text})


def add_assistant(chat: Chat, text: str) -> None:
    chat.messages.append({"role": "assistant", "content": text})


def render_turn_marked(model: Model, chat: Chat) -> MarkedTurn:
    return mark_messages(model, chat.template, chat.messages)


def mark_messages(model: Model, template: ChatTemplate, messages: list[dict[str, str]]) -> MarkedTurn:
    """The prompt tokens of `messages` (with the generation prompt) and its four marks."""
    text = template.render(messages)
    # BOS as the unmarked prompt gets it: added only where the model wants it and the text lacks it
    bos = template.bos_token
    tokens = model.tokenize(text, add_special=model.adds_bos and not (bos and text.startswith(bos)), parse_special=True)
    ends = _token_ends(model, tokens)

    def at(chars: int | None) -> int:
        return _tokens_before(ends, len(text[:chars].encode())) if chars else 0

    user = next((i for i, m in enumerate(messages) if m["role"] == "user"), None)
    last_user = max((i for i, m in enumerate(messages) if m["role"] == "user"), default=None)
    return MarkedTurn(
        tokens=tokens,
        head=at(_content_offset(template, messages, 0, text)) if messages else 0,
        opening=at(_content_offset(template, messages, user, text)) if user is not None else 0,
        stable=at(_prefix_length(template, messages[:last_user], text)) if last_user != user else 0,
        close=at(_prefix_length(template, messages, text, generation_prompt=False)),
    )


def _content_offset(template: ChatTemplate, messages: list[dict[str, str]], index: int, text: str) -> int | None:
    """Characters before message `index`'s content, if the text before it does not depend on it."""
    probe = [dict(m) for m in messages]
    probe[index]["content"] = _SENTINEL
    rendered = template.render(probe)
    offset = rendered.find(_SENTINEL)
    return offset if offset >= 0 and text.startswith(rendered[:offset]) else None


def _prefix_length(template: ChatTemplate, messages: list[dict[str, str]], text: str,
                   generation_prompt: bool = False) -> int | None:
    """Length of the rendering of `messages` if the full prompt starts with it."""
    if not messages:
        return None
    rendered = template.render(messages, add_generation_prompt=generation_prompt)
    return len(rendered) if text.startswith(rendered) else None


def _token_ends(model: Model, tokens: list[int]) -> list[int]:
    ends, total = [], 0
    for token in tokens:
        total += len(model.piece(token, special=True))
        ends.append(total)
    return ends


def _tokens_before(ends: list[int], byte_offset: int) -> int:
    """How many tokens end at or before `byte_offset`: a mark inside a token falls back before it."""
    n = 0
    while n < len(ends) and ends[n] <= byte_offset:
        n += 1
    return n

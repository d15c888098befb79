"""A reasoning reply's thinking as the engine watches it: its tokens counted, and closed by the
server once its budget is spent.

Invariants: a token counts as thinking when the reply was inside its thinking before or after it
(its opening and closing tags count); once the count reaches the budget while the thinking is
open, the next tokens are the close text's, forced in order (each accepted by the sampler chain as
if sampled, so grammar and penalties see it), and the model then writes its answer. Forced tokens
are generated tokens: `max_tokens` counts them, as it counts every thinking token.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from kvserve.reply import ReasoningSyntax


@dataclass(frozen=True)
class ThinkingLimit:
    """A request's thinking: the reply's syntax, its budget in tokens (None: unlimited), and the
    tokens of the text that closes it."""

    syntax: ReasoningSyntax
    budget: int | None
    close_tokens: tuple[int, ...]


class ThinkingWatch:
    """One choice's thinking; the engine thread's alone."""

    def __init__(self, limit: ThinkingLimit) -> None:
        self._limit = limit
        self._splitter = limit.syntax.splitter()
        self._forced: deque[int] = deque()
        self._closing = False
        self.tokens = 0  # generated while thinking

    def forced_token(self) -> int | None:
        """The token the server writes next instead of sampling one, if any."""
        budget = self._limit.budget
        if not self._closing and budget is not None and self.tokens >= budget and self._splitter.thinking:
            self._closing = True
            self._forced.extend(self._limit.close_tokens)
        return self._forced.popleft() if self._forced else None

    def observe(self, text: str) -> None:
        """The text of the token just generated."""
        was_thinking = self._splitter.thinking
        self._splitter.feed(text)
        if was_thinking or self._splitter.thinking:
            self.tokens += 1

"""A reasoning reply's thinking as the engine watches it: its tokens counted, and closed by the
server once its budget is spent.

Invariants: a token counts as thinking when the reply was inside its thinking before or after it
(its opening and closing tags count); once the count reaches the budget while the thinking is
open, the next tokens are the close text's, forced in order (each accepted by the sampler chain as
if sampled, so grammar and penalties see it), and the model then writes its answer. Forced tokens
are generated tokens: `max_tokens` counts them, as it counts every thinking token.

A lazy tool grammar (`auto`) waits out of the sampler chain while the reply thinks, and is armed
once it answers (`Sampler.gate`), fed the tokens from where the thinking's close began: llama.cpp
would otherwise match its trigger patterns against the whole thinking again at every token.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from kvserve.llama.sampler import Sampler
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
        self._since_quiet: list[int] = []  # tokens since the splitter last held no tag while not answering

    def forced_token(self) -> int | None:
        """The token the server writes next instead of sampling one, if any."""
        budget = self._limit.budget
        if not self._closing and budget is not None and self.tokens >= budget and self._splitter.thinking:
            self._closing = True
            self._forced.extend(self._limit.close_tokens)
        return self._forced.popleft() if self._forced else None

    def observe(self, text: str, token: int | None = None) -> None:
        """The text of the token just generated."""
        was_thinking = self._splitter.thinking
        self._splitter.feed(text)
        if was_thinking or self._splitter.thinking:
            self.tokens += 1
        if token is not None:
            self._since_quiet.append(token)
        if not self._splitter.answering and not self._splitter.holding:
            self._since_quiet = []  # a close, if one comes, starts at the next token

    @property
    def answering(self) -> bool:
        """The reply is past its thinking: a lazy tool grammar may watch it."""
        return self._splitter.answering

    def replay(self) -> list[int]:
        """The tokens since the thinking was last seen with no tag begun: the close's and the answer's."""
        return list(self._since_quiet)

    def gate(self, sampler: Sampler, token: int, text: str) -> None:
        """Observe the token just generated, then arm or disarm the sampler's deferred grammar."""
        self.observe(text, token)
        sampler.gate(self.answering, self.replay)
        if self.answering:
            self._since_quiet = []  # armed (or no grammar waits): nothing to replay until thinking again

"""From a row of logits to a choice's next token and what the client sees of it.

Invariants:
- an end-of-generation token ends the choice with `stop` and reaches the client neither as a token
  nor as logprobs (unless the request ignores it);
- nothing at or after a stop string reaches the client; a choice that ends otherwise emits the text
  held back for a possible stop string or a character split across tokens;
- a choice ends with `length` at its `max_tokens` or at the longest sequence the context allows;
- a sampled token whose logit is not finite (the model's row is NaN or infinite: an adapter scale
  that overflows, a broken model) is never emitted: `NonFiniteLogits` ends the request with an error;
- a choice whose thinking spent its budget takes the close text's tokens instead of sampling
  (`thinking.ThinkingWatch`);
- a draft is verified by sampling its rows in order with the choice's own chain, each sampled token
  emitted exactly as without a draft, up to the first that differs from the draft's token (the
  correction) or the choice's end: the chain never sees a token that is not emitted, and nothing
  after a stop string, an end-of-generation token or `max_tokens` is emitted.
"""

from __future__ import annotations

import math

from kvserve.llama.context import Context
from kvserve.llama.sampler import token_logprobs
from kvserve.scheduler.request import Choice, Delta, FinishReason, Request
from kvserve.scheduler.step_output import StepOutputs


class NonFiniteLogits(RuntimeError):
    """The model's logit for the token just sampled is NaN or infinite, so its whole row is noise:
    greedy picks token 0 of a NaN row (often end-of-text: an empty reply), a draw picks anything."""


class Sampling:
    def __init__(self, ctx: Context, max_seq_len: int) -> None:
        self.ctx = ctx
        self.max_seq_len = max_seq_len

    def take_token(self, request: Request, choice: Choice, row: int, outputs: StepOutputs) -> None:
        """Sample the choice's next token from logits row `row` and emit it."""
        forced = choice.thinking.forced_token() if choice.thinking is not None else None
        if forced is None:
            token = choice.sampler.sample(self.ctx, row)
            if not math.isfinite(logit := self.ctx.logit(row, token)):
                raise NonFiniteLogits(f"the model's logits are {logit} {choice.n_generated} token(s) into the reply")
        else:
            token = forced
            choice.sampler.accept(token)
        choice.tokens.append(token)
        choice.n_generated += 1
        delta = outputs.delta(request, choice)
        if self.ctx.model.is_eog(token) and not request.ignore_eos:
            self._close_choice(choice, FinishReason.STOP, delta)
            return
        if request.logprobs is not None:
            delta.logprobs.append(token_logprobs(self.ctx.logits(row), token, request.logprobs))
        delta.token_ids.append(token)
        text = choice.detokenizer.feed(token)
        if choice.thinking is not None:
            choice.thinking.gate(choice.sampler, token, text)
        delta.text += choice.stop_matcher.feed(text)
        if choice.stop_matcher.matched is not None:
            choice.end(FinishReason.STOP)
            delta.finish_reason = FinishReason.STOP
            delta.stop_sequence = choice.stop_matcher.matched
        elif choice.n_generated >= request.max_tokens or len(choice.tokens) >= self.max_seq_len:
            self._close_choice(choice, FinishReason.LENGTH, delta)

    def verify(self, request: Request, choice: Choice, row: int, draft: list[int], outputs: StepOutputs) -> int:
        """Take the choice's tokens from rows `row`, `row + 1`, .. (the last known token's, then each
        draft token's) while each sampled token is the draft's; returns how many draft tokens were
        accepted, i.e. whose rows hold the choice's tokens. The last token taken is never evaluated.

        For a draft that is one guess per position (every drafter here), sampling the target and
        comparing is the standard rejection rule: the guess is kept with the target's probability
        of it, and a rejection samples the target's distribution without the guess."""
        for i in range(len(draft) + 1):
            self.take_token(request, choice, row + i, outputs)
            if choice.finish_reason is not None or i == len(draft) or choice.tokens[-1] != draft[i]:
                return i
        raise AssertionError("unreachable")

    @staticmethod
    def _close_choice(choice: Choice, reason: FinishReason, delta: Delta) -> None:
        """End a choice normally: text held back for a possible stop string or a split character is real."""
        delta.text += choice.stop_matcher.feed(choice.detokenizer.flush()) + choice.stop_matcher.flush()
        choice.end(reason)
        delta.finish_reason = reason

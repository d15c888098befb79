"""Whether drafting pays, measured rather than priced: for one sequence (`Payoff`), and for the
steps of one count of decoding sequences (`StepPayoff`), whose seconds every sequence in them
shares. Both compare tokens per second of steps that carried drafts with steps that carried none,
each step's seconds its `llama_decode`'s (steps with prompt chunks are not timed). Tokens are
counted, so only the seconds take a median, against a step the machine slowed.

Invariants:
- a judgement needs `PAYOFF_MIN` drafted and `PAYOFF_MIN` undrafted steps; each window keeps only
  its last steps, so a judgement follows the load within a few steps;
- where drafting did not pay, it stops: a sequence until its watched proposals come true by as many
  tokens as a draft would have needed, a count of sequences (above one) for `STEP_HOLD` of its steps;
- while every step drafts, one in `PAYOFF_PROBE` drafts none, so the undrafted side stays current.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field

# The per-sequence check that drafting pays (`Payoff`): the drafted steps it weighs (it decides
# once it has PAYOFF_MIN of them) and the undrafted ones it weighs them against; a sequence that
# drafts every step skips one draft after each PAYOFF_PROBE drafted steps, to time a step without.
PAYOFF_DRAFTED = 8
PAYOFF_PLAIN = 4
PAYOFF_MIN = 3
PAYOFF_PROBE = 32
# Steps of one count of decoding sequences that draft nothing once drafted steps of that count were
# measured to give fewer tokens per second than undrafted ones (`StepPayoff`); then it measures again.
STEP_HOLD = 64


@dataclass
class Throughput:
    """Tokens sequences took from timed steps (decodes and drafts only), and those steps' seconds:
    each step counted once per sequence, so the rate is one sequence's."""

    tokens: int = 0
    seconds: float = 0.0

    def add(self, tokens: int, seconds: float) -> None:
        self.tokens += tokens
        self.seconds += seconds

    @property
    def per_second(self) -> float | None:
        return self.tokens / self.seconds if self.seconds > 0 else None


@dataclass
class Payoff:
    """Whether drafting pays one sequence, measured rather than priced: the mean tokens of its last
    drafted steps over their median seconds, against one token over the median seconds of its last
    undrafted ones (each step's seconds its `llama_decode`'s; steps with prompt chunks are not
    timed). Tokens are counted, so only the seconds need a median against a slow step. Where
    drafting did not pay, the sequence stops (`needed`: the accepted tokens a draft would have
    needed) until the proposals it then watches come true by that many tokens on average."""

    drafted: deque[tuple[int, float]] = field(default_factory=lambda: deque(maxlen=PAYOFF_DRAFTED))
    plain: deque[float] = field(default_factory=lambda: deque(maxlen=PAYOFF_PLAIN))
    watched: deque[int] = field(default_factory=lambda: deque(maxlen=PAYOFF_MIN))  # right tokens, while stopped
    needed: float | None = None
    since_plain: int = 0  # drafted steps since its last undrafted one
    pending: float | None = None  # the seconds of the step whose draft is being verified

    @property
    def probing(self) -> bool:
        """It drafts none this step, to time a step without a draft."""
        return len(self.plain) < PAYOFF_MIN <= len(self.drafted) or self.since_plain >= PAYOFF_PROBE

    def may_draft(self) -> bool:
        return self.needed is None and not self.probing

    def timed(self, seconds: float, drafted: bool) -> None:
        if drafted:
            self.pending = seconds
        else:
            self.plain.append(seconds)
            self.since_plain = 0

    def verified(self, tokens: int) -> None:
        """The draft of the step last timed gave `tokens` tokens (the correction among them)."""
        if self.pending is None:
            return
        self.drafted.append((tokens, self.pending))
        self.pending = None
        self.since_plain += 1
        if len(self.drafted) < PAYOFF_MIN or len(self.plain) < PAYOFF_MIN:
            return
        tokens_per_step = statistics.mean(n for n, _ in self.drafted)
        slower = statistics.median(t for _, t in self.drafted) / statistics.median(self.plain)
        if tokens_per_step < slower:
            self.needed = slower - 1
            self.drafted.clear()
            self.watched.clear()

    def settled(self, right: int) -> None:
        """A watched proposal came true for `right` tokens, then departed from the output or ended."""
        if self.needed is None:
            return
        self.watched.append(right)
        if len(self.watched) == PAYOFF_MIN and statistics.mean(self.watched) >= self.needed:
            self.needed = None


def _rate(steps: deque[tuple[int, float]]) -> float:
    """Tokens per second of `steps` (tokens, seconds): their mean tokens over their median seconds."""
    return statistics.mean(n for n, _ in steps) / statistics.median(t for _, t in steps)


@dataclass
class StepPayoff:
    """Whether drafting pays the steps that decode one count of sequences: a draft that pays its own
    sequence (`Payoff`) can slow the step's other sequences by more than it gains, which only the
    cost table weighs, and only while its prices hold (a busy core makes them wrong). The tokens per
    second of its last drafted steps (every sequence's tokens) against its last undrafted ones';
    where drafts did not pay, no sequence drafts in such a step for `STEP_HOLD` of them, then drafted
    steps are measured afresh."""

    drafted: deque[tuple[int, float]] = field(default_factory=lambda: deque(maxlen=PAYOFF_DRAFTED))
    plain: deque[tuple[int, float]] = field(default_factory=lambda: deque(maxlen=PAYOFF_PLAIN))
    held: int = 0  # steps of this count still to draft nothing
    since_plain: int = 0  # drafted steps since its last undrafted one

    @property
    def probing(self) -> bool:
        """No sequence drafts this step, to time a step without a draft."""
        return len(self.plain) < PAYOFF_MIN <= len(self.drafted) or self.since_plain >= PAYOFF_PROBE

    def may_draft(self) -> bool:
        return not self.held and not self.probing

    def stepped(self, tokens: int, seconds: float, drafted: bool) -> None:
        """A timed step of this count gave its sequences `tokens` tokens in `seconds`, with drafts or none."""
        if not drafted:
            self.held = max(self.held - 1, 0)
            self.plain.append((tokens, seconds))
            self.since_plain = 0
            return
        self.drafted.append((tokens, seconds))
        self.since_plain += 1
        measured = len(self.drafted) >= PAYOFF_MIN and len(self.plain) >= PAYOFF_MIN
        if measured and _rate(self.drafted) < _rate(self.plain):
            self.held = STEP_HOLD
            self.drafted.clear()

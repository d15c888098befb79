"""Speculative decoding in the continuous batch: which decoding sequences carry a draft this step,
from which drafter, and how long.

A draft of k tokens rides in the sequence's ordinary slot: the step evaluates its last token and
the k guesses, each with logits, beside everyone else's tokens. `Sampling.verify` then samples row
after row with the request's own sampler chain and stops at the first sampled token that is not the
draft's; that token is the step's correction. So the chain sees exactly the tokens it would have
sampled without speculation (penalties, logit_bias, grammars and seeded RNG draws alike), and a
drafter's guess can change how fast tokens come, never which.

Choosing k (mode `auto`; a fixed drafter, `ngram`, `tree` or `draft`, drafts all it guesses up to
`--draft-max`): a step costs about `a * ubatches + b * tokens` seconds (`StepCost`, fitted on the
steps the engine runs). llama.cpp splits a step into ubatches that take the same number of tokens
from a run of adjacent streams (`ubatch_sizes`), and each ubatch reads every weight again: a draft
on one of eight decoding sequences costs a whole extra ubatch, equal drafts on all eight none. A
draft token that the target accepts with probability `p` adds `p` expected tokens for `b` seconds;
the speculator adds draft tokens, most likely first, while each raises the step's expected tokens
per second and none is less likely than `MIN_GAIN`, then drops whole drafts while that raises it
(the ubatches they cost). Where a step's cost grows with every token (a busy CPU) that stops
drafts early; where weights dominate (one user) it lets long, likely drafts through. Acceptance
is measured per drafter and per sequence.

A draft model (`--draft-model`, `DraftModel`, mode `draft` only) drafts, in one batch, every
sequence that has no `prediction` to draft from, to `--draft-max`. `auto` does not ask it: on 2 CPU
cores a 0.5B drafting for a 1.5B lost wherever it was priced in (its guess decodes and the catch-up
of every prompt; `bench/results/speculative.md`, `kvserve-auto` against `kvserve-auto-nodraft`).

Invariants:
- a draft never runs past the sequence's stream, its `max_tokens` or the longest sequence allowed;
- nothing drafts for a model whose rows cannot be cut (a recurrent state, `KvManager.cuts_rows`);
  a sliding-window model drafts, and each cut asks its stream (`KvManager.commit`);
- the step's tokens stay within the token budget.
"""

from __future__ import annotations

import enum
import heapq
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvserve.llama.batch import ubatch_sizes
from kvserve.scheduler.drafters import Drafter, NgramDrafter, PredictionDrafter, Sequence, TreeDrafter

if TYPE_CHECKING:
    from kvserve.scheduler.draft_model import DraftModel


class SpecMode(str, enum.Enum):
    OFF = "off"
    AUTO = "auto"  # every drafter, lengths chosen by measured acceptance and step cost
    NGRAM = "ngram"
    TREE = "tree"
    DRAFT = "draft"  # a draft model (`--draft-model`), after a request's prediction


# A drafter's acceptance before any of its drafts was verified (optimistic enough to be tried).
PRIOR_ACCEPTANCE = {"prediction": 0.8, "tree": 0.7, "ngram": 0.5, "draft": 0.6}
# A draft token less likely than this to be accepted is never drafted, whatever the fitted cost says:
# a fit on noisy steps can find a token free (b = 0, measured), and rejected rows are never free.
MIN_GAIN = 0.25
# Weight of the newest verification in a sequence's acceptance average.
ACCEPTANCE_EMA = 0.3
@dataclass
class DrafterStats:
    drafted: int = 0
    accepted: int = 0
    drafts: int = 0  # verifications
    trials: int = 0  # accepted tokens plus the rejections that ended drafts


@dataclass
class SpecState:
    """One choice's view for drafters and its measured acceptance per drafter."""

    sequence: Sequence
    acceptance: dict[str, float] = field(default_factory=dict)
    prediction_accepted: int = 0
    prediction_rejected: int = 0

    def rate(self, drafter: str, global_rate: float) -> float:
        return self.acceptance.get(drafter, global_rate)


class StepCost:
    """`seconds = a * ubatches + b * tokens` for a step (`ubatch_sizes`: each ubatch reads every
    weight again), fitted by exponentially weighted least squares over recent steps (prior: a
    guess, as if a few steps of one ubatch had been seen)."""

    def __init__(self, a: float = 0.02, b: float = 0.002, weight: float = 0.05) -> None:
        self.a, self.b = a, b
        self.weight = weight
        # weighted sums of u*u, u*n, n*n, u*t, n*t
        self._sums = [0.0] * 5
        for n in (1, 16):
            self.observe(n, a + b * n, weight=0.5)

    def observe(self, n_tokens: int, seconds: float, ubatches: int = 1, weight: float | None = None) -> None:
        w = self.weight if weight is None else weight
        u, n, t = ubatches, n_tokens, seconds
        s = self._sums
        for i, value in enumerate((u * u, u * n, n * n, u * t, n * t)):
            s[i] = (1 - w) * s[i] + w * value
        uu, un, nn, ut, nt = s
        det = uu * nn - un * un
        if det > 1e-12 * uu * nn:
            self.a = (ut * nn - nt * un) / det
            self.b = (uu * nt - un * ut) / det
        if self.b < 0 or self.a <= 0:  # a fit outside the model's range: keep the per-ubatch part
            self.b = max(self.b, 0.0) if self.a > 0 else max(nt / nn, 0.0)
            self.a = max((ut - self.b * un) / uu, 1e-6)

    def seconds(self, n_tokens: int, ubatches: int = 1) -> float:
        return self.a * ubatches + self.b * n_tokens


@dataclass(frozen=True)
class SpecConfig:
    mode: SpecMode = SpecMode.OFF
    draft_max: int = 8  # most draft tokens per sequence and step


class Speculator:
    def __init__(self, config: SpecConfig, tree_drafter: TreeDrafter | None, can_cut: bool,
                 draft_model: "DraftModel | None" = None, n_ubatch: int = 512) -> None:
        self.config = config
        self.n_ubatch = n_ubatch  # the target context's: how a step splits (`ubatch_sizes`)
        self.enabled = config.mode is not SpecMode.OFF and can_cut
        if self.enabled and config.mode is SpecMode.DRAFT and draft_model is None:
            raise ValueError("--speculative draft needs --draft-model")
        self.cost = StepCost()
        self.stats: dict[str, DrafterStats] = {}
        ngram, prediction = NgramDrafter(), PredictionDrafter()
        drafters: dict[SpecMode, list[Drafter]] = {
            SpecMode.AUTO: [prediction, *([tree_drafter] if tree_drafter else []), ngram],
            SpecMode.NGRAM: [prediction, ngram],
            SpecMode.TREE: [prediction, *([tree_drafter] if tree_drafter else [])],
            SpecMode.DRAFT: [prediction],
        }
        self.drafters = drafters.get(config.mode, []) if self.enabled else []
        # the draft model, asked after a prediction for the sequences without one
        self.draft_model = draft_model if self.enabled and config.mode is SpecMode.DRAFT else None
        for drafter in [*self.drafters, *([draft_model] if self.draft_model else [])]:
            self.stats[drafter.name] = DrafterStats()

    def describe(self) -> dict:
        """What /server_info says of speculation."""
        model = self.draft_model
        return {"mode": self.config.mode.value, "enabled": self.enabled, "draft_max": self.config.draft_max,
                "drafters": [d.name for d in self.drafters] + ([model.name] if model else []),
                "step_cost": {"a_seconds": round(self.cost.a, 5), "b_seconds_per_token": round(self.cost.b, 6)},
                **(model.describe() if model else {})}

    def global_rate(self, drafter: str) -> float:
        stats = self.stats[drafter]
        prior = PRIOR_ACCEPTANCE.get(drafter, 0.5)
        return (stats.accepted + 4 * prior) / (stats.trials + 4)

    def choose(self, candidates: list[tuple[SpecState, int]], n_decoding: int, n_other: int) -> list[tuple[list[int], str]]:
        """Drafts for `candidates` (a state and the most draft tokens its stream, limits and the
        budget allow; one per decoding sequence), for a step that also carries `n_other` prompt
        tokens (`auto`): each draft token is kept while it raises expected tokens per second of step,
        then whole drafts are dropped while that raises it (a draft that makes a ubatch of its own
        pays for a read of every weight)."""
        proposals: list[tuple[list[int], str, float]] = []
        for state, limit in candidates:
            proposals.append(self._propose(state, min(limit, self.config.draft_max)))
        seqs = [state.sequence.seq for state, _ in candidates]
        if self.draft_model is not None:
            self._draft_with_model(candidates, proposals)
        if self.config.mode is not SpecMode.AUTO:
            return [(draft, name) for draft, name, _ in proposals]  # a fixed drafter drafts all it can
        keep = [0] * len(proposals)
        rates = [rate for _, _, rate in proposals]
        expected = float(n_decoding)
        seconds = self._seconds(seqs, keep, n_other)
        heap = [(-rate, i) for i, (draft, _, rate) in enumerate(proposals) if draft]
        heapq.heapify(heap)
        while heap:
            neg_gain, i = heapq.heappop(heap)
            gain = -neg_gain
            if gain < MIN_GAIN or gain * seconds <= expected * self.cost.b:
                break  # (expected + gain) / (seconds + b) would not beat expected / seconds
            keep[i] += 1
            seconds += self.cost.b
            expected += gain
            draft, _, rate = proposals[i]
            if keep[i] < len(draft):
                heapq.heappush(heap, (-(gain * rate), i))
        keep = self._drop_costly_drafts(seqs, rates, keep, n_other)
        return [(draft[:n], name) for (draft, name, _), n in zip(proposals, keep)]

    def _seconds(self, seqs: list[int], drafts: list[int], n_other: int) -> float:
        """What a step costs that decodes `seqs`, each with its draft, and `n_other` prompt tokens
        (in ubatches of their own)."""
        ubatches = len(ubatch_sizes([(seq, 1 + k) for seq, k in zip(seqs, drafts)], self.n_ubatch))
        return self.cost.seconds(len(seqs) + sum(drafts) + n_other, ubatches + -(-n_other // self.n_ubatch))

    def _drop_costly_drafts(self, seqs: list[int], rates: list[float], keep: list[int], n_other: int) -> list[int]:
        """`keep`, less the whole drafts whose dropping most raises expected tokens per second of
        step, one at a time, while one does."""
        def goodput(drafts: list[int]) -> float:
            return _expected(rates, drafts, len(seqs)) / self._seconds(seqs, drafts, n_other)

        best = goodput(keep)
        while True:
            options = [(goodput(trial), trial) for i in range(len(keep)) if keep[i]
                       for trial in [keep[:i] + [0] + keep[i + 1:]]]
            if not options:
                return keep
            rate, trial = max(options, key=lambda option: option[0])
            if rate <= best:
                return keep
            best, keep = rate, trial

    def _draft_with_model(self, candidates: list[tuple[SpecState, int]], proposals: list[tuple[list[int], str, float]]) -> None:
        """The draft model's guesses, in one batch, for the candidates without a proposal (mode
        `draft`, which drafts all it guesses: no acceptance rate is weighed)."""
        model = self.draft_model
        assert model is not None
        wanting = [i for i, (state, limit) in enumerate(candidates)
                   if not proposals[i][0] and min(limit, self.config.draft_max) > 0]
        if not wanting:
            return
        wants = [(candidates[i][0].sequence.seq, candidates[i][0].sequence.tokens,
                  min(candidates[i][1], self.config.draft_max)) for i in wanting]
        for i, draft in zip(wanting, model.draft(wants)):
            proposals[i] = (draft, model.name, 0.0)

    def _propose(self, state: SpecState, k: int) -> tuple[list[int], str, float]:
        """The first drafter with a guess, in order (a request's prediction first)."""
        if k <= 0:
            return [], "", 0.0
        for drafter in self.drafters:
            draft = drafter.propose(state.sequence, k)
            if draft:
                return draft, drafter.name, state.rate(drafter.name, self.global_rate(drafter.name))
        return [], "", 0.0

    def record(self, state: SpecState, drafter: str, drafted: int, accepted: int) -> None:
        """A verification of `drafted` tokens from `drafter` kept `accepted` of them."""
        stats = self.stats[drafter]
        stats.drafts += 1
        stats.drafted += drafted
        stats.accepted += accepted
        stats.trials += accepted + (accepted < drafted)
        rate = accepted / (accepted + (accepted < drafted))  # each draft token's chance, given the one before
        old = state.rate(drafter, self.global_rate(drafter))
        state.acceptance[drafter] = (1 - ACCEPTANCE_EMA) * old + ACCEPTANCE_EMA * rate
        if drafter == "prediction":
            state.prediction_accepted += accepted
            state.prediction_rejected += drafted - accepted


def _expected(rates: list[float], drafts: list[int], n_decoding: int) -> float:
    """Tokens a step is expected to emit: one per decoding sequence, and each draft token with the
    chance that it and all before it are accepted."""
    return n_decoding + sum(sum(rate ** j for j in range(1, k + 1)) for rate, k in zip(rates, drafts))

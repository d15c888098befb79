"""Speculative decoding in the continuous batch: which decoding sequences carry a draft this step,
from which drafter, and how long.

A draft of k tokens rides in the sequence's ordinary slot: the step evaluates its last token and
the k guesses, each with logits, beside everyone else's tokens. `Sampling.verify` then samples row
after row with the request's own sampler chain and stops at the first sampled token that is not the
draft's; that token is the step's correction. So the chain sees exactly the tokens it would have
sampled without speculation (penalties, logit_bias, grammars and seeded RNG draws alike), and a
drafter's guess can change how fast tokens come, never which.

Choosing k (mode `auto`; a fixed drafter, `ngram` or `tree`, drafts all it guesses up to
`--draft-max`): a step costs about
`a + b * tokens` seconds (`StepCost`, fitted on the steps the engine runs). A draft token that the
target accepts with probability `p` adds `p` expected tokens for `b` seconds; the speculator adds
draft tokens, most likely first, while each raises the step's expected tokens per second and none
is less likely than `MIN_GAIN`. Where a
step's cost grows with every token (a busy CPU) that stops drafts early; where weights dominate (one
user) it lets long, likely drafts through. Acceptance is measured per drafter and per sequence.

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

from kvserve.scheduler.drafters import Drafter, NgramDrafter, PredictionDrafter, Sequence, TreeDrafter


class SpecMode(str, enum.Enum):
    OFF = "off"
    AUTO = "auto"  # every drafter, lengths chosen by measured acceptance and step cost
    NGRAM = "ngram"
    TREE = "tree"
    DRAFT = "draft"  # a draft model: not built; refused at start-up


# A drafter's acceptance before any of its drafts was verified (optimistic enough to be tried).
PRIOR_ACCEPTANCE = {"prediction": 0.8, "tree": 0.7, "ngram": 0.5}
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
    """`seconds = a + b * tokens` for a step, fitted by exponentially weighted least squares over
    recent steps (prior: a measured start-up probe, or a guess)."""

    def __init__(self, a: float = 0.02, b: float = 0.002, weight: float = 0.05) -> None:
        self.a, self.b = a, b
        self.weight = weight
        # weighted sums of n, t, n*n, n*t, as if a few steps at the prior had been seen
        self._sums = [0.0] * 5
        for n in (1, 16):
            self.observe(n, a + b * n, weight=0.5)

    def observe(self, n_tokens: int, seconds: float, weight: float | None = None) -> None:
        w = self.weight if weight is None else weight
        s = self._sums
        for i, value in enumerate((1.0, n_tokens, seconds, n_tokens * n_tokens, n_tokens * seconds)):
            s[i] = (1 - w) * s[i] + w * value
        count, mean_n, mean_t = s[0], s[1] / s[0], s[2] / s[0]
        var = s[3] / count - mean_n * mean_n
        if var > 1e-9:
            self.b = max((s[4] / count - mean_n * mean_t) / var, 0.0)
            self.a = max(mean_t - self.b * mean_n, 1e-6)

    def seconds(self, n_tokens: int) -> float:
        return self.a + self.b * n_tokens


@dataclass(frozen=True)
class SpecConfig:
    mode: SpecMode = SpecMode.OFF
    draft_max: int = 8  # most draft tokens per sequence and step


class Speculator:
    def __init__(self, config: SpecConfig, tree_drafter: TreeDrafter | None, can_cut: bool) -> None:
        self.config = config
        self.enabled = config.mode is not SpecMode.OFF and can_cut
        self.cost = StepCost()
        self.stats: dict[str, DrafterStats] = {}
        ngram, prediction = NgramDrafter(), PredictionDrafter()
        drafters: dict[SpecMode, list[Drafter]] = {
            SpecMode.AUTO: [prediction, *([tree_drafter] if tree_drafter else []), ngram],
            SpecMode.NGRAM: [prediction, ngram],
            SpecMode.TREE: [prediction, *([tree_drafter] if tree_drafter else [])],
        }
        self.drafters = drafters.get(config.mode, []) if self.enabled else []
        for drafter in self.drafters:
            self.stats[drafter.name] = DrafterStats()

    def describe(self) -> dict:
        """What /server_info says of speculation."""
        return {"mode": self.config.mode.value, "enabled": self.enabled, "draft_max": self.config.draft_max,
                "drafters": [d.name for d in self.drafters],
                "step_cost": {"a_seconds": round(self.cost.a, 5), "b_seconds_per_token": round(self.cost.b, 6)}}

    def global_rate(self, drafter: str) -> float:
        stats = self.stats[drafter]
        prior = PRIOR_ACCEPTANCE.get(drafter, 0.5)
        return (stats.accepted + 4 * prior) / (stats.trials + 4)

    def choose(self, candidates: list[tuple[SpecState, int]], n_decoding: int, n_other: int) -> list[tuple[list[int], str]]:
        """Drafts for `candidates` (a state and the most draft tokens its stream, limits and the
        budget allow), for a step that decodes `n_decoding` sequences and carries `n_other` other
        tokens: each draft token is kept while it raises expected tokens per second of step."""
        proposals: list[tuple[list[int], str, float]] = []
        for state, limit in candidates:
            proposals.append(self._propose(state, min(limit, self.config.draft_max)))
        if self.config.mode is not SpecMode.AUTO:
            return [(draft, name) for draft, name, _ in proposals]  # a fixed drafter drafts all it can
        tokens = n_decoding + n_other
        expected = float(n_decoding)
        keep = [0] * len(proposals)
        heap = [(-rate, i) for i, (draft, _, rate) in enumerate(proposals) if draft]
        heapq.heapify(heap)
        while heap:
            neg_gain, i = heapq.heappop(heap)
            gain = -neg_gain
            if gain < MIN_GAIN or gain * self.cost.seconds(tokens) <= expected * self.cost.b:
                break  # (expected + gain) / (seconds + b) would not beat expected / seconds
            keep[i] += 1
            tokens += 1
            expected += gain
            draft, _, rate = proposals[i]
            if keep[i] < len(draft):
                heapq.heappush(heap, (-(gain * rate), i))
        return [(draft[:n], name) for (draft, name, _), n in zip(proposals, keep)]

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

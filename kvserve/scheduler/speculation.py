"""Speculative decoding in the continuous batch: which decoding sequences carry a draft this step,
from which drafter, and how long.

A draft of k tokens rides in the sequence's ordinary slot: the step evaluates its last token and
the k guesses, each with logits, beside everyone else's tokens. `Sampling.verify` then samples row
after row with the request's own sampler chain and stops at the first sampled token that is not the
draft's; that token is the step's correction. So the chain sees exactly the tokens it would have
sampled without speculation (penalties, logit_bias, grammars and seeded RNG draws alike), and a
drafter's guess can change how fast tokens come, never which.

Choosing k (mode `auto`; a fixed drafter, `ngram`, `tree` or `draft`, drafts all it guesses up to
`--draft-max`): llama.cpp splits a step into ubatches that take the same number of tokens from a run
of adjacent streams (`ubatch_sizes`), and a ubatch's cost is a table by its tokens (`UbatchCost`,
timed on the context at start and kept current by the steps it runs): on a CPU it is not a line
(tiles make 4 tokens cost about what 3 do). A draft token that the target accepts with chance `p`
(the j-th with `p ** j`) adds that many expected tokens; the speculator keeps of each draft the
length that gives the step the most expected tokens per second: the best equal length for all
first (equal drafts on adjacent streams share ubatches), then each sequence's best with the others
fixed. No draft token less likely than `MIN_GAIN` is drafted.

Acceptance is measured per drafter and per sequence, on the drafts verified and, for free, on the
proposals not drafted: such a proposal is watched (`SpecState.watch`) and compared with the output
as it comes. So `auto` learns that prose repeats little without paying a step to find out, and
drafts again where a sequence starts to repeat. A sequence drafts n-grams only once its watched
proposals came true for a run of tokens (`WATCH_FIRST`, `WATCH_RIGHT`): another request's text
repeating says little of this one's, and prose repeats a word or two of its prompt.

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
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvserve.cache.kv_pool import common_prefix
from kvserve.llama.batch import ubatch_sizes
from kvserve.scheduler.drafters import Drafter, NgramDrafter, PredictionDrafter, RecentDrafter, Sequence, TreeDrafter
from kvserve.scheduler.ubatch_cost import UbatchCost, attended_keys

if TYPE_CHECKING:
    from kvserve.scheduler.draft_model import DraftModel


class SpecMode(str, enum.Enum):
    OFF = "off"
    AUTO = "auto"  # every drafter, lengths chosen by measured acceptance and step cost
    NGRAM = "ngram"
    TREE = "tree"
    DRAFT = "draft"  # a draft model (`--draft-model`), after a request's prediction


# A drafter's acceptance before any of its drafts was verified (optimistic enough to be tried).
PRIOR_ACCEPTANCE = {"prediction": 0.8, "tree": 0.7, "ngram": 0.5, "recent": 0.5, "draft": 0.6}
# A draft token less likely than this to be accepted is never drafted, whatever the priced cost says:
# a price from noisy steps can make a token look free, and rejected rows are never free.
MIN_GAIN = 0.25
# Draft lengths `auto` weighs (beside each proposal's whole useful length): on a CPU a ubatch of
# 4, 16 or 32 tokens costs about what one of 3, 15 or 31 does.
_LENGTHS = (*range(1, 9), 10, 12, 15, 16, 23, 24, 31, 32, 47, 48, 63, 64)
# A sequence's evidence of a drafter's acceptance fades by this much at each new settlement, so
# that its rate follows where its text starts or stops repeating.
EVIDENCE_DECAY = 0.5
# Drafters that guess from text alone: `auto` drafts their proposals for a sequence only once it has
# watched one of them settle (a prediction is the client's word, a tree draft this very context's).
WATCH_FIRST = frozenset({"ngram", "recent"})
# ... and only while that evidence holds this many right tokens (faded): prose repeats a word or two
# of its prompt, an edit's answer a run of lines.
WATCH_RIGHT = 2.0

@dataclass
class DrafterStats:
    drafted: int = 0
    accepted: int = 0
    drafts: int = 0  # verifications
    # of drafts verified and proposals watched (`Speculator._settle_watch`): the tokens that were
    # right, and those plus the wrong ones that ended them
    right: int = 0
    trials: int = 0


@dataclass
class SpecState:
    """One choice's view for drafters and its measured acceptance per drafter."""

    sequence: Sequence
    # per drafter: the draft tokens that were right and those plus the wrong ones, faded
    evidence: dict[str, tuple[float, float]] = field(default_factory=dict)
    prediction_accepted: int = 0
    prediction_rejected: int = 0
    # a proposal not drafted, compared with the output as it comes: drafter, tokens, where it starts
    watch: tuple[str, list[int], int, int] | None = None  # and how many of its tokens are credited

    def rate(self, drafter: str, global_rate: float) -> float:
        """Each draft token's chance, given the one before: this sequence's evidence, the drafter's
        rate over all sequences counting as one token of it, and a watched proposal's next token as
        wrong until it comes true; 0 for a `WATCH_FIRST` drafter until this sequence's evidence
        of it holds `WATCH_RIGHT` right tokens."""
        right, trials = self.evidence.get(drafter, (0.0, 0.0))
        if drafter in WATCH_FIRST and right < WATCH_RIGHT:
            return 0.0
        if self.watch is not None and self.watch[0] == drafter:
            trials += 1  # the watched proposal's next token: not yet known to come true
        return (right + global_rate) / (trials + 1)


@dataclass(frozen=True)
class SpecConfig:
    mode: SpecMode = SpecMode.OFF
    draft_max: int = 16  # most draft tokens per sequence and step


class Speculator:
    def __init__(self, config: SpecConfig, tree_drafter: TreeDrafter | None, can_cut: bool,
                 draft_model: "DraftModel | None" = None, n_ubatch: int = 512) -> None:
        self.config = config
        self.n_ubatch = n_ubatch  # the target context's: how a step splits (`ubatch_sizes`)
        self.enabled = config.mode is not SpecMode.OFF and can_cut
        if self.enabled and config.mode is SpecMode.DRAFT and draft_model is None:
            raise ValueError("--speculative draft needs --draft-model")
        self.cost = UbatchCost()
        self.stats: dict[str, DrafterStats] = {}
        ngram, prediction = NgramDrafter(), PredictionDrafter()
        self.recent = RecentDrafter()  # fed by `finished`; auto only
        drafters: dict[SpecMode, list[Drafter]] = {
            SpecMode.AUTO: [prediction, *([tree_drafter] if tree_drafter else []), self.recent, ngram],
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
                "ubatch_seconds": {str(n): round(t, 5) for n, t in sorted(self.cost.table.items()) if n <= 64},
                "ubatch_scale": round(self.cost.scale, 3), "seconds_per_key": self.cost.per_key,
                **(model.describe() if model else {})}

    def global_rate(self, drafter: str) -> float:
        stats = self.stats[drafter]
        prior = PRIOR_ACCEPTANCE.get(drafter, 0.5)
        return (stats.right + 4 * prior) / (stats.trials + 4)

    def choose(self, candidates: list[tuple[SpecState, int]], n_other: int) -> list[tuple[list[int], str]]:
        """Drafts for `candidates` (a state and the most draft tokens its stream, limits and the
        budget allow; one per decoding sequence), for a step that also carries `n_other` prompt
        tokens. `auto` keeps of each draft the length that gives the step the most expected tokens
        per second (`_best_lengths`); a proposal it keeps none of is watched instead (`SpecState.watch`)."""
        for state, _ in candidates:
            self._settle_watch(state)
        proposals = [self._propose(state, min(limit, self.config.draft_max)) for state, limit in candidates]
        if self.draft_model is not None:
            self._draft_with_model(candidates, proposals)
        if self.config.mode is not SpecMode.AUTO:
            return [(draft, name) for draft, name, _ in proposals]  # a fixed drafter drafts all it can
        seqs = [state.sequence.seq for state, _ in candidates]
        n_past = [len(state.sequence.tokens) - 1 for state, _ in candidates]  # the last token is decoded now
        keep = self._best_lengths(seqs, n_past, proposals, n_other)
        for (state, _), (draft, name, _), n in zip(candidates, proposals, keep):
            if n:
                state.watch = None
            elif draft and state.watch is None:
                state.watch = (name, draft, len(state.sequence.tokens), 0)
        return [(draft[:n], name) for (draft, name, _), n in zip(proposals, keep)]

    def _best_lengths(self, seqs: list[int], n_past: list[int], proposals: list[tuple[list[int], str, float]],
                      n_other: int) -> list[int]:
        """How much of each proposal to draft: the best equal length for all (equal drafts on
        adjacent streams share ubatches), then each sequence's best length with the others fixed,
        by expected tokens per second of step (`UbatchCost`). A draft token less likely than
        `MIN_GAIN` is never drafted."""
        rates = [rate for _, _, rate in proposals]
        caps = [_useful_length(rate, len(draft)) for draft, _, rate in proposals]
        if not any(caps):
            return caps

        def goodput(drafts: list[int]) -> float:
            return _expected(rates, drafts, len(seqs)) / self._seconds(seqs, n_past, drafts, n_other)

        lengths = sorted({n for cap in caps for n in _LENGTHS if n < cap} | set(caps) | {0})
        keep = max(([min(n, cap) for cap in caps] for n in lengths), key=goodput)
        for i in sorted(range(len(caps)), key=lambda i: -rates[i]):
            if caps[i]:
                trials = [keep[:i] + [n] + keep[i + 1:] for n in lengths if n <= caps[i]]
                keep = max(trials, key=goodput)
        return keep

    def _seconds(self, seqs: list[int], n_past: list[int], drafts: list[int], n_other: int) -> float:
        """What a step costs that decodes `seqs`, each its last token and its draft after `n_past`
        evaluated tokens, and `n_other` prompt tokens (in ubatches of their own; their keys are the
        same whatever the drafts, and left out)."""
        sizes = ubatch_sizes([(seq, 1 + k) for seq, k in zip(seqs, drafts)], self.n_ubatch)
        full, rest = divmod(n_other, self.n_ubatch)
        keys = sum(attended_keys(n, 1 + k) for n, k in zip(n_past, drafts))
        return self.cost.step(sizes + [self.n_ubatch] * full + ([rest] if rest else []), keys)

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
        """A fixed drafter's mode: the first drafter with a guess, in order (a request's prediction
        first). `auto`: of the drafters with a guess, the one whose tokens this sequence finds the
        likeliest; where none is trusted yet (`WATCH_FIRST`), the one it watched least, first in
        order on a tie."""
        found = []
        for drafter in self.drafters if k > 0 else ():
            draft = drafter.propose(state.sequence, k)
            if draft:
                found.append((draft, drafter.name, state.rate(drafter.name, self.global_rate(drafter.name))))
                if self.config.mode is not SpecMode.AUTO:
                    break
        return max(found, key=lambda f: (f[2], -state.evidence.get(f[1], (0.0, 0.0))[1]), default=([], "", 0.0))

    def finished(self, state: SpecState) -> None:
        """A sequence ended (not failed): its answer joins its namespace's recent answers."""
        if self.enabled and self.recent in self.drafters:
            sequence = state.sequence
            self.recent.add(sequence.namespace, sequence.tokens, sequence.prompt_len)

    def record(self, state: SpecState, drafter: str, drafted: int, accepted: int) -> None:
        """A verification of `drafted` tokens from `drafter` kept `accepted` of them."""
        stats = self.stats[drafter]
        stats.drafts += 1
        stats.drafted += drafted
        stats.accepted += accepted
        self._learn(state, drafter, accepted, accepted < drafted)
        if drafter == "prediction":
            state.prediction_accepted += accepted
            state.prediction_rejected += drafted - accepted

    def _settle_watch(self, state: SpecState) -> None:
        """Learn from a proposal that was watched, not drafted, as the output confirms its tokens
        (each is credited once, so drafting can resume while it still agrees) and once the output
        departs from it: what the target would have accepted, measured for free."""
        if state.watch is None:
            return
        drafter, draft, start, credited = state.watch
        since = state.sequence.tokens[start:]
        n = common_prefix(since, draft)
        ended = n < len(since) or n == len(draft)
        if n > credited or ended:
            self._learn(state, drafter, n - credited, ended and n < len(draft), fade=not credited)
        state.watch = None if ended else (drafter, draft, start, n)

    def _learn(self, state: SpecState, drafter: str, right: int, wrong: bool, fade: bool = True) -> None:
        """`right` draft tokens in a row came true, then one did not (`wrong`) or none was left: each
        draft token's chance, given the one before, is right / (right + wrong). The sequence's
        earlier evidence fades first (`fade`), once per draft or watched proposal."""
        stats = self.stats[drafter]
        stats.trials += right + wrong
        stats.right += right
        had_right, had_trials = state.evidence.get(drafter, (0.0, 0.0))
        keep = EVIDENCE_DECAY if fade else 1.0
        state.evidence[drafter] = (keep * had_right + right, keep * had_trials + right + wrong)


def _useful_length(rate: float, n: int) -> int:
    """The longest prefix of a draft of `n` tokens whose every token is at least `MIN_GAIN` likely
    to be accepted (the j-th with chance rate ** j)."""
    if rate <= MIN_GAIN:
        return 0
    if rate >= 1:
        return n
    return min(n, int(math.log(MIN_GAIN) / math.log(rate) + 1e-9))


def _expected(rates: list[float], drafts: list[int], n_decoding: int) -> float:
    """Tokens a step is expected to emit: one per decoding sequence, and each draft token with the
    chance that it and all before it are accepted."""
    return n_decoding + sum(sum(rate ** j for j in range(1, k + 1)) for rate, k in zip(rates, drafts))

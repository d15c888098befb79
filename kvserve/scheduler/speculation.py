"""Speculative decoding in the continuous batch: which decoding sequences carry a draft this step,
from which drafter, and how long.

A draft of k tokens rides in the sequence's ordinary slot: the step evaluates its last token and
the k guesses, each with logits, beside everyone else's tokens. `Sampling.verify` then samples row
after row with the request's own sampler chain and stops at the first sampled token that is not the
draft's; that token is the step's correction. So the chain sees exactly the tokens it would have
sampled without speculation (penalties, logit_bias, grammars and seeded RNG draws alike), and a
drafter's guess can change how fast tokens come, never which, up to llama.cpp's rounding by batch
shape: a row verified in a batch of k + 1 tokens has logits a few hundredths of a nat from the same
row decoded alone, so a near-tie (two tokens 0.035 nat apart, seen once in a black-box comparison
with `off`) may go the other way, as it may between a prompt evaluated in one batch or in chunks.

Choosing k (mode `auto`; a fixed drafter, `ngram`, `tree` or `draft`, drafts all it guesses up to
`--draft-max`): llama.cpp splits a step into ubatches that take the same number of tokens from a run
of adjacent streams (`ubatch_sizes`), and a ubatch's cost is a table by its tokens (`UbatchCost`,
learnt from the steps it runs, a timing while the engine idles after start its prior): on a CPU it
is not a line (tiles make 4 tokens cost about what 3 do). A draft token that the target accepts
with chance `p` (the j-th with `p ** j`) adds that many expected tokens; the speculator keeps of
each draft the length that gives the step the most expected tokens per second: the best equal
length for all first (equal drafts on adjacent streams share ubatches), then each sequence's best
with the others fixed. No draft token less likely than `MIN_GAIN` is drafted. Until the sizes a
step needs are priced (timed while the engine idles, or learnt from served steps:
`UbatchCost.priced`), `auto` drafts nothing that needs them, and nothing at all while the step
without drafts is not priced: the first requests after start may be served without drafts.

Acceptance is measured per drafter and per sequence, on the drafts verified and, for free, on the
proposals not drafted: such a proposal is watched (`SpecState.watch`) and compared with the output
as it comes. So `auto` learns that prose repeats little without paying a step to find out, and
drafts again where a sequence starts to repeat. A sequence drafts n-grams only once its watched
proposals came true for a run of tokens (a drafter's `watch_first`, `WATCH_RIGHT`): another
request's text repeating says little of this one's, and prose repeats a word or two of its prompt.

Whether drafting paid is measured too, per sequence (`Payoff`): the tokens per second of its
drafted steps against its undrafted ones', both timed. Where drafting did not pay over its last
steps, `auto` drafts nothing more for it (its proposals are watched) until the proposals it watches
come true by as many tokens as a draft would have needed; a sequence that drafts every step skips
one draft in `PAYOFF_PROBE` to time a step without. So whatever the cost table says, a sequence
runs below `off` for a few steps at a time, never for long. (A step's seconds are everyone's: a
draft that pays its own sequence may still slow the others more than it gains; that part is the
cost table's to weigh.) Each proposal `auto` drafts none of is counted by why (`Drop`). What
drafting gained is shown as measured, per drafter: a sequence's tokens per second over the steps
that carried its drafts, against those of the steps that carried none (`Throughput`; `describe`).

A draft model (`--draft-model`, `DraftModel`, mode `draft` only) drafts, in one batch, every
sequence that has no `prediction` to draft from, to `--draft-max`. `auto` does not ask it: on 2 CPU
cores a 0.5B drafting for a 1.5B lost wherever it was priced in (its guess decodes and the catch-up
of every prompt; `bench/results/speculative.md`, `kvserve-auto` against `kvserve-auto-nodraft`).

Invariants:
- a draft never runs past the sequence's stream, its `max_tokens` or the longest sequence allowed;
- nothing drafts for a model whose rows cannot be cut (a recurrent state, `KvManager.cuts_rows`);
  a sliding-window model drafts, and each cut asks its stream (`KvManager.commit`);
- the step's tokens stay within the token budget;
- in `auto`, a sequence whose `Payoff` says drafting did not pay, or that times a step without a
  draft, drafts nothing; no step drafts whose ubatch sizes, or those of the step without its
  drafts, are not yet priced (`UbatchCost.priced`);
- the drafters' stats (`stats`) have one entry per drafter, set at start: metrics read them live.
"""

from __future__ import annotations

import enum
import math
import statistics
from collections import deque
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from kvserve.cache.kv_pool import common_prefix
from kvserve.llama.batch import ubatch_sizes
from kvserve.scheduler.drafters import (Drafter, DrafterKind, NgramDrafter, PredictionDrafter, RecentDrafter,
                                        Sequence, TreeDrafter)
from kvserve.scheduler.ubatch_cost import CALIBRATION_SIZES, UbatchCost, attended_keys

if TYPE_CHECKING:
    from kvserve.scheduler.draft_model import DraftModel


class SpecMode(str, enum.Enum):
    OFF = "off"
    AUTO = "auto"  # every drafter, lengths chosen by measured acceptance and step cost
    NGRAM = "ngram"
    TREE = "tree"
    DRAFT = "draft"  # a draft model (`--draft-model`), after a request's prediction


class Drop(str, enum.Enum):
    """Why `auto` drafted none of a proposal (`kvserve_spec_dropped_drafts_total`)."""

    UNLIKELY = "unlikely"  # no token of it likely enough (`MIN_GAIN`), or its drafter not yet watched
    PRICED = "priced"  # the cost table prices the step faster without it
    MEASURED = "measured"  # this sequence's drafted steps were slower, in tokens per second, than its others


# A draft token less likely than this to be accepted is never drafted, whatever the priced cost says:
# a price from noisy steps can make a token look free, and rejected rows are never free.
MIN_GAIN = 0.25
# Draft lengths `auto` weighs (beside each proposal's whole useful length): on a CPU a ubatch of
# 4, 16 or 32 tokens costs about what one of 3, 15 or 31 does.
_LENGTHS = (*range(1, 9), 10, 12, 15, 16, 23, 24, 31, 32, 47, 48, 63, 64)
# A sequence's evidence of a drafter's acceptance fades by this much at each new settlement, so
# that its rate follows where its text starts or stops repeating.
EVIDENCE_DECAY = 0.5
# `auto` drafts a `watch_first` drafter's proposals for a sequence only while its evidence there
# holds this many right tokens (faded): prose repeats a word or two of its prompt, an edit's answer
# a run of lines.
WATCH_RIGHT = 2.0
# The per-sequence check that drafting pays (`Payoff`): the drafted steps it weighs (it decides
# once it has PAYOFF_MIN of them) and the undrafted ones it weighs them against; a sequence that
# drafts every step skips one draft after each PAYOFF_PROBE drafted steps, to time a step without.
PAYOFF_DRAFTED = 8
PAYOFF_PLAIN = 4
PAYOFF_MIN = 3
PAYOFF_PROBE = 32


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
class DrafterStats:
    drafted: int = 0
    accepted: int = 0
    drafts: int = 0  # verifications
    # of drafts verified and proposals watched (`Speculator._settle_watch`): the tokens that were
    # right, and those plus the wrong ones that ended them
    right: int = 0
    trials: int = 0
    # proposals `auto` drafted none of, by why (every reason from the start, at 0)
    dropped: dict[Drop, int] = field(default_factory=lambda: dict.fromkeys(Drop, 0))
    # its verifications in timed steps: the tokens each gave its sequence (the correction among them)
    timed: Throughput = field(default_factory=Throughput)


@dataclass
class Evidence:
    """A sequence's draft tokens from one drafter that were right, and those plus the wrong ones
    that ended them, faded."""

    right: float = 0.0
    trials: float = 0.0

    def add(self, right: int, wrong: bool, fade: bool) -> None:
        keep = EVIDENCE_DECAY if fade else 1.0
        self.right, self.trials = keep * self.right + right, keep * self.trials + right + wrong


@dataclass
class Watch:
    """A proposal not drafted, compared with the output as it comes."""

    drafter: str
    draft: list[int]
    start: int  # where in the sequence's tokens it starts
    credited: int = 0  # its tokens already learnt from


@dataclass(frozen=True)
class Proposal:
    draft: list[int]
    drafter: str
    rate: float  # each token's chance of acceptance, given the one before


NO_PROPOSAL = Proposal([], "", 0.0)


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


@dataclass
class SpecState:
    """One choice's view for drafters, its measured acceptance per drafter, and whether drafting
    paid it."""

    sequence: Sequence
    evidence: dict[str, Evidence] = field(default_factory=dict)  # by drafter
    prediction_accepted: int = 0
    prediction_rejected: int = 0
    watch: Watch | None = None
    payoff: Payoff = field(default_factory=Payoff)

    def rate(self, drafter: DrafterKind, global_rate: float) -> float:
        """Each draft token's chance, given the one before: this sequence's evidence, the drafter's
        rate over all sequences counting as one token of it, and a watched proposal's next token as
        wrong until it comes true; 0 for a `watch_first` drafter until this sequence's evidence
        of it holds `WATCH_RIGHT` right tokens."""
        evidence = self.evidence.get(drafter.name, Evidence())
        if drafter.watch_first and evidence.right < WATCH_RIGHT:
            return 0.0
        watched = self.watch is not None and self.watch.drafter == drafter.name  # its next token: not yet known
        return (evidence.right + global_rate) / (evidence.trials + watched + 1)


# The most draft tokens per sequence and step where `--draft-max` is not given. A fixed drafter drafts
# all it guesses, so its cap is its draft's length. `auto` weighs each draft's length, so its cap only
# bounds a guess it trusts, such as a copy of an earlier answer or of a prediction: a longer one pays
# more (the 1.5B's code edit under a CPU hog, 1 thread, paired with `off`: 1.20-1.39x by start with 64,
# 1.04-1.24x with 16; docs/benchmarks.md).
DRAFT_MAX_AUTO = 64
DRAFT_MAX_FIXED = 16


@dataclass(frozen=True)
class SpecConfig:
    mode: SpecMode
    draft_max: int  # most draft tokens per sequence and step (`of`: the mode's default where not given)

    @classmethod
    def of(cls, mode: SpecMode, draft_max: int | None = None) -> SpecConfig:
        """`--speculative` and `--draft-max` (None: the mode's default)."""
        return cls(mode, draft_max or (DRAFT_MAX_AUTO if mode is SpecMode.AUTO else DRAFT_MAX_FIXED))


class Speculator:
    def __init__(self, config: SpecConfig, tree_drafter: TreeDrafter | None, can_cut: bool,
                 draft_model: "DraftModel | None" = None, n_ubatch: int = 512) -> None:
        self.config = config
        self.n_ubatch = n_ubatch  # the target context's: how a step splits (`ubatch_sizes`)
        self.enabled = config.mode is not SpecMode.OFF and can_cut
        if self.enabled and config.mode is SpecMode.DRAFT and draft_model is None:
            raise ValueError("--speculative draft needs --draft-model")
        # auto's step prices, their start-up table timed while the engine idles (`Scheduler.idle`)
        self.cost = UbatchCost(to_time=CALIBRATION_SIZES if self.enabled and config.mode is SpecMode.AUTO else ())
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
        kinds: list[DrafterKind] = [*self.drafters, *([self.draft_model] if self.draft_model else [])]
        self.by_name = {kind.name: kind for kind in kinds}
        self.stats = {name: DrafterStats() for name in self.by_name}  # keys fixed here: metrics read them live
        self.undrafted = Throughput()  # a decoding sequence's timed steps without a draft: one token each

    def describe(self) -> dict:
        """What /server_info says of speculation: what drafts, and the live step prices it drafts by."""
        model, entries = self.draft_model, self.cost.entries()
        return {"mode": self.config.mode.value, "enabled": self.enabled, "draft_max": self.config.draft_max,
                "drafters": list(self.by_name),
                "ubatch_seconds": {str(n): round(t, 5) for n, (t, _) in entries.items() if n <= 64},
                "ubatch_samples": {str(n): k for n, (_, k) in entries.items() if n <= 64},
                "ubatch_to_time": sorted(self.cost.untimed),
                "seconds_per_key": self.cost.per_key,
                "dropped_drafts": {name: {d.value: k for d, k in s.dropped.items()} for name, s in self.stats.items()},
                "by_drafter": {name: {"drafts": s.drafts, "drafted": s.drafted, "accepted": s.accepted,
                                      "tokens_per_second": _rounded(s.timed.per_second)}
                               for name, s in self.stats.items()},
                "undrafted_tokens_per_second": _rounded(self.undrafted.per_second),
                **(model.describe() if model else {})}

    def global_rate(self, drafter: str) -> float:
        stats = self.stats[drafter]
        return (stats.right + 4 * self.by_name[drafter].prior) / (stats.trials + 4)

    def timed(self, sizes: list[int], seconds: float, keys: int, steps: list[tuple[SpecState, bool]]) -> None:
        """A step of decodes and drafts only, of ubatches of `sizes` attending to `keys` keys, took
        `seconds`: a price for the cost table, and for each decoding sequence (its state, and whether
        it drafted) a step to weigh whether drafting pays it."""
        self.cost.observe(sizes, seconds, keys)
        for state, drafted in steps:
            state.payoff.timed(seconds, drafted)
            if not drafted:
                self.undrafted.add(1, seconds)

    def choose(self, candidates: list[tuple[SpecState, int]], n_other: int) -> list[tuple[list[int], str]]:
        """Drafts for `candidates` (a state and the most draft tokens its stream, limits and the
        budget allow; one per decoding sequence), for a step that also carries `n_other` prompt
        tokens. `auto` keeps of each draft the length that gives the step the most expected tokens
        per second (`_best_lengths`), none where drafting was measured not to pay this sequence
        (`Payoff`); a proposal it keeps none of is watched instead (`SpecState.watch`)."""
        for state, _ in candidates:
            self._settle_watch(state)
        proposals = [self._propose(state, min(limit, self.config.draft_max)) for state, limit in candidates]
        if self.draft_model is not None:
            self._draft_with_model(candidates, proposals)
        if self.config.mode is not SpecMode.AUTO:
            return [(p.draft, p.drafter) for p in proposals]  # a fixed drafter drafts all it can
        held = [not state.payoff.may_draft() for state, _ in candidates]
        weighed = [replace(p, rate=0.0) if hold else p for p, hold in zip(proposals, held)]
        seqs = [state.sequence.seq for state, _ in candidates]
        n_past = [len(state.sequence.tokens) - 1 for state, _ in candidates]  # the last token is decoded now
        keep = self._best_lengths(seqs, n_past, weighed, n_other)
        for (state, _), p, n in zip(candidates, proposals, keep):
            if n:
                state.watch = None
            elif p.draft:
                if state.watch is None:
                    state.watch = Watch(p.drafter, p.draft, len(state.sequence.tokens))
                self._count_drop(state, p)
        return [(p.draft[:n], p.drafter) for p, n in zip(proposals, keep)]

    def _count_drop(self, state: SpecState, p: Proposal) -> None:
        if _useful_length(p.rate, len(p.draft)) == 0:
            reason = Drop.UNLIKELY
        elif state.payoff.needed is not None:
            reason = Drop.MEASURED
        elif state.payoff.probing:
            return  # timing a step without a draft: no judgement of this one
        else:
            reason = Drop.PRICED
        self.stats[p.drafter].dropped[reason] += 1

    def _best_lengths(self, seqs: list[int], n_past: list[int], proposals: list[Proposal], n_other: int) -> list[int]:
        """How much of each proposal to draft: the best equal length for all (equal drafts on
        adjacent streams share ubatches), then each sequence's best length with the others fixed,
        by expected tokens per second of step (`UbatchCost`). A draft token less likely than
        `MIN_GAIN` is never drafted."""
        rates = [p.rate for p in proposals]
        caps = [_useful_length(p.rate, len(p.draft)) for p in proposals]
        if not any(caps) or math.isinf(self._seconds(seqs, n_past, [0] * len(seqs), n_other)):
            return [0] * len(caps)  # nothing likely enough, or no price yet for the step without drafts

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
        same whatever the drafts, and left out). One sequence's step is priced at its bids
        (`UbatchCost.bid`: a size no step priced yet is tried). Several sequences' steps are not:
        there a tried size costs every sequence in the step, and free-form answers at 4 and 16
        users measured 0.92-0.96x `off` with the bid against 1.01-1.30x without (one user: edit
        1.30-1.36x with it, 1.24-1.30x without; regenerate 1.26-1.28x, 1.00-1.07x)."""
        sizes = ubatch_sizes([(seq, 1 + k) for seq, k in zip(seqs, drafts)], self.n_ubatch)
        full, rest = divmod(n_other, self.n_ubatch)
        keys = sum(attended_keys(n, 1 + k) for n, k in zip(n_past, drafts))
        return (self.cost.step(sizes, keys, bid=len(seqs) == 1)
                + self.cost.step([self.n_ubatch] * full + ([rest] if rest else [])))

    def _draft_with_model(self, candidates: list[tuple[SpecState, int]], proposals: list[Proposal]) -> None:
        """The draft model's guesses, in one batch, for the candidates without a proposal (mode
        `draft`, which drafts all it guesses: no acceptance rate is weighed)."""
        model = self.draft_model
        assert model is not None
        wanting = [i for i, (state, limit) in enumerate(candidates)
                   if not proposals[i].draft and min(limit, self.config.draft_max) > 0]
        if not wanting:
            return
        wants = [(candidates[i][0].sequence.seq, candidates[i][0].sequence.tokens,
                  min(candidates[i][1], self.config.draft_max)) for i in wanting]
        for i, draft in zip(wanting, model.draft(wants)):
            proposals[i] = Proposal(draft, model.name, 0.0)

    def _propose(self, state: SpecState, k: int) -> Proposal:
        """A fixed drafter's mode: the first drafter with a guess, in order (a request's prediction
        first). `auto`: of the drafters with a guess, the one whose tokens this sequence finds the
        likeliest; where none is trusted yet (`watch_first`), the one it watched least, first in
        order on a tie."""
        found = []
        for drafter in self.drafters if k > 0 else ():
            draft = drafter.propose(state.sequence, k)
            if draft:
                found.append(Proposal(draft, drafter.name, state.rate(drafter, self.global_rate(drafter.name))))
                if self.config.mode is not SpecMode.AUTO:
                    break
        return max(found, key=lambda p: (p.rate, -state.evidence.get(p.drafter, Evidence()).trials),
                   default=NO_PROPOSAL)

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
        if state.payoff.pending is not None:  # its step was timed
            stats.timed.add(1 + accepted, state.payoff.pending)
        state.payoff.verified(1 + accepted)
        if drafter == PredictionDrafter.name:
            state.prediction_accepted += accepted
            state.prediction_rejected += drafted - accepted

    def _settle_watch(self, state: SpecState) -> None:
        """Learn from a proposal that was watched, not drafted, as the output confirms its tokens
        (each is credited once, so drafting can resume while it still agrees) and once the output
        departs from it: what the target would have accepted, measured for free. While drafting is
        stopped for the sequence (`Payoff`), a proposal settles as soon as it came true by the tokens
        a draft would have needed, and the next is watched from there: watched to its end, a copy of
        the whole answer kept the sequence from drafting to the answer's end."""
        watch = state.watch
        if watch is None:
            return
        since = state.sequence.tokens[watch.start:]
        n = common_prefix(since, watch.draft)
        ended = n < len(since) or n == len(watch.draft)
        if n > watch.credited or ended:
            wrong = ended and n < len(watch.draft)
            self._learn(state, watch.drafter, n - watch.credited, wrong, fade=not watch.credited)
        watch.credited = n
        needed = state.payoff.needed
        if ended or (needed is not None and n >= needed):
            state.watch = None
            state.payoff.settled(n)

    def _learn(self, state: SpecState, drafter: str, right: int, wrong: bool, fade: bool = True) -> None:
        """`right` draft tokens in a row came true, then one did not (`wrong`) or none was left: each
        draft token's chance, given the one before, is right / (right + wrong). The sequence's
        earlier evidence fades first (`fade`), once per draft or watched proposal."""
        stats = self.stats[drafter]
        stats.trials += right + wrong
        stats.right += right
        state.evidence.setdefault(drafter, Evidence()).add(right, wrong, fade)


def _rounded(rate: float | None) -> float | None:
    return None if rate is None else round(rate, 2)


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

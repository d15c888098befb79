"""Drafters and draft lengths, without a model: what each drafter proposes, that `auto` drafts
only where a token's acceptance pays for its share of the step, and that it stops drafting for a
sequence whose drafted steps were measured slower than its others."""

from __future__ import annotations

import math

from kvserve.cache.page_tree import PageTree
from kvserve.llama.batch import ubatch_sizes
from kvserve.scheduler.drafters import END, NgramDrafter, PredictionDrafter, RecentDrafter, Sequence, TreeDrafter
from kvserve.scheduler.speculation import (DRAFT_MAX_AUTO, PAYOFF_MIN, PAYOFF_PROBE, Drop, Evidence, SpecConfig,
                                          SpecMode, SpecState, Speculator, Watch)
from kvserve.scheduler.ubatch_cost import UbatchCost


def test_ngram_proposes_what_followed_the_latest_earlier_occurrence() -> None:
    tokens = [1, 2, 3, 4, 5, 9, 1, 2, 3, 7, 8, 1, 2, 3]
    seq = Sequence(tokens, prompt_len=5)
    assert NgramDrafter().propose(seq, 3) == [7, 8, 1]  # the latest "1 2 3" was followed by 7 8
    tokens += [7]
    assert NgramDrafter().propose(seq, 2) == [8, 1]  # "2 3 7" is indexed incrementally
    assert NgramDrafter().propose(Sequence([5, 6, 7, 8], 2), 4) == []  # no repeat, no guess


def test_ngram_copy_learns_a_renamed_token_and_drafts_it_at_the_next_site() -> None:
    source = [50, 1, 2, 3, 4, 5, 60, 6, 7, 8, 9, 60, 10, 11]  # 60: a name the edit renames to 61
    seq = Sequence([*source, 90, 91, 50, 1, 2], prompt_len=len(source) + 2)
    drafter = NgramDrafter()
    assert drafter.propose(seq, 6) == [3, 4, 5, 60, 6, 7]
    seq.tokens += [3, 4, 5, 61]  # the copy departs at the name: taken for a substitution
    assert drafter.propose(seq, 3) == [6, 7, 8]  # drafting goes on after the renamed token
    seq.tokens += [6]  # the substitution is confirmed
    assert drafter.propose(seq, 6) == [7, 8, 9, 61, 10, 11]  # and drafted at the next site


def test_ngram_copy_is_lost_after_two_departures_and_found_again_by_lookup() -> None:
    seq = Sequence([50, 1, 2, 3, 4, 5, 6, 7, 8, 9, 90, 50, 1, 2, 3, 4], prompt_len=11)
    drafter = NgramDrafter()
    assert drafter.propose(seq, 3) == [5, 6, 7]
    seq.tokens += [70, 71]  # a departure, then one that is no substitution either
    assert drafter.propose(seq, 3) == []
    seq.tokens += [8, 9]  # back on the source: "71 8 9" is unknown, "8 9" is found
    assert drafter.propose(seq, 3) == [90, 50, 1]
    short = Sequence([1, 2, 3, 9, 1, 2], prompt_len=4)
    assert NgramDrafter().propose(short, 2) == [3, 9]
    short.tokens += [7, 9]  # a departure after a run of 2 is not taken for a substitution
    assert NgramDrafter().propose(short, 2) == []


def test_prediction_starts_at_its_head_and_picks_up_after_an_edit() -> None:
    predicted = [10, 11, 12, 13, 14, 15, 16, 17]
    seq = Sequence([1, 2], prompt_len=2, prediction=predicted)
    drafter = PredictionDrafter()
    assert drafter.propose(seq, 3) == [10, 11, 12]
    seq.tokens += [10, 11, 99, 13]  # the output replaced 12 with 99, then went on as predicted
    assert drafter.propose(seq, 3) == [14, 15, 16]
    seq.tokens += [14, 15, 16, 17]
    assert drafter.propose(seq, 3) == []  # the prediction is used up
    fence = Sequence([1, 2], prompt_len=2, prediction=[20, 21, 22, 20])  # its first token comes again
    assert PredictionDrafter().propose(fence, 2) == [20, 21]
    fence.tokens += [20]
    assert PredictionDrafter().propose(fence, 2) == [21, 22]  # followed from its head, not its last 20


def test_tree_proposes_the_stored_continuation_of_this_context() -> None:
    tree = PageTree(page_rows=2)
    node = tree.root("")
    for key in ((1, 2), (3, 4), (5, 6), (7, 8)):
        node = tree.add_child(node, key, chain_id=1)
    first = tree.roots[""].children[(1, 2)]
    other = tree.add_child(first, (3, 9), chain_id=2)
    tree.hit([first, other, tree.add_child(other, (0, 0), 2)])
    drafter = TreeDrafter(tree)
    assert drafter.propose(Sequence([1, 2, 3, 4, 5], 3), 3) == [6, 7, 8]  # inside page (5, 6), then whole pages
    assert drafter.propose(Sequence([1, 2, 3], 3), 3) == [9, 0, 0]  # the most reused way on
    assert drafter.propose(Sequence([1, 2, 5], 3), 3) == []
    assert drafter.propose(Sequence([1, 2, 3, 4, 5], 3, namespace="tenant:x"), 3) == []  # another namespace's text


def _linear(a: float, b: float) -> UbatchCost:
    """A cost of `a` per ubatch (a read of the weights) and `b` per token."""
    return UbatchCost({n: a + b * n for n in (1, 2, 4, 8, 16, 32, 64, 128, 512)})


def test_ubatches_follow_llama_cpps_split_of_a_batch_into_equal_runs() -> None:
    assert ubatch_sizes([(s, 1) for s in range(8)], 512) == [8]
    assert ubatch_sizes([(s, 3) for s in range(8)], 512) == [24]  # equal drafts on adjacent streams
    assert ubatch_sizes([(0, 1), (1, 1), (2, 9), (3, 1)], 512) == [4, 8]  # one draft: a ubatch of its own
    assert ubatch_sizes([(0, 1), (1, 9), (2, 1), (3, 9)], 512) == [4, 8, 8]  # two apart: one each
    assert ubatch_sizes([(0, 1), (1, 9), (2, 9), (3, 1)], 512) == [4, 16]  # two adjacent and equal: one
    assert ubatch_sizes([(0, 1), (2, 1)], 512) == [1, 1]  # a gap in the stream ids
    assert ubatch_sizes([(0, 600), (1, 1)], 512) == [2, 512, 87]


def test_auto_drops_a_draft_that_would_make_a_ubatch_of_its_own() -> None:
    """Where reading the weights dominates a step, one sequence's draft among eight costs a second
    read of every weight: auto drops it; eight sequences' drafts share the one ubatch and are kept,
    as is one sequence's draft when it decodes alone."""
    speculator = _speculator(a=0.1, b=0.001)
    one_of_eight = speculator.choose(_states(8, repeating=range(3, 4)), n_other=0)
    assert one_of_eight[3][0] == [] and all(draft == [] for draft, _ in one_of_eight)
    assert all(len(draft) >= 2 for draft, _ in speculator.choose(_states(8), n_other=0))
    assert len(speculator.choose(_states(1), n_other=0)[0][0]) >= 2


def _speculator(a: float, b: float) -> Speculator:
    speculator = Speculator(SpecConfig(SpecMode.AUTO, draft_max=8), None, can_cut=True)
    speculator.cost = _linear(a, b)
    return speculator


def _states(n: int, repeating: range | None = None) -> list[tuple[SpecState, int]]:
    """`n` decoding sequences (streams 0 .. n-1); those in `repeating` (all by default) repeat their
    text, so n-grams guess for them."""
    states = []
    for seq in range(n):
        tokens = [1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3] if repeating is None or seq in repeating else list(range(10, 21))
        state = SpecState(Sequence(tokens, 3, seq=seq))
        state.evidence["ngram"] = Evidence(8, 10)  # watched: n-grams guessed right here before
        states.append((state, 8))
    return states


def test_auto_drafts_where_weights_dominate_and_not_where_each_token_costs_its_share() -> None:
    cheap = _speculator(a=0.05, b=0.0005).choose(_states(1), n_other=0)
    assert len(cheap[0][0]) >= 2 and cheap[0][1] == "ngram"
    linear = _speculator(a=0.0005, b=0.01).choose(_states(8), n_other=0)
    assert all(draft == [] for draft, _ in linear)  # a step costs per token: no guess pays


def test_draft_max_defaults_by_mode_and_a_given_one_holds_for_all() -> None:
    """`auto` weighs each draft's length, so its cap is long; a fixed drafter's cap is its draft."""
    assert SpecConfig.of(SpecMode.AUTO, None).draft_max == DRAFT_MAX_AUTO == 64
    assert {SpecConfig.of(mode, None).draft_max for mode in (SpecMode.NGRAM, SpecMode.TREE, SpecMode.DRAFT)} == {16}
    assert SpecConfig.of(SpecMode.AUTO, 8).draft_max == SpecConfig.of(SpecMode.NGRAM, 8).draft_max == 8


def test_a_fixed_drafter_drafts_all_it_guesses() -> None:
    speculator = Speculator(SpecConfig(SpecMode.NGRAM, draft_max=3), None, can_cut=True)
    speculator.cost = _linear(a=0.0005, b=0.01)
    assert speculator.choose(_states(1), n_other=0)[0] == ([4, 5, 6], "ngram")


def test_nothing_drafts_where_rows_cannot_be_cut() -> None:
    speculator = Speculator(SpecConfig.of(SpecMode.AUTO), None, can_cut=False)
    assert not speculator.enabled and speculator.drafters == []


def test_auto_never_drafts_unlikely_tokens_even_where_tokens_seem_free() -> None:
    speculator = _speculator(a=0.05, b=0.0)
    state, limit = _states(1)[0]
    state.evidence["ngram"] = Evidence(20, 100)
    assert speculator.choose([(state, limit)], n_other=0)[0][0] == []
    state.evidence["ngram"] = Evidence(90, 100)
    assert len(speculator.choose([(state, limit)], n_other=0)[0][0]) >= 8 - 1


class _FakeDraftModel:
    """A draft model whose decodes cost `a + b * sequences` and whose guesses are always 1s."""

    name = "draft"

    def __init__(self, a: float, b: float) -> None:
        self.cost = _linear(a, b)
        self.calls: list[list[tuple[int, int]]] = []

    def draft(self, wants: list[tuple[int, list[int], int]]) -> list[list[int]]:
        self.calls.append([(seq, k) for seq, _, k in wants])
        return [[1] * k for _, _, k in wants]

    def describe(self) -> dict:
        return {}


def _with_model(model: _FakeDraftModel, mode: SpecMode = SpecMode.AUTO) -> Speculator:
    speculator = Speculator(SpecConfig(mode, draft_max=4), None, can_cut=True, draft_model=model)  # type: ignore[arg-type]
    speculator.cost = _linear(a=0.04, b=0.01)  # a 1.5B target on a CPU: every token costs its share
    return speculator


def _unguessable(n: int) -> list[tuple[SpecState, int]]:
    return [(SpecState(Sequence([10 + i, 20 + i, 30 + i], 1, seq=i)), 8) for i in range(n)]


def test_draft_mode_drafts_every_sequence_in_one_call() -> None:
    model = _FakeDraftModel(a=0.05, b=0.01)  # a loss, but `draft` always drafts
    drafts = _with_model(model, SpecMode.DRAFT).choose(_unguessable(3), n_other=0)
    assert drafts == [([1, 1, 1, 1], "draft")] * 3 and model.calls == [[(0, 4), (1, 4), (2, 4)]]


def test_auto_does_not_ask_a_draft_model() -> None:
    """Measured on 2 cores (0.5B for a 1.5B), auto with the draft model lost to auto without it on
    every workload, so only `draft` asks it; auto's own drafters still guess."""
    model = _FakeDraftModel(a=0.001, b=0.0001)
    speculator = _with_model(model)
    speculator.cost = _linear(a=0.05, b=0.0005)
    assert speculator.draft_model is None and "draft" not in speculator.describe()["drafters"]
    assert speculator.choose(_unguessable(2), n_other=0) == [([], "")] * 2 and model.calls == []


# a 1.5B's ubatches on 2 cores (ms by tokens): a tile of 4 costs what 3 do, 16 less than 14
_TILED = {1: 64, 2: 100, 3: 124, 4: 131, 5: 162, 8: 260, 12: 318, 14: 347, 15: 330, 16: 313, 17: 399, 32: 580}


def _tiled(rate: float, draft_max: int = 16) -> list[int]:
    speculator = Speculator(SpecConfig(SpecMode.AUTO, draft_max=draft_max), None, can_cut=True)
    speculator.cost = UbatchCost({n: ms / 1000 for n, ms in _TILED.items()})
    state = SpecState(Sequence(list(range(40)), 40, prediction=list(range(40, 80))))
    state.evidence["prediction"] = Evidence(1000 * rate, 1000)
    return [len(draft) for draft, _ in speculator.choose([(state, 30)], n_other=0)]


def test_auto_drafts_the_length_whose_ubatch_pays_best() -> None:
    """One sequence on the tiled table: a likely draft fills a ubatch of 16, a fair one stops at a
    tile of 4, and one that is as likely wrong as right is not worth a second token's 56% more."""
    assert _tiled(0.98) == [15]
    assert _tiled(0.98, draft_max=4) == [4]
    assert _tiled(0.9) == [3] and _tiled(0.8) == [3]
    assert _tiled(0.5) == [0]


def test_a_proposal_not_drafted_is_watched_and_teaches_acceptance_for_free() -> None:
    """Prose: n-grams guess, but auto does not draft at even odds on a step that costs per token;
    the output then shows, token by token, whether the guess was right, and no step paid for it."""
    speculator = _speculator(a=0.0005, b=0.01)
    tokens = [1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3]
    state = SpecState(Sequence(tokens, 3, seq=0))
    assert speculator.choose([(state, 8)], n_other=0)[0][0] == []
    assert state.watch == Watch("ngram", [4, 5, 6, 7, 8, 1, 2, 3], 11, 0)
    assert state.rate(NgramDrafter(), 0.9) == 0  # nothing watched yet: an n-gram is not drafted
    tokens += [4, 5]
    speculator.choose([(state, 8)], n_other=0)
    assert state.evidence["ngram"] == Evidence(2, 2) and state.watch.credited == 2  # credited as they come
    assert state.rate(NgramDrafter(), 0.9) == (2 + 0.9) / (2 + 1 + 1)  # the next one counted wrong until it comes
    tokens += [9]
    speculator.choose([(state, 8)], n_other=0)
    stats = speculator.stats["ngram"]
    assert (stats.right, stats.trials, stats.drafted, stats.accepted) == (2, 3, 0, 0)
    assert state.evidence["ngram"] == Evidence(2, 3)
    for _ in range(10):  # the guesses keep coming true: the rate climbs until drafting pays
        state.watch = Watch("ngram", [1, 2], len(tokens))
        tokens += [1, 2]
        speculator._settle_watch(state)
    assert state.rate(NgramDrafter(), speculator.global_rate("ngram")) > 0.95


def test_auto_drafts_an_ngram_only_after_watching_one_settle() -> None:
    """Where drafts are cheap and n-grams were right for other sequences, a new sequence's n-grams
    are still watched first: its own text may not repeat."""
    speculator = _speculator(a=0.05, b=0.0005)
    speculator.stats["ngram"].right, speculator.stats["ngram"].trials = 95, 100
    tokens = [1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3]
    state = SpecState(Sequence(tokens, 3, seq=0))
    assert speculator.choose([(state, 8)], n_other=0)[0][0] == []
    tokens += [4, 5, 6, 7, 8, 1, 2, 3]  # the whole watched proposal came true
    assert len(speculator.choose([(state, 8)], n_other=0)[0][0]) >= 4


def test_auto_does_not_draft_ngrams_of_prose_that_repeats_a_word_at_a_time() -> None:
    """Prose repeats a word or two of its prompt: watched n-grams that come true one token at a time
    never reach `WATCH_RIGHT`, however well n-grams did for other sequences."""
    speculator = _speculator(a=0.05, b=0.0005)
    speculator.stats["ngram"].right, speculator.stats["ngram"].trials = 95, 100
    tokens = [1, 2, 3, 4, 5, 6, 7, 8, 1, 2]
    state = SpecState(Sequence(tokens, 3, seq=0))
    for word in range(20, 30):
        assert speculator.choose([(state, 8)], n_other=0)[0][0] == []
        tokens += [3, word, 1, 2]  # "1 2" -> 3 comes true, then the text goes its own way
    assert 0 < state.evidence["ngram"].right < 2


def test_recent_drafts_an_earlier_answer_of_the_same_namespace_only() -> None:
    recent = RecentDrafter(min_n=3, max_n=4)
    question = [100, 101, 102, 103, 104]
    answer = [7, 8, 9, 10, 11, 12]
    recent.add("tenant-a", [1, 2, *question, *answer], prompt_len=7)
    asked_again = [5, 6, *question]  # the same question after another context
    assert recent.propose(Sequence(list(asked_again), 7, namespace="tenant-a"), 4) == [7, 8, 9, 10]
    assert recent.propose(Sequence(list(asked_again), 7, namespace="tenant-b"), 4) == []  # never another's
    seq = Sequence([*asked_again, 7, 8, 9], 7, namespace="tenant-a")
    assert recent.propose(seq, 8) == [10, 11, 12]  # followed as a copy, and never past the answer's end
    assert END not in recent.pools["tenant-a"].tokens[:-1] and recent.pools["tenant-a"].tokens[-1] == END


def test_recent_keeps_its_pools_within_their_bounds() -> None:
    recent = RecentDrafter(min_n=3, max_n=4, max_tokens=64, max_namespaces=2)
    for i in range(40):
        recent.add("a", [0, 1, 2, 3, *range(1000 + 10 * i, 1000 + 10 * i + 9)], prompt_len=4)
    pool = recent.pools["a"]
    assert len(pool.tokens) <= 64 and pool.tokens[-1] == END and len(pool.index.after) <= 2 * 64
    later = Sequence([9, 0, 1, 2, 3], 5, namespace="a")
    assert recent.propose(later, 3) == [1390, 1391, 1392]  # the newest answer after the same lead-in
    for namespace in ("b", "c"):
        recent.add(namespace, [0, 1, 2, 3, 4, 5], prompt_len=4)
    assert list(recent.pools) == ["b", "c"]  # the least recently fed pool went first


def test_auto_asks_every_drafter_and_drafts_the_likeliest() -> None:
    speculator = _speculator(a=0.05, b=0.0005)
    speculator.finished(SpecState(Sequence([40, 41, 1, 2, 3, 50, 51, 52, 53], 5)))
    state, limit = _states(1)[0]  # its own text repeats: ngram guesses 4 5 6 ..., recent 50 51 ...
    state.evidence["recent"] = Evidence(0.0, 4.0)  # recent's guesses were wrong here
    assert speculator.choose([(state, limit)], n_other=0)[0][1] == "ngram"
    state.evidence["recent"], state.evidence["ngram"] = Evidence(8.0, 8.0), Evidence(1.0, 4.0)
    assert speculator.choose([(state, limit)], n_other=0)[0] == ([50, 51, 52, 53], "recent")
    fresh, _ = _states(1)[0]
    fresh.evidence.clear()  # nothing trusted yet: the least watched is watched, not drafted
    fresh.evidence["ngram"] = Evidence(0.0, 2.0)
    assert speculator.choose([(fresh, limit)], n_other=0)[0] == ([], "recent")
    assert fresh.watch is not None and fresh.watch.drafter == "recent"


# -- whether drafting pays, measured per sequence ------------------------------------------------------

class _Wrong(PredictionDrafter):
    """A prediction the output never follows: four guesses at every step."""

    def propose(self, sequence: Sequence, k: int) -> list[int]:
        return [0] * min(k, 4)


class _Unlearnt(UbatchCost):
    """A table that says a draft token costs a step almost nothing, and never learns otherwise."""

    def observe(self, sizes: list[int], seconds: float, keys: int = 0) -> None:
        pass


def _measured(follows: bool = False) -> tuple[Speculator, SpecState]:
    """`auto` drafting `_Wrong`'s guesses for one sequence, its drafter right for other sequences,
    on a table that prices a draft token at 1% of a step."""
    speculator = Speculator(SpecConfig(SpecMode.AUTO, draft_max=8), None, can_cut=True)
    speculator.cost = _Unlearnt({n: 0.05 + 0.0005 * n for n in (1, 2, 4, 8, 16)})
    speculator.drafters = [_Wrong()]
    speculator.stats["prediction"].right, speculator.stats["prediction"].trials = 990, 1000
    return speculator, SpecState(Sequence(list(range(10, 20)), 10, seq=0))


def _run_step(speculator: Speculator, state: SpecState, right: bool = False, limit: int = 8) -> int:
    """One step as the scheduler runs it, whose draft tokens cost 40% of a step each, measured: the
    draft's length. The output takes the guess (`right`) or another token."""
    (draft, drafter), = speculator.choose([(state, limit)], n_other=0)
    speculator.timed([1 + len(draft)], 0.05 + 0.02 * len(draft), 0, [(state, bool(draft))])
    accepted = len(draft) if right else 0
    if draft:
        speculator.record(state, drafter, len(draft), accepted)
    state.sequence.tokens += [0] * accepted + [0 if right else 1]
    return len(draft)


def test_a_sequence_whose_drafts_do_not_pay_stops_drafting() -> None:
    """Whatever the table says: drafts always rejected, each costing its step 40%, the sequence's
    drafted steps give fewer tokens per second than its undrafted ones (some timed on purpose), and
    it stops drafting within a few steps, for good while its watched guesses keep failing."""
    speculator, state = _measured()
    drafts = [_run_step(speculator, state) for _ in range(60)]
    stopped = next((i for i in range(len(drafts)) if not any(drafts[i:])), None)  # no draft from here on
    assert stopped is not None and 0 < stopped <= 10, drafts
    assert state.payoff.needed is not None and state.payoff.needed > 0
    dropped = speculator.stats["prediction"].dropped
    assert dropped[Drop.MEASURED] >= 40 and speculator.describe()["dropped_drafts"]["prediction"]["measured"] >= 40


def test_what_a_drafter_gained_is_measured_on_timed_steps_against_undrafted_ones() -> None:
    """/server_info's `by_drafter` rate is a sequence's tokens over the seconds of the timed steps
    that carried the drafter's drafts (a step with prompt chunks is not timed, and counts in neither
    rate); `undrafted_tokens_per_second` is one token per timed step without a draft."""
    speculator, state = _measured()
    for _ in range(2):
        speculator.timed([1], 0.1, 0, [(state, False)])
    speculator.timed([5], 0.2, 0, [(state, True)])
    speculator.record(state, "prediction", 4, 3)  # 1 + 3 tokens in 0.2 s
    speculator.record(state, "prediction", 4, 4)  # verified in a step that was not timed
    info = speculator.describe()
    assert info["undrafted_tokens_per_second"] == 10.0
    assert info["by_drafter"]["prediction"] == {"drafts": 2, "drafted": 8, "accepted": 7, "tokens_per_second": 20.0}


def test_a_stopped_sequence_drafts_again_once_its_watched_guesses_come_true() -> None:
    speculator, state = _measured()
    for _ in range(20):
        _run_step(speculator, state)
    assert state.payoff.needed is not None
    drafts = [_run_step(speculator, state, right=True) for _ in range(20)]
    assert sum(drafts[:10]) > 0 and sum(drafts[-5:]) >= 5 * 4, drafts  # it drafts, and its drafts pay
    assert state.payoff.needed is None


class _LongCopy(PredictionDrafter):
    """A copy of a long answer from where the output is: as many guesses as allowed."""

    def propose(self, sequence: Sequence, k: int) -> list[int]:
        return [0] * k


def test_a_stopped_sequence_drafts_again_while_a_long_watched_copy_still_comes_true() -> None:
    """Stopped, then the output follows a 60-token guess: the guess counts as soon as it came true
    by the tokens a draft would have needed, not at its end (the rest of the answer, undrafted)."""
    speculator, state = _measured()
    speculator.config = SpecConfig(SpecMode.AUTO, draft_max=64)
    for _ in range(20):
        _run_step(speculator, state)
    needed = state.payoff.needed
    assert needed is not None
    speculator.drafters = [_LongCopy()]
    drafts = [_run_step(speculator, state, right=True, limit=60) for _ in range(20)]
    first = next((i for i, n in enumerate(drafts) if n), None)  # the old rule: None, drafts all 0
    assert first is not None and first <= PAYOFF_MIN * math.ceil(needed) + 1, drafts
    assert state.payoff.needed is None


def test_a_sequence_that_drafts_every_step_times_a_step_without_now_and_then() -> None:
    """Drafts always right from its first step: it times a few steps without a draft to compare
    with, then one in `PAYOFF_PROBE`; drafting pays, so it goes on."""
    speculator, state = _measured()
    drafts = [_run_step(speculator, state, right=True) for _ in range(100)]
    plain = [i for i, n in enumerate(drafts) if n == 0]
    assert PAYOFF_MIN <= len(plain) <= PAYOFF_MIN + 100 // PAYOFF_PROBE, drafts
    assert sum(speculator.stats["prediction"].dropped.values()) == 0  # timing a step is no judgement

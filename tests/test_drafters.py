"""Drafters and draft lengths, without a model: what each drafter proposes, and that `auto` drafts
only where a token's acceptance pays for its share of the step."""

from __future__ import annotations

from kvserve.cache.page_tree import PageTree
from kvserve.llama.batch import ubatch_sizes
from kvserve.scheduler.drafters import NgramDrafter, PredictionDrafter, Sequence, TreeDrafter
from kvserve.scheduler.speculation import SpecConfig, SpecMode, SpecState, Speculator, StepCost


def test_ngram_proposes_what_followed_the_latest_earlier_occurrence() -> None:
    tokens = [1, 2, 3, 4, 5, 9, 1, 2, 3, 7, 8, 1, 2, 3]
    seq = Sequence(tokens, prompt_len=5)
    assert NgramDrafter().propose(seq, 3) == [7, 8, 1]  # the latest "1 2 3" was followed by 7 8
    tokens += [7]
    assert NgramDrafter().propose(seq, 2) == [8, 1]  # "2 3 7" is indexed incrementally
    assert NgramDrafter().propose(Sequence([5, 6, 7, 8], 2), 4) == []  # no repeat, no guess


def test_prediction_starts_at_its_head_and_picks_up_after_an_edit() -> None:
    predicted = [10, 11, 12, 13, 14, 15, 16, 17]
    seq = Sequence([1, 2], prompt_len=2, prediction=predicted)
    drafter = PredictionDrafter()
    assert drafter.propose(seq, 3) == [10, 11, 12]
    seq.tokens += [10, 11, 99, 13]  # the output replaced 12 with 99, then went on as predicted
    assert drafter.propose(seq, 3) == [14, 15, 16]
    seq.tokens += [14, 15, 16, 17]
    assert drafter.propose(seq, 3) == []  # the prediction is used up


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


def test_step_cost_fits_a_line() -> None:
    cost = StepCost(a=0.1, b=0.1)
    for _ in range(200):
        for n in (1, 9, 17):
            cost.observe(n, 0.02 + 0.003 * n)
    assert abs(cost.a - 0.02) < 1e-3 and abs(cost.b - 0.003) < 1e-4


def test_step_cost_fits_a_read_of_the_weights_per_ubatch_and_a_share_per_token() -> None:
    cost = StepCost(a=0.1, b=0.1)
    for _ in range(200):
        for n, ubatches in ((1, 1), (9, 1), (9, 2), (17, 3), (17, 1)):
            cost.observe(n, 0.05 * ubatches + 0.003 * n, ubatches)
    assert abs(cost.a - 0.05) < 1e-3 and abs(cost.b - 0.003) < 1e-4
    assert abs(cost.seconds(9, 2) - (0.1 + 0.027)) < 1e-3


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
    one_of_eight = speculator.choose(_states(8, repeating=range(3, 4)), n_decoding=8, n_other=0)
    assert one_of_eight[3][0] == [] and all(draft == [] for draft, _ in one_of_eight)
    assert all(len(draft) >= 2 for draft, _ in speculator.choose(_states(8), n_decoding=8, n_other=0))
    assert len(speculator.choose(_states(1), n_decoding=1, n_other=0)[0][0]) >= 2


def _speculator(a: float, b: float) -> Speculator:
    speculator = Speculator(SpecConfig(SpecMode.AUTO, draft_max=8), None, can_cut=True)
    speculator.cost = StepCost(a, b)
    return speculator


def _states(n: int, repeating: range | None = None) -> list[tuple[SpecState, int]]:
    """`n` decoding sequences (streams 0 .. n-1); those in `repeating` (all by default) repeat their
    text, so n-grams guess for them."""
    states = []
    for seq in range(n):
        tokens = [1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3] if repeating is None or seq in repeating else list(range(10, 21))
        states.append((SpecState(Sequence(tokens, 3, seq=seq)), 8))
    return states


def test_auto_drafts_where_weights_dominate_and_not_where_each_token_costs_its_share() -> None:
    cheap = _speculator(a=0.05, b=0.0005).choose(_states(1), n_decoding=1, n_other=0)
    assert len(cheap[0][0]) >= 2 and cheap[0][1] == "ngram"
    linear = _speculator(a=0.0005, b=0.01).choose(_states(8), n_decoding=8, n_other=0)
    assert all(draft == [] for draft, _ in linear)  # a step costs per token: no guess pays


def test_a_fixed_drafter_drafts_all_it_guesses() -> None:
    speculator = Speculator(SpecConfig(SpecMode.NGRAM, draft_max=3), None, can_cut=True)
    speculator.cost = StepCost(a=0.0005, b=0.01)
    assert speculator.choose(_states(1), n_decoding=1, n_other=0)[0] == ([4, 5, 6], "ngram")


def test_nothing_drafts_where_rows_cannot_be_cut() -> None:
    speculator = Speculator(SpecConfig(SpecMode.AUTO), None, can_cut=False)
    assert not speculator.enabled and speculator.drafters == []


def test_auto_never_drafts_unlikely_tokens_even_where_tokens_seem_free() -> None:
    speculator = _speculator(a=0.05, b=0.0)
    state, limit = _states(1)[0]
    state.acceptance["ngram"] = 0.2
    assert speculator.choose([(state, limit)], n_decoding=1, n_other=0)[0][0] == []
    state.acceptance["ngram"] = 0.9
    assert len(speculator.choose([(state, limit)], n_decoding=1, n_other=0)[0][0]) >= 8 - 1


class _FakeDraftModel:
    """A draft model whose decodes cost `a + b * sequences` and whose guesses are always 1s."""

    name = "draft"

    def __init__(self, a: float, b: float) -> None:
        self.cost = StepCost(a, b)
        self.calls: list[list[tuple[int, int]]] = []

    def draft(self, wants: list[tuple[int, list[int], int]]) -> list[list[int]]:
        self.calls.append([(seq, k) for seq, _, k in wants])
        return [[1] * k for _, _, k in wants]

    def describe(self) -> dict:
        return {}


def _with_model(model: _FakeDraftModel, mode: SpecMode = SpecMode.AUTO) -> Speculator:
    speculator = Speculator(SpecConfig(mode, draft_max=4), None, can_cut=True, draft_model=model)  # type: ignore[arg-type]
    speculator.cost = StepCost(a=0.04, b=0.01)  # a 1.5B target on a CPU: every token costs its share
    return speculator


def _unguessable(n: int) -> list[tuple[SpecState, int]]:
    return [(SpecState(Sequence([10 + i, 20 + i, 30 + i], 1, seq=i)), 8) for i in range(n)]


def test_draft_mode_drafts_every_sequence_in_one_call() -> None:
    model = _FakeDraftModel(a=0.05, b=0.01)  # a loss, but `draft` always drafts
    drafts = _with_model(model, SpecMode.DRAFT).choose(_unguessable(3), n_decoding=3, n_other=0)
    assert drafts == [([1, 1, 1, 1], "draft")] * 3 and model.calls == [[(0, 4), (1, 4), (2, 4)]]


def test_auto_does_not_ask_a_draft_model() -> None:
    """Measured on 2 cores (0.5B for a 1.5B), auto with the draft model lost to auto without it on
    every workload, so only `draft` asks it; auto's own drafters still guess."""
    model = _FakeDraftModel(a=0.001, b=0.0001)
    speculator = _with_model(model)
    speculator.cost = StepCost(a=0.05, b=0.0005)
    assert speculator.draft_model is None and "draft" not in speculator.describe()["drafters"]
    assert speculator.choose(_unguessable(2), n_decoding=2, n_other=0) == [([], "")] * 2 and model.calls == []

"""Drafters and draft lengths, without a model: what each drafter proposes, and that `auto` drafts
only where a token's acceptance pays for its share of the step."""

from __future__ import annotations

from kvserve.cache.page_tree import PageTree
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


def _speculator(a: float, b: float) -> Speculator:
    speculator = Speculator(SpecConfig(SpecMode.AUTO, draft_max=8), None, can_cut=True)
    speculator.cost = StepCost(a, b)
    return speculator


def _states(n: int) -> list[tuple[SpecState, int]]:
    return [(SpecState(Sequence([1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3], 3)), 8) for _ in range(n)]


def test_auto_drafts_where_weights_dominate_and_not_where_each_token_costs_its_share() -> None:
    cheap = _speculator(a=0.05, b=0.0005).choose(_states(1), n_decoding=1, n_other=0)
    assert len(cheap[0][0]) >= 3 and cheap[0][1] == "ngram"
    linear = _speculator(a=0.0005, b=0.01).choose(_states(8), n_decoding=8, n_other=0)
    assert all(draft == [] for draft, _ in linear)  # a step costs per token: no guess pays


def test_a_fixed_drafter_drafts_all_it_guesses() -> None:
    speculator = Speculator(SpecConfig(SpecMode.NGRAM, draft_max=3), None, can_cut=True)
    speculator.cost = StepCost(a=0.0005, b=0.01)
    assert speculator.choose(_states(1), n_decoding=1, n_other=0)[0] == ([4, 5, 6], "ngram")


def test_nothing_drafts_where_rows_cannot_be_cut() -> None:
    speculator = Speculator(SpecConfig(SpecMode.AUTO), None, can_cut=False)
    assert not speculator.enabled and speculator.drafters == []

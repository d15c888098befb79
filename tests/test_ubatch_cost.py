"""The step cost model, without a model: prices by ubatch size learnt from the steps the engine
runs, the table timed at start only their prior, robust to a slow step and to a poisoned start."""

from __future__ import annotations

from kvserve.scheduler.ubatch_cost import LEARNT, WINDOW, UbatchCost

# A 1.5B's ubatches on 2 cores (seconds by tokens), and what each key its tokens read costs.
HONEST = {1: 0.064, 2: 0.100, 3: 0.124, 4: 0.131, 8: 0.260, 12: 0.318, 16: 0.313, 32: 0.580}
PER_KEY = 1e-6


def honest(sizes: list[int], keys: int) -> float:
    return sum(HONEST[n] for n in sizes) + PER_KEY * keys


def serve(cost: UbatchCost, steps: list[tuple[list[int], int]], rounds: int) -> None:
    for _ in range(rounds):
        for sizes, keys in steps:
            cost.observe(sizes, honest(sizes, keys), keys)


def close(a: float, b: float, within: float = 0.05) -> bool:
    return abs(a - b) <= within * b


def test_ubatch_cost_interpolates_and_extends_the_timed_sizes() -> None:
    cost = UbatchCost({1: 0.06, 4: 0.12, 8: 0.24, 16: 0.30})
    assert abs(cost.ubatch(2) - 0.08) < 1e-9 and abs(cost.ubatch(12) - 0.27) < 1e-9
    assert abs(cost.ubatch(20) - (0.30 + 4 * 0.06 / 8)) < 1e-9  # the last two sizes' slope
    assert abs(cost.step([4, 16]) - 0.42) < 1e-9 and cost.per_key == 0


def test_a_poisoned_start_is_overruled_by_honest_steps() -> None:
    """One size timed 10x too slow at start (a busy first minute), then honest steps: within a few
    steps of that size its price is honest, and no other size's price moved for it."""
    cost = UbatchCost({**HONEST, 12: 10 * HONEST[12]})
    steps = [([1], 300), ([4], 1200), ([12], 3000), ([16], 4000)]
    serve(cost, steps, rounds=LEARNT)
    assert close(cost.ubatch(12), HONEST[12]), cost.entries()
    for n in (1, 4, 16, 2, 3, 8, 32):  # learnt, or priced at their start-up timing
        assert close(cost.ubatch(n), HONEST[n]), (n, cost.entries())
    assert cost.entries()[12] == (cost.ubatch(12), LEARNT)


def test_a_start_timed_on_a_busy_machine_is_repriced_everywhere() -> None:
    """Every size timed 3x too slow: the learnt sizes' prices are honest, and a size never seen since
    start is priced at its timing times what the learnt sizes measured against theirs."""
    cost = UbatchCost({n: 3 * t for n, t in HONEST.items()})
    serve(cost, [([1], 300), ([4], 1200), ([16], 4000), ([8], 2000)], rounds=2 * LEARNT)
    for n in HONEST:
        assert close(cost.ubatch(n), HONEST[n], within=0.1), (n, cost.entries())
    assert close(cost.step([2, 32], 5000), honest([2, 32], 5000), within=0.1)


def test_one_slow_step_moves_no_price() -> None:
    cost = UbatchCost(HONEST)
    serve(cost, [([4], 1000)], rounds=WINDOW)
    learnt = cost.ubatch(4)
    cost.observe([4], 10 * honest([4], 1000), 1000)  # the machine stalled for one step
    assert cost.ubatch(4) == learnt


def test_a_size_is_not_priced_from_one_sample_of_its_own() -> None:
    cost = UbatchCost(HONEST)
    for _ in range(LEARNT - 1):
        cost.observe([3], 10 * HONEST[3])
    assert cost.ubatch(3) == HONEST[3] and cost.entries()[3] == (HONEST[3], LEARNT - 1)


def test_a_step_of_several_sizes_teaches_the_one_not_learnt() -> None:
    """A drafting sequence beside plain ones: [8, 16] once 8 is learnt is a sample of 16 (what 8's
    price leaves); [2, 3] with neither learnt teaches neither."""
    cost = UbatchCost({**HONEST, 16: 5 * HONEST[16]})
    serve(cost, [([8], 0)], rounds=LEARNT)
    serve(cost, [([8, 16], 0)], rounds=LEARNT)
    assert close(cost.ubatch(16), HONEST[16])
    serve(cost, [([2, 3], 0)], rounds=WINDOW)
    assert 2 not in cost.samples and 3 not in cost.samples


def test_the_price_of_attention_is_learnt_beside_the_sizes() -> None:
    """Timed in an empty stream, the table misses what each token's attention to its context costs:
    the steps teach a price per key read, and each size's price is what is left."""
    cost = UbatchCost(HONEST)
    steps = [([1], 100), ([1], 20000), ([8], 8000), ([8], 40000), ([4, 16], 3000), ([16], 20000), ([16], 60000)]
    serve(cost, steps, rounds=100)
    assert close(cost.per_key, PER_KEY, within=0.05) and close(cost.scale, 1, within=0.05)
    for n in (1, 4, 8, 16):
        assert close(cost.ubatch(n), HONEST[n]), (n, cost.entries())
    assert close(cost.step([8], 8000), honest([8], 8000), within=0.02)

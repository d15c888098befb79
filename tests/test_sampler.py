"""A chain that is greedy alone reads its token straight from the logits row, and one that is a
temperature alone draws from the whole row at once: each must pick as llama.cpp's own stages pick
(greedy: the same token, ties included; a draw: the same distribution, seeded, one draw a token)."""

from __future__ import annotations

import contextlib
from collections import Counter
from pathlib import Path
from typing import Iterator

import llama_cpp
import numpy as np
import pytest

from kvserve.llama.batch import Batch
from kvserve.llama.context import Context, ContextParams
from kvserve.llama.model import Model
from kvserve.llama.sampler import Sampler, SamplingParams, _draw
from test_speculation_distribution import chi_square_p

GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def decoded(smollm2: Path) -> Iterator[Context]:
    """A context whose batch entries 0..7 hold the logits of eight positions of a prompt."""
    model = Model(smollm2)
    ctx = Context(model, ContextParams(n_ctx_seq=256, n_batch=64, n_seq_max=1, n_threads=2))
    batch = Batch(64)
    for pos, token in enumerate(model.tokenize("The quick brown fox jumps over the lazy dog", add_special=True)[:8]):
        batch.add(token, pos, 0, True)
    ctx.decode(batch)
    yield ctx
    batch.close()
    ctx.close()
    model.close()


@contextlib.contextmanager
def row_set(ctx: Context, index: int, logits: dict[int, float], floor: float = -40.0) -> Iterator[np.ndarray]:
    """Row `index` holding `logits`, every other token at `floor`, for the duration."""
    row = ctx.logits(index)
    saved = row.copy()
    row[:] = floor
    row[list(logits)] = list(logits.values())
    try:
        yield row
    finally:
        row[:] = saved


def llama_picks(ctx: Context, index: int, stages: list, n: int = 1) -> list[int]:
    """`n` tokens from llama.cpp's own chain of `stages` on row `index`."""
    chain = llama_cpp.llama_sampler_chain_init(llama_cpp.llama_sampler_chain_default_params())
    for stage in stages:
        llama_cpp.llama_sampler_chain_add(chain, stage)
    try:
        return [llama_cpp.llama_sampler_sample(chain, ctx.ptr, index) for _ in range(n)]
    finally:
        llama_cpp.llama_sampler_free(chain)


def llama_greedy(ctx: Context, index: int) -> int:
    return llama_picks(ctx, index, [llama_cpp.llama_sampler_init_greedy()])[0]


def test_greedy_picks_what_llama_cpp_picks_on_real_rows(decoded: Context) -> None:
    sampler = Sampler(decoded.model, GREEDY)
    try:
        for index in range(8):
            assert sampler.sample(decoded, index) == llama_greedy(decoded, index)
    finally:
        sampler.close()


@pytest.mark.parametrize("tied", [[5, 900, 40000], [40000, 900, 5]], ids=["ascending", "descending"])
def test_greedy_breaks_a_tie_as_llama_cpp_does(decoded: Context, tied: list[int]) -> None:
    """Several tokens sharing the highest logit: both pick the lowest token id."""
    with row_set(decoded, 1, {token: 5.0 for token in tied}):
        sampler = Sampler(decoded.model, GREEDY)
        try:
            assert sampler.sample(decoded, 1) == llama_greedy(decoded, 1) == min(tied)
        finally:
            sampler.close()


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.0, logit_bias={42: 100.0}),
    SamplingParams(temperature=0.0, repeat_penalty=1.3),
    SamplingParams(temperature=0.0, grammar='root ::= "x"'),
], ids=["logit_bias", "penalty", "grammar"])
def test_greedy_with_other_stages_still_applies_them(decoded: Context, params: SamplingParams) -> None:
    """Only a chain that is greedy alone reads the row directly: a bias, a penalty or a grammar
    still changes the pick."""
    sampler, plain = Sampler(decoded.model, params), Sampler(decoded.model, GREEDY)
    try:
        with row_set(decoded, 2, {7: 10.0, 9: 9.5}, floor=0.0):  # 7 leads by less than a penalty of 1.3 takes off
            if params.penalized:
                sampler.accept(7)  # seen before: the penalty lowers it to 7.7
            expected = (42 if params.logit_bias else 9 if params.penalized
                        else decoded.model.tokenize("x", add_special=False)[0])
            assert plain.sample(decoded, 2) == 7
            assert sampler.sample(decoded, 2) == expected
    finally:
        sampler.close()
        plain.close()


# -- a temperature and nothing else: the draw over the whole row -------------------------------------------

DRAWS = 3000
ROW = {11: 2.0, 12: 1.0, 13: 0.5, 14: 0.0, 15: -1.0}  # the rest of the row far below: never drawn


def draws(ctx: Context, index: int, params: SamplingParams, n: int) -> list[int]:
    sampler = Sampler(ctx.model, params)
    try:
        return [sampler.sample(ctx, index) for _ in range(n)]
    finally:
        sampler.close()


@pytest.mark.parametrize("temperature", [0.7, 1.0, 1.6])
def test_temperature_draws_follow_llama_cpps_distribution(decoded: Context, temperature: float) -> None:
    """Two samples of 3,000 draws, ours and llama.cpp's chain, from one row: one distribution
    (a draw that ignored the temperature fails this at 0.7 and 1.6)."""
    with row_set(decoded, 3, ROW):
        ours = Counter(draws(decoded, 3, SamplingParams(temperature=temperature, seed=1), DRAWS))
        theirs = Counter(llama_picks(decoded, 3, [llama_cpp.llama_sampler_init_temp(temperature),
                                                   llama_cpp.llama_sampler_init_dist(2)], DRAWS))
    assert set(ours) <= set(ROW) and set(theirs) <= set(ROW)
    assert chi_square_p(ours, theirs) > 0.001, (ours, theirs)
    weights = np.exp(np.array(list(ROW.values())) / temperature)
    expected = weights[0] / weights.sum()
    assert abs(ours[11] / DRAWS - expected) < 0.04  # the likeliest token, at its softmax probability


def test_a_seed_gives_the_same_draws_and_other_seeds_others(decoded: Context) -> None:
    with row_set(decoded, 3, ROW):
        first = draws(decoded, 3, SamplingParams(temperature=1.0, seed=7), 200)
        again = draws(decoded, 3, SamplingParams(temperature=1.0, seed=7), 200)
        other = draws(decoded, 3, SamplingParams(temperature=1.0, seed=8), 200)
        unseeded = [draws(decoded, 3, SamplingParams(temperature=1.0), 200) for _ in range(2)]
    assert first == again
    assert first != other
    assert unseeded[0] != unseeded[1]


def test_a_row_that_is_not_finite_gives_a_token_that_is_not(decoded: Context) -> None:
    """The caller refuses a pick whose logit is not finite: a NaN row must give one."""
    with row_set(decoded, 3, {20: float("nan"), 21: 3.0}) as row:
        token = draws(decoded, 3, SamplingParams(temperature=0.8, seed=3), 1)[0]
        assert not np.isfinite(row[token])


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0, top_k=1),
    SamplingParams(temperature=1.0, top_p=0.5),
    SamplingParams(temperature=1.0, min_p=0.9),
], ids=["top_k", "top_p", "min_p"])
def test_a_truncated_draw_keeps_llama_cpps_chain(decoded: Context, params: SamplingParams) -> None:
    """top_k, top_p and min_p cut the tail before the draw: 11 (nearly all of the top half, and the
    only token within 0.9 of the likeliest) is then the only token drawn."""
    with row_set(decoded, 3, {11: 3.0, 12: 0.0, 13: 0.0}):
        assert set(draws(decoded, 3, params, 200)) == {11}


def test_a_draw_picks_where_the_whole_rows_cumulative_sum_puts_it() -> None:
    """Summed a block at a time, the draw picks what one cumulative sum over the whole row picks, for
    rows that end inside a block, mass in one block or across a boundary, and draws near 0 and 1."""
    rng = np.random.default_rng(5)
    for n, scale in [(5000, 3.0), (49152, 8.0), (1030, 40.0), (1024, 0.5)]:
        row = (rng.standard_normal(n) * scale).astype(np.float32)
        for temperature in (0.3, 1.0, 2.5):
            weights = np.exp((row - row.max()) / np.float32(temperature))
            cumulative = np.cumsum(weights, dtype=np.float64)
            for uniform in [0.0, 1e-12, *rng.random(300), 1 - 1e-12]:
                expected = min(int(np.searchsorted(cumulative, uniform * cumulative[-1], side="right")), n - 1)
                assert _draw(row, temperature, uniform) == expected, (n, temperature, uniform)

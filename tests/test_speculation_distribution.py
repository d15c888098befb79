"""At temperature 1, speculation leaves the sampled distribution as it is: a chi-square test of two
independent samples, over many seeds, on a tiny random-weight llama (real llama.cpp, fast enough
to draw hundreds of requests).

Sampling keeps each token's two likeliest candidates (top_k 2, temperature 1), so the first token
is one of two, `a` or `b`, and each request predicts `a x b y`, where `x` and `y` are the
less likely of the two candidates after `a` and after `b`: after its first token, every request
verifies the guess of the second, a plausible token far from certain. The first token is sampled
from the prompt's logits, before any draft, so the tested outcome is the pair of the first two
tokens (four categories). Without speculation and with it the seeds differ (two independent
samples), so only the distributions can agree, not the draws. A verifier that keeps the guess too
often (always; or, on a rejection, drawing again from the target with the guess still in, which
keeps it with p(2 - p) instead of p) must fail the same test.
"""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest

from conftest import engine, run, run_traced
from kvserve.llama.context import Context
from kvserve.llama.sampler import SamplingParams
from kvserve.scheduler.request import Request
from kvserve.scheduler.sampling import Sampling

PROMPT = [1, 500, 600, 700, 800]
SEEDS = 300  # per side, where the subtler wrong rule must fail (a marked slow test)
FAST_SEEDS = 100  # per side, in every run: enough to catch a verifier that always keeps the guess
TOP_K = 2
ALPHA = 0.001
SETTINGS = dict(ctx_size=256, parallel=16, batch_size=256, threads=2)


def chi_square_p(a: Counter, b: Counter) -> float:
    """p-value of Pearson's chi-square test that two samples of categories come from one
    distribution; categories whose pooled count is below 10 are merged into one."""
    pooled = a + b
    small = {c for c, n in pooled.items() if n < 10}
    rows = [Counter({("rare" if c in small else c): n for c, n in s.items()}) for s in (a, b)]
    cats = sorted(set(rows[0]) | set(rows[1]), key=str)
    totals = [sum(r.values()) for r in rows]
    stat = 0.0
    for c in cats:
        col = rows[0][c] + rows[1][c]
        for r, total in zip(rows, totals):
            expected = col * total / sum(totals)
            stat += (r[c] - expected) ** 2 / expected
    return chi2_sf(stat, len(cats) - 1)


def chi2_sf(x: float, df: int) -> float:
    """P(X >= x) for X chi-square with integer `df` >= 1 degrees of freedom (closed forms)."""
    h = x / 2
    if df % 2 == 0:
        return math.exp(-h) * sum(h**i / math.factorial(i) for i in range(df // 2))
    tail = sum(h ** (i + 0.5) / math.gamma(i + 1.5) for i in range(df // 2))
    return math.erfc(math.sqrt(h)) + math.exp(-h) * tail


def test_chi2_sf_matches_known_quantiles() -> None:
    """Table values: chi-square critical points at 0.05 and 0.001."""
    for x, df, p in ((3.841, 1, 0.05), (5.991, 2, 0.05), (7.815, 3, 0.05), (9.488, 4, 0.05),
                     (10.828, 1, 0.001), (18.467, 4, 0.001), (20.515, 5, 0.001)):
        assert chi2_sf(x, df) == pytest.approx(p, rel=2e-3)


def _two_likeliest(e, prompt: list[int]) -> list[int]:
    greedy = Request(id=f"p{len(prompt)}", prompt=prompt, params=SamplingParams(temperature=0.0), max_tokens=1,
                     logprobs=TOP_K, ignore_eos=True)
    return [token for token, _ in run_traced(e, [greedy])[greedy.id][0].top]


def first_pairs(tiny, mode: str, seeds: range) -> tuple[Counter, tuple[int, int]]:
    """The first two tokens of each request, counted, and the prediction drafter's (drafted, accepted)."""
    with engine(tiny("llama"), speculative=mode, **SETTINGS) as e:
        a, b = _two_likeliest(e, PROMPT)
        prediction = [a, _two_likeliest(e, PROMPT + [a])[1], b, _two_likeliest(e, PROMPT + [b])[1]]
        assert len(set(prediction)) == 4, "each first token must be found once in the prediction"
        requests = [Request(id=f"d{seed}", prompt=PROMPT, max_tokens=3, ignore_eos=True, prediction=prediction,
                            params=SamplingParams(temperature=1.0, top_k=TOP_K, seed=seed))
                    for seed in seeds]
        out = run(e, requests)
        stats = e.scheduler.speculator.stats.get("prediction")
    return Counter(tuple(out[r.id][:2]) for r in requests), (stats.drafted, stats.accepted) if stats else (0, 0)


@pytest.fixture(scope="module")
def without(tiny):
    """Pairs drawn without speculation from the first `n` seeds, drawn once per `n`."""
    drawn: dict[int, Counter] = {}

    def pairs(n: int) -> Counter:
        if n not in drawn:
            drawn[n] = first_pairs(tiny, "off", range(n))[0]
            assert len(drawn[n]) == 4 and min(drawn[n].values()) >= 10, drawn[n]
        return drawn[n]
    return pairs


def _keeps_the_guess(bug: str):
    """A verifier that samples its first row as the real one does, then keeps the draft's token
    where it should not."""
    real = Sampling.verify
    rng = np.random.default_rng(0)

    def verify(self: Sampling, request, choice, row, draft, outputs):
        sample = choice.sampler.sample

        def wrong(ctx: Context, index: int) -> int:
            token = sample(ctx, index)
            if index != row or token == draft[0]:
                return token
            if bug == "always":
                return draft[0]
            logits = ctx.logits(index).astype(np.float64)
            top = np.sort(logits)[-TOP_K:]
            p = math.exp(logits[draft[0]] - top.max()) / np.exp(top - top.max()).sum()
            return draft[0] if rng.random() < p else token  # a second draw from the target, guess included
        choice.sampler.sample = wrong
        try:
            return real(self, request, choice, row, draft, outputs)
        finally:
            del choice.sampler.sample
    return verify


@pytest.mark.parametrize("n", [FAST_SEEDS, pytest.param(SEEDS, marks=pytest.mark.slow)])
def test_speculation_keeps_the_sampled_distribution(tiny, without, n: int) -> None:
    pairs, (drafted, accepted) = first_pairs(tiny, "ngram", range(n, 2 * n))
    assert drafted >= n and 0 < accepted < drafted, "every request verifies a guess, kept or rejected"
    assert chi_square_p(without(n), pairs) > ALPHA, (without(n), pairs)


@pytest.mark.parametrize("bug, n", [("always", FAST_SEEDS), pytest.param("second_draw", SEEDS, marks=pytest.mark.slow)])
def test_a_verifier_that_keeps_the_guess_too_often_fails(tiny, without, monkeypatch: pytest.MonkeyPatch,
                                                         bug: str, n: int) -> None:
    monkeypatch.setattr(Sampling, "verify", _keeps_the_guess(bug))
    pairs, (drafted, _) = first_pairs(tiny, "ngram", range(n, 2 * n))
    assert drafted >= n
    assert chi_square_p(without(n), pairs) < ALPHA, (without(n), pairs)

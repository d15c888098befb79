"""A greedy chain with nothing else in it reads its token straight from the logits row; it must pick
what llama.cpp's own greedy stage picks, ties and non-finite rows included."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import llama_cpp
import numpy as np
import pytest

from kvserve.llama.batch import Batch
from kvserve.llama.context import Context, ContextParams
from kvserve.llama.model import Model
from kvserve.llama.sampler import Sampler, SamplingParams

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


def llama_greedy(ctx: Context, index: int) -> int:
    """llama.cpp's own greedy stage, alone in a chain."""
    chain = llama_cpp.llama_sampler_chain_init(llama_cpp.llama_sampler_chain_default_params())
    llama_cpp.llama_sampler_chain_add(chain, llama_cpp.llama_sampler_init_greedy())
    try:
        return llama_cpp.llama_sampler_sample(chain, ctx.ptr, index)
    finally:
        llama_cpp.llama_sampler_free(chain)


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
    row = decoded.logits(1)  # a view of llama.cpp's own buffer
    saved = row.copy()
    try:
        row[tied] = row.max() + 1.0
        sampler = Sampler(decoded.model, GREEDY)
        try:
            assert sampler.sample(decoded, 1) == llama_greedy(decoded, 1) == min(tied)
        finally:
            sampler.close()
    finally:
        row[:] = saved


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.0, logit_bias={42: 100.0}),
    SamplingParams(temperature=0.0, repeat_penalty=1.3),
    SamplingParams(temperature=0.0, grammar='root ::= "x"'),
], ids=["logit_bias", "penalty", "grammar"])
def test_greedy_with_other_stages_still_applies_them(decoded: Context, params: SamplingParams) -> None:
    """Only a chain that is greedy alone reads the row directly: a bias, a penalty or a grammar
    still changes the pick."""
    row = decoded.logits(2)
    saved = row.copy()
    row[:] = 0.0
    row[[7, 9]] = [10.0, 9.5]  # 7 leads by less than a repeat penalty of 1.3 takes off
    sampler, plain = Sampler(decoded.model, params), Sampler(decoded.model, GREEDY)
    try:
        if params.penalized:
            sampler.accept(7)  # seen before: the penalty lowers it to 7.7
        expected = (42 if params.logit_bias else 9 if params.penalized
                    else decoded.model.tokenize("x", add_special=False)[0])
        assert plain.sample(decoded, 2) == 7
        assert sampler.sample(decoded, 2) == expected
    finally:
        sampler.close()
        plain.close()
        row[:] = saved

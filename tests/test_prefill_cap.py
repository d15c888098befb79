"""What a step carries. Stall-free prefill: a long prompt arriving while streams decode is fed in
chunks of at most `--prefill-chunk` tokens per step, so every running stream gets its next token each
step; with nothing decoding, a prompt takes the whole token budget. A step is one call, whatever
it mixes (each sequence has its own KV stream). Counted in tokens per call."""

from __future__ import annotations

import pytest

from conftest import engine, greedy
from kvserve.llama.batch import Batch
from kvserve.scheduler.engine import Engine
from kvserve.scheduler.request import Request

CHUNK = 32
STREAMS = 4


def batch_sizes(e: Engine, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The number of tokens in each batch the engine decodes from now on."""
    sizes: list[int] = []
    real_decode = e.pool.ctx.decode

    def counting(batch: Batch) -> None:
        sizes.append(batch.n_tokens)
        real_decode(batch)

    monkeypatch.setattr(e.pool.ctx, "decode", counting)
    return sizes


def prompt_of(n_tokens: int) -> list[int]:
    """A prompt of `n_tokens` tokens that shares nothing with the streams'."""
    return [1] + [(7 * j) % 300 + 5 for j in range(n_tokens - 1)]


def decoding_streams(e: Engine, max_tokens: int, generated: int) -> list[Request]:
    """STREAMS requests, stepped until each has generated `generated` tokens."""
    streams = [greedy(e.model.tokenize(f"Stream {i} says", add_special=True), max_tokens=max_tokens, ignore_eos=True)
               for i in range(STREAMS)]
    for request in streams:
        e.scheduler.submit(request)
    while not all(r.state.choices and r.state.choices[0].n_generated >= generated for r in streams):
        e.scheduler.step()
    return streams


def test_a_long_prompt_never_holds_up_running_streams(tiny, monkeypatch: pytest.MonkeyPatch) -> None:
    with engine(tiny("llama"), batch_size=512, prefill_chunk=CHUNK, parallel=8) as e:
        sizes = batch_sizes(e, monkeypatch)
        streams = decoding_streams(e, max_tokens=400, generated=2)
        long_prompt = greedy(prompt_of(401), max_tokens=3)
        e.scheduler.submit(long_prompt)
        sizes.clear()
        generated = [r.state.choices[0].n_generated for r in streams]
        while not long_prompt.state.choices or long_prompt.state.choices[0].n_generated == 0:
            e.scheduler.step()
            now = [r.state.choices[0].n_generated for r in streams]
            assert now == [g + 1 for g in generated], "a running stream missed a step"
            generated = now
        assert len(sizes) >= 400 // CHUNK  # the prompt went in chunks, not in one step
        assert max(sizes) <= STREAMS + CHUNK
        for request in streams:
            e.scheduler.abort(request.id)
        while e.scheduler.has_work():
            e.scheduler.step()


def test_with_nothing_decoding_a_prompt_takes_the_whole_budget(tiny, monkeypatch: pytest.MonkeyPatch) -> None:
    with engine(tiny("llama"), batch_size=512, prefill_chunk=CHUNK) as e:
        sizes = batch_sizes(e, monkeypatch)
        request = greedy(prompt_of(401), max_tokens=2)
        e.scheduler.submit(request)
        while e.scheduler.has_work():
            e.scheduler.step()
        assert sizes[0] == 401


def decode_then_prompt(e: Engine, prompt_len: int, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The calls of the step in which a `prompt_len`-token prompt meets STREAMS decoding streams."""
    decoding_streams(e, max_tokens=50, generated=1)
    sizes = batch_sizes(e, monkeypatch)
    e.scheduler.submit(greedy(prompt_of(prompt_len), max_tokens=1))
    e.scheduler.step()
    return sizes


@pytest.mark.parametrize("flash_attn", ["on", "off"])
def test_decodes_and_a_prompt_go_in_one_call(tiny, flash_attn: str, monkeypatch: pytest.MonkeyPatch) -> None:
    with engine(tiny("llama"), batch_size=512, parallel=8, flash_attn=flash_attn) as e:
        assert decode_then_prompt(e, 100, monkeypatch) == [STREAMS + 100]


def test_the_engine_counts_its_calls_and_their_tokens(tiny, monkeypatch: pytest.MonkeyPatch) -> None:
    """What `kvserve_engine_decodes_total` and `kvserve_engine_decode_tokens_total` export."""
    with engine(tiny("llama"), batch_size=512, prefill_chunk=CHUNK, parallel=8) as e:
        times = e.scheduler.times
        before = (times.decodes, times.decode_tokens)
        sizes = batch_sizes(e, monkeypatch)
        decoding_streams(e, max_tokens=6, generated=3)
        e.scheduler.submit(greedy(prompt_of(101), max_tokens=2))
        while e.scheduler.has_work():
            e.scheduler.step()
        assert (times.decodes - before[0], times.decode_tokens - before[1]) == (len(sizes), sum(sizes))
        assert max(sizes) > STREAMS  # a prompt chunk rode along, so the tokens are not the calls

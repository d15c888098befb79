"""The prefix cache by hand (pool, sessions, insert/match_len/attach) and inside the scheduler.

Correctness is equality: greedy output after attaching cached pages equals greedy output computed
from scratch. Accounting is checked through llama.cpp's own positions, not only our counters.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from conftest import engine, greedy, run
from kvserve.cache import KvPool, PageCache, create_kv_pool
from kvserve.llama.model import Model

PAGE = 16
SYSTEM = "You are a careful assistant. Answer briefly and precisely, citing facts only. " * 2


def _generate(pool: KvPool, session, prompt_tail: list[int], n: int) -> list[int]:
    logits = pool.eval(session, prompt_tail)
    out = []
    for _ in range(n):
        token = int(np.argmax(logits))
        out.append(token)
        logits = pool.eval(session, [token])
    return out


def _from_scratch(pool: KvPool, prompt: list[int], n: int) -> list[int]:
    session = pool.new_session()
    try:
        return _generate(pool, session, prompt, n)
    finally:
        pool.end_session(session)


def _cells_held_by_llama(pool: KvPool, seqs: set[int]) -> int:
    """Cells the given sequences occupy, from llama.cpp's positions (holders keep contiguous runs)."""
    ctx = pool.ctx
    return sum(ctx.seq_pos_max(s) - ctx.seq_pos_min(s) + 1 for s in seqs if ctx.seq_pos_max(s) >= 0)


def _holder_seqs(cache: PageCache) -> set[int]:
    return {node.holder.seq for node in cache.tree._all_nodes()}


@pytest.fixture(params=["tiny-llama", "smollm2"])
def model(request, tiny, smollm2) -> Model:
    path = smollm2 if request.param == "smollm2" else tiny("llama")
    loaded = Model(path)
    yield loaded
    loaded.close()


def test_attach_then_tail_prefill_equals_scratch(model: Model) -> None:
    pool, cache = create_kv_pool(model, PAGE, n_ctx=2048, n_seq_max=16)
    prompt_a = model.tokenize(SYSTEM + "Question: what is the capital of France?", add_special=True)
    prompt_b = model.tokenize(SYSTEM + "Question: name three colours of the rainbow.", add_special=True)
    shared = next(i for i, (x, y) in enumerate(zip(prompt_a, prompt_b)) if x != y)

    a = pool.new_session()
    out_a = _generate(pool, a, prompt_a, 8)
    cache.insert(a, a.tokens, preview="A")
    pool.end_session(a)

    expected = shared // PAGE * PAGE  # a partial match ending mid-prompt, on a page boundary
    assert cache.match_len(prompt_b) == expected > 0
    b = pool.new_session()
    assert cache.attach(b, prompt_b) == expected
    assert b.n_past == expected and pool.ctx.seq_pos_max(b.seq) == expected - 1
    out_b = _generate(pool, b, prompt_b[b.n_past :], 8)
    pool.end_session(b)

    assert out_b == _from_scratch(pool, prompt_b, 8)
    assert _from_scratch(pool, prompt_a, 8) == out_a
    cache.release()
    pool.close()


def test_prompt_equal_to_a_chain_attaches_one_token_short(model: Model) -> None:
    pool, cache = create_kv_pool(model, PAGE, n_ctx=2048, n_seq_max=16)
    prompt = model.tokenize(SYSTEM * 3, add_special=True)[: 3 * PAGE]  # exactly three pages
    assert len(prompt) == 3 * PAGE
    a = pool.new_session()
    pool.eval(a, prompt)
    cache.insert(a, a.tokens)
    pool.end_session(a)
    assert cache.held_pages == 3
    # The whole prompt is cached, but the model must evaluate its last token to produce logits.
    assert cache.match_len(prompt) == 2 * PAGE
    b = pool.new_session()
    cache.attach(b, prompt)
    tail = prompt[b.n_past :]
    assert len(tail) == PAGE
    logits = pool.eval(b, tail)
    pool.end_session(b)
    scratch = pool.new_session()
    assert int(np.argmax(pool.eval(scratch, prompt))) == int(np.argmax(logits))
    pool.end_session(scratch)
    cache.release()
    pool.close()


def test_match_len_touches_nothing(tiny) -> None:
    model = Model(tiny("llama"))
    pool, cache = create_kv_pool(model, PAGE, n_ctx=1024, n_seq_max=8)
    prompt = model.tokenize(SYSTEM + " and more", add_special=True)
    a = pool.new_session()
    pool.eval(a, prompt)
    cache.insert(a, a.tokens, preview="a")
    pool.end_session(a)
    before = (cache.view()["chains"], [n.last_access for n in cache.tree._all_nodes()])
    assert cache.match_len(prompt) > 0
    assert cache.match_len(prompt + [5, 6, 7]) > 0
    after = (cache.view()["chains"], [n.last_access for n in cache.tree._all_nodes()])
    assert after == before
    b = pool.new_session()
    cache.attach(b, prompt)
    assert cache.view()["chains"][0]["hits"] == 1  # attach, unlike match_len, counts
    pool.end_session(b)
    cache.release()
    pool.close()
    model.close()


def test_page_accounting_through_llama_positions(tiny) -> None:
    model = Model(tiny("llama"))
    pool, cache = create_kv_pool(model, PAGE, n_ctx=2048, n_seq_max=32)
    base = model.tokenize(SYSTEM, add_special=True)
    for i in range(6):  # branches off a shared trunk, some sharing more than others
        tokens = base[: 20 + 9 * i] + model.tokenize(f" branch {i} " * (i + 1), add_special=False)
        s = pool.new_session()
        if cache.match_len(tokens):
            cache.attach(s, tokens)
        pool.eval(s, tokens[s.n_past :])
        cache.insert(s, s.tokens)
        pool.end_session(s)
        held = cache.held_pages
        assert _cells_held_by_llama(pool, _holder_seqs(cache)) == held * PAGE
        assert pool.used_cells == held * PAGE
    # shared trunk pages are held once: fewer pages than the chains' lengths add up to
    assert cache.held_pages < sum(c["tokens"] for c in cache.view()["chains"]) // PAGE
    cache.release()
    assert all(pool.ctx.seq_pos_max(s) == -1 for s in range(pool.ctx.n_seq_max))
    assert pool.free_ids == pool.ctx.n_seq_max
    pool.close()
    model.close()


def test_closing_a_pool_the_cache_still_borrows_from_is_an_error(tiny) -> None:
    model = Model(tiny("llama"))
    pool, cache = create_kv_pool(model, PAGE, n_ctx=512, n_seq_max=4)
    s = pool.new_session()
    pool.eval(s, list(range(10, 10 + 2 * PAGE + 3)))
    cache.insert(s, s.tokens)
    pool.end_session(s)
    with pytest.raises(RuntimeError, match="release"):
        pool.close()
    cache.release()
    pool.close()
    model.close()


# -- inside the scheduler --------------------------------------------------------------------------


def _chat(model_path: Path, question: str, e) -> list[int]:
    return e.model.tokenize(SYSTEM + question, add_special=True)


@pytest.mark.parametrize("which", ["tiny-llama", "smollm2"])
def test_scheduler_attaches_and_matches_scratch(tiny, smollm2, which: str) -> None:
    path = smollm2 if which == "smollm2" else tiny("llama")
    questions = [f" Question {i}: tell me about topic number {i}." for i in range(4)]
    with engine(path, prefix_cache=False) as e:
        prompts = [_chat(path, q, e) for q in questions]
        scratch = []
        for p in prompts:
            r = greedy(p, max_tokens=6)
            scratch.append(run(e, [r])[r.id])
    with engine(path) as e:
        first = greedy(prompts[0], max_tokens=6)
        assert run(e, [first])[first.id] == scratch[0]
        assert first.state.cached_tokens == 0
        rest = [greedy(p, max_tokens=6) for p in prompts[1:]]
        outs = run(e, rest)
        assert [outs[r.id] for r in rest] == scratch[1:]
        shared = next(i for i, (x, y) in enumerate(zip(prompts[0], prompts[1])) if x != y)
        assert all(r.state.cached_tokens == shared // PAGE * PAGE for r in rest)


def test_flood_of_distinct_prompts_under_small_context_never_fails(tiny) -> None:
    """With 512 cells, 40 distinct ~90-token prompts fill the cache many times over: it must evict."""
    with engine(tiny("llama"), ctx_size=512, parallel=4, batch_size=64) as e:
        requests = [greedy(e.model.tokenize(f"Prompt {i}: " + "words and more words " * 12, add_special=True),
                           max_tokens=8) for i in range(40)]
        outs = run(e, requests)
        assert all(len(outs[r.id]) == 8 for r in requests)
        cache = e.cache
        assert cache.stats().evicted_pages > 0
        assert e.pool.used_cells == cache.held_pages * PAGE <= e.pool.n_cells
        assert _cells_held_by_llama(e.pool, _holder_seqs(cache)) == cache.held_pages * PAGE


def test_held_cells_stay_under_the_cap_lru_first(tiny) -> None:
    model = Model(tiny("llama"))
    pool, cache = create_kv_pool(model, PAGE, n_ctx=1024, n_seq_max=16, max_cells=4 * PAGE)
    prompts = [model.tokenize(f"Distinct prompt number {i}: " + "filler words " * 12, add_special=True)
               for i in range(4)]
    for prompt in prompts:
        s = pool.new_session()
        pool.eval(s, prompt)
        cache.insert(s, s.tokens)
        pool.end_session(s)
        assert cache.held_cells <= 4 * PAGE
        assert _cells_held_by_llama(pool, _holder_seqs(cache)) == cache.held_cells
    assert cache.match_len(prompts[-1]) > 0  # the newest donation survives
    assert cache.match_len(prompts[0]) == 0  # the oldest went first
    cache.release()
    pool.close()
    model.close()


def test_cold_pages_fill_at_most_their_share_and_go_before_hot_ones(tiny) -> None:
    """Pages no attach has hit may fill a quarter of the cap; past it, and when cells are needed,
    they go before pages that were reused, however long ago those were used."""
    model = Model(tiny("llama"))
    pool, cache = create_kv_pool(model, PAGE, n_ctx=2048, n_seq_max=16, max_cells=16 * PAGE)

    def donate(prompt: list[int]) -> None:
        session = pool.new_session()
        pool.eval(session, prompt)
        cache.insert(session, session.tokens)
        pool.end_session(session)

    shared = model.tokenize("A shared system prompt: " + "rules and rules " * 12, add_special=True)
    donate(shared)
    reader = pool.new_session()
    hot = cache.attach(reader, shared + [5])
    pool.end_session(reader)
    assert hot >= 2 * PAGE and cache.max_cold_cells == 4 * PAGE
    for i in range(8):
        donate(model.tokenize(f"Distinct prompt number {i}: " + "filler words " * 8, add_special=True))
        assert cache.tree.n_cold * PAGE <= cache.max_cold_cells
        assert cache.match_len(shared + [5]) == hot
        assert _cells_held_by_llama(pool, _holder_seqs(cache)) == cache.held_cells
    cold = cache.tree.n_cold * PAGE
    assert cold > 0
    cache.evict(cold)  # exactly the cold pages' cells: the older hot pages stay
    assert cache.tree.n_cold == 0 and cache.match_len(shared + [5]) == hot
    cache.release()
    pool.close()
    model.close()

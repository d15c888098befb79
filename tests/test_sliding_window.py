"""Sliding-window models that cache: a stream cut back in place while it still holds the window for
the cut point, and the window's rows kept with the pages at a page boundary (a chat mark), so a
prompt in another stream attaches the prefix. On the tiny gemma3 (window TINY_SWA, 3 layers: two
sliding, one global) with plain attention; tests/test_gemma.py does the same on Gemma 3 270M.

Every attach is checked against llama.cpp's own positions (`llama_memory_seq_pos_min/max`) and its
output against the same prompt evaluated from scratch; the mutations at the end (a cut past the
window, a window restored one position off) must fail that comparison.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from conftest import engine, greedy, run
from kvserve.cache import StreamPool
from kvserve.scheduler.kv_manager import KvManager
from kvserve.cache.chat_marks import MarkKind, mark_messages
from kvserve.cache.host_store import HostStore
from kvserve.cache.kv_pool import Session
from kvserve.cache.page_cache import PageCache
from kvserve.cache.prefix_key import PrefixKey
from kvserve.llama.context import Context, ContextParams
from kvserve.llama.model import Model
from kvserve.llama.seq_state import SeqState
from kvserve.testing.tiny_models import TINY_SWA

PAGE = 16
N_OUT = 12  # greedy tokens compared (plain attention: equal, token for token)
# first-step logprobs over the top 5, cache vs scratch: plain attention rounds by cell placement
# only; measured at most 2e-6 on these prompts
LOGPROB_TOLERANCE = 1e-3


def _tokens(n: int, seed: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(200, 40000, n)]


@pytest.fixture(scope="module")
def gemma(tiny) -> Model:
    model = Model(tiny("gemma3"))
    assert model.info.n_swa == TINY_SWA
    yield model
    model.close()


def _pool(model: Model, swa_full: bool = True, budget: int = 64 << 20) -> tuple[StreamPool, PageCache]:
    """Three streams of 512 cells; without `swa_full` a stream keeps only n_swa + 16 (padded to 256)
    sliding-window cells, so long sequences lose their earliest window rows."""
    ctx = Context(model, ContextParams(n_ctx_seq=512, n_batch=64, n_seq_max=3, n_threads=2, n_ubatch=16,
                                       flash_attn="off", swa_full=swa_full))
    cache = PageCache(ctx, PAGE, HostStore(budget))
    return StreamPool(ctx, on_end=cache.unlock), cache


def _next(kv: KvManager, session: Session, tail: list[int]) -> tuple[list[int], np.ndarray]:
    """Evaluate `tail` after what the session holds, then N_OUT greedy tokens; and the first logprobs."""
    logits = kv.eval(session, tail).astype(np.float64)
    first = logits - logits.max() - np.log(np.exp(logits - logits.max()).sum())
    out = []
    for _ in range(N_OUT):
        out.append(int(np.argmax(logits)))
        logits = kv.eval(session, [out[-1]])
    return out, first


def _scratch(model: Model, prompt: list[int]) -> tuple[list[int], np.ndarray]:
    pool, cache = _pool(model)
    kv = KvManager(pool, cache)
    session = kv.new_session()
    try:
        return _next(kv, session, prompt)
    finally:
        pool.end_session(session)
        pool.close()


def _assert_as_scratch(got: tuple[list[int], np.ndarray], want: tuple[list[int], np.ndarray]) -> None:
    top = np.argsort(-want[1])[:5]
    assert got[0] == want[0], f"greedy tokens {got[0]} vs {want[0]} from scratch"
    assert np.abs(got[1][top] - want[1][top]).max() <= LOGPROB_TOLERANCE


def _window_held(pool: StreamPool, seq: int, n: int) -> None:
    """llama.cpp holds positions 0..n-1 of `seq` and the window's rows the token at n attends."""
    assert pool.ctx.seq_pos_max(seq) == n - 1
    assert pool.ctx.seq_pos_min(seq) <= max(0, n - TINY_SWA + 1)


def _run_conversation(kv: KvManager, prompt: list[int]) -> Session:
    session = kv.new_session(PrefixKey("", prompt))
    _next(kv, session, prompt[session.n_past :])
    kv.pool.end_session(session)
    return session


# -- cutting back in place ------------------------------------------------------------------------------


def test_a_stream_is_cut_back_in_place_only_while_it_holds_the_window(gemma: Model) -> None:
    pool, cache = _pool(gemma, swa_full=False)
    kv = KvManager(pool, cache)
    held = _tokens(400, 1)
    first = _run_conversation(kv, held)
    pos_min = pool.ctx.seq_pos_min(first.seq)
    assert 0 < pos_min  # the stream no longer holds its earliest sliding-window rows
    near, far = 380, 100  # cut points: the window before 380 is held, the one before 100 is not
    assert pos_min <= near - TINY_SWA + 1 and pos_min > far - TINY_SWA + 1

    prompt = held[:near] + _tokens(20, 2)
    assert pool.resident_match(PrefixKey("", prompt)) == near
    session = kv.new_session(PrefixKey("", prompt))
    assert session.seq == first.seq and session.n_past == near
    _window_held(pool, session.seq, near)
    got = _next(kv, session, prompt[near:])
    pool.end_session(session)
    _assert_as_scratch(got, _scratch(gemma, prompt))

    prompt = held[:far] + _tokens(20, 3)
    assert pool.resident_match(PrefixKey("", prompt)) == 0  # refused: the token at 100 would miss rows 69..pos_min-1
    session = kv.new_session(PrefixKey("", prompt))
    assert session.n_past == 0
    pool.end_session(session)
    pool.close()


def test_a_full_size_window_cache_cuts_back_anywhere(gemma: Model) -> None:
    """llama.cpp's default (swa_full): a stream's sliding-window cells are overwritten only when it has no
    free cell left, so a stream keeps every row and any common prefix is kept in place."""
    pool, cache = _pool(gemma)
    kv = KvManager(pool, cache)
    held = _tokens(400, 1)
    first = _run_conversation(kv, held)
    assert pool.ctx.seq_pos_min(first.seq) == 0
    prompt = held[:100] + _tokens(20, 3)
    session = kv.new_session(PrefixKey("", prompt))
    assert session.seq == first.seq and session.n_past == 100
    _window_held(pool, session.seq, 100)
    got = _next(kv, session, prompt[100:])
    pool.end_session(session)
    _assert_as_scratch(got, _scratch(gemma, prompt))
    pool.close()


# -- the window kept with the pages at a mark ----------------------------------------------------------


def _donated_at_the_end(kv: KvManager, cache: PageCache, prompt: list[int]) -> None:
    """A request with no stop: served whole, its pages donated when it ends (without the window
    before its last n_swa positions)."""
    session = kv.new_session()
    _next(kv, session, prompt)
    cache.insert(session, session.tokens)
    kv.pool.end_session(session)


def _stop_at(kv: KvManager, cache: PageCache, prompt: list[int], stop: int) -> None:
    """A prefill that stops at `stop` to keep the window there, then runs to its end."""
    session = kv.new_session()
    kv.eval(session, prompt[:stop])
    cache.insert(session, session.tokens, kind=MarkKind.OPENING)
    _next(kv, session, prompt[stop:])
    cache.insert(session, session.tokens)
    kv.pool.end_session(session)


def _attach_in_another_stream(kv: KvManager, cache: PageCache, prompt: list[int], n: int):
    session = kv.new_session()
    assert kv.attach(session, PrefixKey("", prompt)) == n
    _window_held(kv.pool, session.seq, n)
    got = _next(kv, session, prompt[n:])
    kv.pool.end_session(session)
    return got


def test_a_window_kept_at_a_mark_is_attached_in_another_stream(gemma: Model) -> None:
    pool, cache = _pool(gemma)
    kv = KvManager(pool, cache)
    system, stop = _tokens(203, 4), 192  # the mark falls inside a page: the stop is the boundary before it
    prompt_a, prompt_b = system + _tokens(30, 5), system + _tokens(25, 6)
    assert cache.checkpoint_at(Session(0), prompt_a, 0, len(system)) == stop
    _stop_at(kv, cache, prompt_a, stop)
    assert cache.windows_filled == 0  # new pages carry the window's rows as read
    assert cache.match_len(PrefixKey("", prompt_b)) == stop
    assert cache.checkpoint_at(Session(0), prompt_b, 0, len(system)) == 0  # nothing left to keep there
    _assert_as_scratch(_attach_in_another_stream(kv, cache, prompt_b, stop), _scratch(gemma, prompt_b))
    cache.release()
    pool.close()


def test_without_a_stop_the_prefix_is_refused(gemma: Model) -> None:
    pool, cache = _pool(gemma)
    kv = KvManager(pool, cache)
    system = _tokens(203, 4)
    _donated_at_the_end(kv, cache, system + _tokens(30, 5))
    assert cache.match_len(PrefixKey("", system + _tokens(25, 6))) == 0  # the pages lack the window before 192
    cache.release()
    pool.close()


def test_a_window_is_read_alone_into_pages_already_cached(gemma: Model) -> None:
    """Pages cached without the window (donated from a longer prompt's end) get it from a PARTIAL_ONLY
    read when a later prefill stops there; those pages grow by exactly the window's rows."""
    pool, cache = _pool(gemma)
    kv = KvManager(pool, cache)
    system, stop = _tokens(203, 4), 192
    _donated_at_the_end(kv, cache, system + _tokens(30, 5))
    path = cache.tree.match(PrefixKey("", system), stop // PAGE)
    before = sum(cache.store.peek(node).nbytes for node in path)
    assert cache.match_len(PrefixKey("", system + _tokens(25, 6))) == 0

    _stop_at(kv, cache, system + _tokens(40, 7), stop)
    assert cache.windows_filled == 1
    swa_row = cache.rows._layout[1].width  # a position's rows in every sliding-window layer, and its metadata
    added = sum(cache.store.peek(node).nbytes for node in path) - before
    assert added == TINY_SWA * swa_row  # the window's rows and nothing else
    assert cache.bytes_used <= cache.budget_bytes

    prompt_b = system + _tokens(25, 6)
    assert cache.match_len(PrefixKey("", prompt_b)) == stop
    _assert_as_scratch(_attach_in_another_stream(kv, cache, prompt_b, stop), _scratch(gemma, prompt_b))
    cache.release()
    pool.close()


def test_a_window_that_does_not_fit_the_budget_is_not_kept(gemma: Model) -> None:
    pool, cache = _pool(gemma, budget=1)
    kv = KvManager(pool, cache)
    system = _tokens(203, 4)
    _stop_at(kv, cache, system + _tokens(30, 5), 192)
    assert cache.bytes_used == 0 and cache.match_len(PrefixKey("", system + _tokens(25, 6))) == 0
    pool.close()


# -- the scheduler: chat conversations on one system prompt --------------------------------------------

SYSTEM = ("You are the dispatcher of a parcel service. Parcels move between the depots of Oslo, Bergen, "
          "Trondheim and Stavanger; every answer names the depot, the day and the parcel number. ") * 4
QUESTIONS = [f"Where is parcel {n}, and when does it reach {city}?"
             for n, city in zip(range(11, 19), ("Oslo", "Bergen", "Trondheim", "Stavanger") * 2)]


def _chat(e, question: str):
    turn = mark_messages(e.model, e.template, [{"role": "system", "content": SYSTEM},
                                               {"role": "user", "content": question}])
    return greedy(turn.tokens, max_tokens=8, marks=turn.checkpoint_marks()), turn


@pytest.fixture(scope="module")
def answers_alone(tiny) -> list[list[int]]:
    with engine(tiny("gemma3"), prefix_cache=False, flash_attn="off") as e:
        requests = [_chat(e, question)[0] for question in QUESTIONS]
        return [run(e, [request])[request.id] for request in requests]


@pytest.mark.parametrize("together", [False, True], ids=["one-after-another", "together"])
def test_conversations_on_one_system_prompt_attach_it(tiny, answers_alone: list[list[int]], together: bool) -> None:
    """8 conversations on a system prompt of several windows: after the first, each attaches at
    least 90% of the shared opening (in place one after another, from the pages kept at the opening
    mark when they arrive together), and each answers as it does with the cache off."""
    with engine(tiny("gemma3"), flash_attn="off") as e:
        chats = [_chat(e, q) for q in QUESTIONS]
        requests = [r for r, _ in chats]
        opening = chats[0][1].opening
        assert opening > 4 * TINY_SWA and all(t.opening == opening for _, t in chats)
        if together:
            outs = run(e, requests)
        else:
            outs = {r.id: run(e, [r])[r.id] for r in requests}
        assert [outs[r.id] for r in requests] == answers_alone
        assert requests[0].state.cached_tokens == 0
        for request in requests[1:]:
            assert request.state.cached_tokens >= 0.9 * opening, (request.state.cached_tokens, opening)
        # one after another, each lands in the stream the last one left; together, in streams of
        # their own, from the pages the first kept at its opening
        assert e.pool.inplace_reuses == (0 if together else len(requests) - 1)
        assert e.cache.bytes_used <= e.cache.budget_bytes


# -- the comparison catches a wrong cut and a misplaced window -----------------------------------------


def test_a_cut_past_the_window_fails_the_comparison(gemma: Model, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(StreamPool, "can_cut", lambda self, seq, n: True)  # ignores pos_min
    pool, cache = _pool(gemma, swa_full=False)
    kv = KvManager(pool, cache)
    held = _tokens(400, 1)
    _run_conversation(kv, held)
    prompt = held[:100] + _tokens(20, 3)
    session = kv.new_session(PrefixKey("", prompt))
    assert session.n_past == 100  # cut back although the stream lacks the window's rows
    with pytest.raises(AssertionError):
        _window_held(pool, session.seq, 100)  # llama.cpp's positions say so
    got = _next(kv, session, prompt[100:])
    pool.end_session(session)
    with pytest.raises(AssertionError):
        _assert_as_scratch(got, _scratch(gemma, prompt))
    pool.close()


def test_a_window_one_position_off_fails_the_comparison(gemma: Model, monkeypatch: pytest.MonkeyPatch) -> None:
    read = SeqState.read_window

    def shifted(self: SeqState, seq: int) -> tuple[int, np.ndarray]:
        first, table = read(self, seq)
        meta = self._layout[1].meta_bytes
        table[1:, meta:] = table[:-1, meta:].copy()  # each position gets the rows of the one before
        return first, table

    monkeypatch.setattr(SeqState, "read_window", shifted)
    pool, cache = _pool(gemma)
    kv = KvManager(pool, cache)
    system = _tokens(203, 4)
    _donated_at_the_end(kv, cache, system + _tokens(30, 5))
    _stop_at(kv, cache, system + _tokens(40, 7), 192)
    assert cache.windows_filled == 1
    prompt_b = system + _tokens(25, 6)
    with pytest.raises(AssertionError):
        _assert_as_scratch(_attach_in_another_stream(kv, cache, prompt_b, 192), _scratch(gemma, prompt_b))
    cache.release()
    pool.close()

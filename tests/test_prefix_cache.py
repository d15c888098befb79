"""The prefix cache by hand (pool, sessions, insert/match_len/attach) and inside the scheduler.

Correctness is equality: greedy output after attaching cached pages equals greedy output computed
from scratch. Accounting is checked through llama.cpp's own positions and the cache's bytes.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from conftest import engine, greedy, run
from kvserve.cache import KvPool, PrefixKey, StreamPool, create_kv_pool
from kvserve.scheduler.kv_manager import KvManager
from kvserve.llama.model import Model

PAGE = 16
SYSTEM = "You are a careful assistant. Answer briefly and precisely, citing facts only. " * 2


def _generate(kv: KvManager, session, prompt_tail: list[int], n: int) -> list[int]:
    logits = kv.eval(session, prompt_tail)
    out = []
    for _ in range(n):
        token = int(np.argmax(logits))
        out.append(token)
        logits = kv.eval(session, [token])
    return out


def _from_scratch(kv: KvManager, prompt: list[int], n: int) -> list[int]:
    session = kv.new_session()
    try:
        return _generate(kv, session, prompt, n)
    finally:
        kv.pool.end_session(session)


def _positions(pool: StreamPool, session) -> tuple[int, int]:
    return pool.ctx.seq_pos_min(session.seq), pool.ctx.seq_pos_max(session.seq)


def _donate(kv: KvManager, cache, prompt: list[int]) -> None:
    session = kv.new_session()
    kv.eval(session, prompt)
    cache.insert(session, session.tokens)
    kv.pool.end_session(session)


@pytest.fixture(params=["tiny-llama", "smollm2"])
def model(request, tiny, smollm2) -> Model:
    path = smollm2 if request.param == "smollm2" else tiny("llama")
    loaded = Model(path)
    yield loaded
    loaded.close()


def test_attach_then_tail_prefill_equals_scratch(model: Model) -> None:
    pool, cache = create_kv_pool(model, PAGE, n_ctx_seq=1024, n_streams=4)
    kv = KvManager(pool, cache)
    prompt_a = model.tokenize(SYSTEM + "Question: what is the capital of France?", add_special=True)
    prompt_b = model.tokenize(SYSTEM + "Question: name three colours of the rainbow.", add_special=True)
    shared = next(i for i, (x, y) in enumerate(zip(prompt_a, prompt_b)) if x != y)

    a = kv.new_session()
    out_a = _generate(kv, a, prompt_a, 8)
    cache.insert(a, a.tokens, preview="A")
    pool.end_session(a)

    expected = shared // PAGE * PAGE  # a partial match ending mid-prompt, on a page boundary
    assert cache.match_len(PrefixKey("", prompt_b)) == expected > 0
    b = kv.new_session()
    assert kv.attach(b, PrefixKey("", prompt_b)) == expected
    assert b.n_past == expected and _positions(pool, b) == (0, expected - 1)
    out_b = _generate(kv, b, prompt_b[b.n_past :], 8)
    pool.end_session(b)

    assert out_b == _from_scratch(kv, prompt_b, 8)
    assert _from_scratch(kv, prompt_a, 8) == out_a
    cache.release()
    pool.close()


def test_prompt_equal_to_a_chain_attaches_all_but_its_last_token(model: Model) -> None:
    """The last page is cached too: it is attached but its last row, and one token is evaluated."""
    pool, cache = create_kv_pool(model, PAGE, n_ctx_seq=1024, n_streams=4)
    kv = KvManager(pool, cache)
    prompt = model.tokenize(SYSTEM * 3, add_special=True)[: 3 * PAGE]  # exactly three pages
    assert len(prompt) == 3 * PAGE
    a = kv.new_session()
    kv.eval(a, prompt)
    cache.insert(a, a.tokens)
    pool.end_session(a)
    assert cache.held_pages == 3
    # The whole prompt is cached, but the model must evaluate its last token to produce logits.
    assert cache.match_len(PrefixKey("", prompt)) == 3 * PAGE - 1
    b = kv.new_session()
    assert kv.attach(b, PrefixKey("", prompt)) == 3 * PAGE - 1
    assert _positions(pool, b) == (0, 3 * PAGE - 2)
    tail = prompt[b.n_past :]
    assert len(tail) == 1
    out_b = _generate(kv, b, tail, 8)
    pool.end_session(b)
    assert out_b == _from_scratch(kv, prompt, 8)
    cache.release()
    pool.close()


def test_match_len_touches_nothing(tiny) -> None:
    model = Model(tiny("llama"))
    pool, cache = create_kv_pool(model, PAGE, n_ctx_seq=512, n_streams=2)
    kv = KvManager(pool, cache)
    prompt = model.tokenize(SYSTEM + " and more", add_special=True)
    a = kv.new_session()
    kv.eval(a, prompt)
    cache.insert(a, a.tokens, preview="a")
    pool.end_session(a)
    before = (cache.view("")["chains"], [(e.hits, e.last_access) for e in cache.store._entries.values()])
    assert cache.match_len(PrefixKey("", prompt)) > 0
    assert cache.match_len(PrefixKey("", prompt + [5, 6, 7])) > 0
    after = (cache.view("")["chains"], [(e.hits, e.last_access) for e in cache.store._entries.values()])
    assert after == before
    b = kv.new_session()
    kv.attach(b, PrefixKey("", prompt))
    assert cache.view("")["chains"][0]["hits"] == 1  # attach, unlike match_len, counts
    pool.end_session(b)
    cache.release()
    pool.close()
    model.close()


def test_shared_pages_are_held_once_and_release_frees_every_byte(tiny) -> None:
    model = Model(tiny("llama"))
    pool, cache = create_kv_pool(model, PAGE, n_ctx_seq=512, n_streams=2)
    kv = KvManager(pool, cache)
    base = model.tokenize(SYSTEM, add_special=True)
    for i in range(6):  # branches off a shared trunk, some sharing more than others
        tokens = base[: 20 + 9 * i] + model.tokenize(f" branch {i} " * (i + 1), add_special=False)
        s = kv.new_session()
        if cache.match_len(PrefixKey("", tokens)):
            kv.attach(s, PrefixKey("", tokens))
            assert _positions(pool, s) == (0, s.n_past - 1)  # exactly the attached rows, nothing after
        kv.eval(s, tokens[s.n_past :])
        cache.insert(s, s.tokens)
        pool.end_session(s)
        assert 0 < cache.bytes_used == cache.stats().held_bytes <= cache.budget_bytes
    # shared trunk pages are held once: fewer pages than the chains' lengths add up to
    assert cache.held_pages < sum(c["tokens"] for c in cache.view("")["chains"]) // PAGE
    cache.release()
    assert cache.bytes_used == 0 and cache.held_pages == 0 and not cache.chains
    pool.drop_resident()
    assert all(pool.ctx.seq_pos_max(s) == -1 for s in range(pool.ctx.n_seq_max))
    pool.close()
    model.close()


def test_closing_a_pool_with_a_live_session_is_an_error(tiny) -> None:
    model = Model(tiny("llama"))
    pool, cache = create_kv_pool(model, PAGE, n_ctx_seq=256, n_streams=2)
    kv = KvManager(pool, cache)
    s = kv.new_session()
    kv.eval(s, list(range(10, 10 + 2 * PAGE + 3)))
    with pytest.raises(RuntimeError, match="end them"):
        pool.close()
    pool.end_session(s)
    cache.release()
    pool.close()
    model.close()


def test_a_stream_keeps_its_rows_for_the_next_turn(tiny) -> None:
    """A session that continues what an idle stream holds is placed there and evaluates only its tail;
    one that shares part of it keeps that part (the rest is cut); equality with scratch both times."""
    model = Model(tiny("llama"))
    pool, cache = create_kv_pool(model, PAGE, n_ctx_seq=512, n_streams=3)
    kv = KvManager(pool, cache)
    turn1 = model.tokenize(SYSTEM + " First question?", add_special=True)
    a = kv.new_session(PrefixKey("", turn1))
    answer = _generate(kv, a, turn1, 5)
    pool.end_session(a)
    turn2 = turn1 + answer + model.tokenize(" Second question?", add_special=False)
    b = kv.new_session(PrefixKey("", turn2))
    assert b.seq == a.seq and b.n_past == len(turn1) + len(answer)  # kept in place: only the new tail to evaluate
    assert pool.inplace_reuses == 1 and pool.inplace_tokens == b.n_past
    in_place = _generate(kv, b, turn2[b.n_past :], 6)
    pool.end_session(b)
    other = turn1[:30] + [7, 8, 9]
    c = kv.new_session(PrefixKey("", other))
    assert c.n_past == 30 and _positions(pool, c) == (0, 29)  # cut back to what it shares
    cut = _generate(kv, c, other[30:], 6)
    pool.end_session(c)
    assert in_place == _from_scratch(kv, turn2, 6)
    assert cut == _from_scratch(kv, other, 6)
    assert pool.resident_match(PrefixKey("", [1, 2, 3])) == 0 and pool.inplace_reuses == 2
    pool.close()
    model.close()


def test_new_sessions_keep_live_streams_in_a_run(tiny) -> None:
    """A session with nothing to continue takes the idle stream beside live ones, even over an empty
    one: llama.cpp puts sequences into one ubatch only while their ids run consecutively."""
    model = Model(tiny("llama"))
    pool, cache = create_kv_pool(model, PAGE, n_ctx_seq=256, n_streams=6)
    kv = KvManager(pool, cache)
    prompt = model.tokenize(SYSTEM, add_special=True)
    sessions = [kv.new_session() for _ in range(4)]
    assert [s.seq for s in sessions] == [0, 1, 2, 3]  # empty streams from the first
    kv.eval(sessions[1], prompt)
    pool.end_session(sessions[1])  # stream 1 keeps its rows, streams 4 and 5 are empty
    fresh = kv.new_session(PrefixKey("", [9, 9, 9]))
    assert fresh.seq == 1 and fresh.n_past == 0  # the gap is filled; its rows went
    assert _positions(pool, fresh) == (-1, -1)
    for s in (sessions[0], fresh, sessions[2], sessions[3]):
        pool.end_session(s)
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
        # the first takes the stream the first prompt left in place; the others attach its pages
        assert [r.state.cached_tokens for r in rest] == [shared] + [shared // PAGE * PAGE] * 2
        assert e.pool.inplace_reuses == 1


def test_a_flood_of_conversations_keeps_the_byte_budget_exactly(tiny) -> None:
    """60 distinct conversations, 8 at a time, donate many times what 0.1 MiB holds: the cache
    evicts, never holds a byte over its budget at any step, and lets go of every page once released."""
    with engine(tiny("llama"), ctx_size=512, parallel=8, batch_size=128, prefix_state_mb=0.1) as e:
        cache = e.cache
        requests = [greedy(e.model.tokenize(f"Conversation {i}: " + "words and more words " * 12, add_special=True),
                           max_tokens=4) for i in range(60)]
        for request in requests:
            e.scheduler.submit(request)
        while e.scheduler.has_work():
            e.scheduler.step()
            assert cache.bytes_used <= cache.budget_bytes == int(0.1 * 2**20)
        assert all(r.state.finished for r in requests)
        assert cache.stats().evicted_pages > 0 and cache.bytes_used > cache.budget_bytes // 2
        assert e.scheduler.snapshot.live_sessions == 0
        cache.release()
        assert cache.bytes_used == 0 and cache.held_pages == 0


def test_pages_go_least_recently_used_first(tiny) -> None:
    model = Model(tiny("llama"))
    prompts = [model.tokenize(f"Distinct prompt number {i}: " + "filler words " * 12, add_special=True)
               for i in range(4)]
    pool, cache = create_kv_pool(model, PAGE, n_ctx_seq=256, n_streams=2, budget_bytes=1 << 30)
    kv = KvManager(pool, cache)
    _donate(kv, cache, prompts[0])
    one = cache.bytes_used
    cache.store.budget_bytes = 2 * one  # room for two donations (each as long as the first)
    for prompt in prompts[1:]:
        _donate(kv, cache, prompt)
        assert cache.bytes_used <= cache.budget_bytes
    cached = [cache.match_len(PrefixKey("", prompt)) for prompt in prompts]
    assert cached[-1] > 0 and cached[-2] > 0  # the newest survive
    assert cached[0] == 0 and cached[1] == 0  # the oldest went first
    cache.release()
    pool.close()
    model.close()


def test_each_namespace_is_a_tree_of_its_own_kept_while_it_has_pages(tiny) -> None:
    """The same prompt under two namespaces is two chains, stored twice; eviction and release take
    a namespace's root with its last page; attach refuses a key of another namespace."""
    model = Model(tiny("llama"))
    prompt = model.tokenize(SYSTEM, add_special=True)
    pool, cache = create_kv_pool(model, PAGE, n_ctx_seq=256, n_streams=2, budget_bytes=1 << 30)
    kv = KvManager(pool, cache)
    for namespace in ("tenant:a", "tenant:b"):
        session = kv.new_session(PrefixKey(namespace))
        kv.eval(session, prompt)
        cache.insert(session, session.tokens)
        pool.end_session(session)
    one = cache.bytes_used // 2
    assert set(cache.tree.roots) == cache.namespaces() == {"tenant:a", "tenant:b"}
    assert cache.held_pages == 2 * (len(prompt) // PAGE) and cache.match_len(PrefixKey("", prompt)) == 0
    assert [len(cache.view(ns)["chains"]) for ns in ("tenant:a", "tenant:b", "")] == [1, 1, 0]
    assert cache.view("tenant:a")["held_bytes"] == one
    reader = kv.new_session(PrefixKey("tenant:b"))
    with pytest.raises(ValueError):
        kv.attach(reader, PrefixKey("tenant:a", prompt))
    pool.end_session(reader)
    cache.store.evict(one)  # one namespace's worth: the least recently used tree goes, root and all
    assert set(cache.tree.roots) == {"tenant:b"} and cache.match_len(PrefixKey("tenant:a", prompt)) == 0
    cache.release()
    assert not cache.tree.roots and cache.tree.n_nodes == 0
    pool.close()
    model.close()


def test_cold_pages_go_before_hot_ones(tiny) -> None:
    """Pages no attach has hit (cold) go before pages that were reused, however long ago those were used."""
    model = Model(tiny("llama"))
    pool, cache = create_kv_pool(model, PAGE, n_ctx_seq=256, n_streams=2, budget_bytes=1 << 30)
    kv = KvManager(pool, cache)
    shared = model.tokenize("A shared system prompt: " + "rules and rules " * 12, add_special=True)
    _donate(kv, cache, shared)
    cache.store.budget_bytes = 3 * cache.bytes_used
    reader = kv.new_session()
    hot = kv.attach(reader, PrefixKey("", shared + [5]))
    pool.end_session(reader)
    assert hot >= 2 * PAGE
    for i in range(8):
        _donate(kv, cache, model.tokenize(f"Distinct prompt number {i}: " + "filler words " * 8, add_special=True))
        assert cache.match_len(PrefixKey("", shared + [5])) == hot
        assert cache.bytes_used <= cache.budget_bytes
    assert cache.stats().evicted_pages > 0 and cache.tree.n_cold > 0
    cold = [node for node in cache.tree.leaves_first() if not node.hits]
    cache.store.evict(sum(cache.store.peek(node).nbytes for node in cold))  # exactly the cold pages' bytes
    assert not any(node.alive for node in cold)
    assert cache.tree.n_cold == 0 and cache.match_len(PrefixKey("", shared + [5])) == hot
    cache.release()
    pool.close()
    model.close()


def test_users_arriving_together_compute_their_shared_prefix_once(tiny) -> None:
    """Four prompts on one system prompt, submitted at once: the first prefills it, the others wait
    for its donation and attach it (gains from waiting), and all generate what they would alone."""
    path = tiny("llama")
    with engine(path, prefix_cache=False) as e:
        prompts = [_chat(path, f" Question {i}: what is the colour of object number {i}?", e) for i in range(4)]
        alone = [run(e, [r])[r.id] for r in [greedy(p, max_tokens=6) for p in prompts]]
    shared = next(i for i, (x, y) in enumerate(zip(prompts[0], prompts[1])) if x != y)
    with engine(path) as e:
        requests = [greedy(p, max_tokens=6) for p in prompts]
        outs = run(e, requests)
        assert [outs[r.id] for r in requests] == alone
        assert requests[0].state.cached_tokens == 0
        assert all(r.state.cached_tokens == shared // PAGE * PAGE for r in requests[1:])


def test_n_choices_fork_by_copying_the_prompt_stream(tiny) -> None:
    """`n` > 1: choice 0 prefills the prompt, the others get a copy of its stream; greedy, every
    choice generates what the prompt alone does."""
    with engine(tiny("llama")) as e:
        prompt = _chat(None, " Tell me a story.", e)
        single = greedy(prompt, max_tokens=8)
        expected = run(e, [single])[single.id]
        fanned = greedy(prompt, max_tokens=8, n=3)
        e.scheduler.submit(fanned)
        tokens: dict[int, list[int]] = {0: [], 1: [], 2: []}
        while e.scheduler.has_work():
            for output in e.scheduler.step():
                for delta in output.deltas:
                    tokens[delta.index] += delta.token_ids
        assert [tokens[i] for i in range(3)] == [expected] * 3
        assert e.scheduler.snapshot.live_sessions == 0


def test_choices_that_end_as_they_fork_leave_no_copy_behind(tiny) -> None:
    """An `n` = 2 request that ends in the step its choices fork (one token each) hands both streams
    back at once. Later requests in those streams (one attached from pages, one continued in place)
    still generate what they do from scratch: no copy of the fork lands on them afterwards."""
    path = tiny("llama")
    with engine(path, prefix_cache=False, parallel=2) as e:
        a = _chat(path, " Apples and oranges grow in the valley orchard." * 6, e)
        b = _chat(path, " Ships sail past the harbour lights at night." * 6, e)
        scratch = {name: run(e, [r])[r.id] for name, r in (("a", greedy(a, max_tokens=8)), ("b", greedy(b, max_tokens=8)))}
    with engine(path, parallel=2) as e:
        assert run(e, [r := greedy(b, max_tokens=8)])[r.id] == scratch["b"]
        run(e, [greedy(a, max_tokens=1, n=2)])
        again_b, again_a = greedy(b, max_tokens=8), greedy(a, max_tokens=8)
        assert run(e, [again_b])[again_b.id] == scratch["b"]
        assert run(e, [again_a])[again_a.id] == scratch["a"]
        assert again_a.state.cached_tokens > 0 and again_b.state.cached_tokens > 0


def test_a_conversations_next_turn_continues_in_its_stream(tiny) -> None:
    """Turn 2 starts with turn 1's prompt and answer: it is placed in the stream turn 1 left, keeps
    all it holds (the answer's last token was never evaluated) and generates what it would from
    scratch. Counted, in the engine's snapshot as in /metrics."""
    path = tiny("llama")
    with engine(path) as e:
        turn1 = greedy(_chat(path, " First question?", e), max_tokens=6)
        answer = run(e, [turn1])[turn1.id]
        prompt2 = turn1.prompt + answer + e.model.tokenize(" Second question?", add_special=False)
        turn2 = greedy(prompt2, max_tokens=6)
        in_place = run(e, [turn2])[turn2.id]
        assert turn2.state.cached_tokens == len(turn1.prompt) + len(answer) - 1
        assert e.scheduler.snapshot.inplace_reuses == 1
        assert e.scheduler.snapshot.inplace_tokens == turn2.state.cached_tokens
    with engine(path, prefix_cache=False) as e:
        scratch = greedy(prompt2, max_tokens=6)
        assert run(e, [scratch])[scratch.id] == in_place

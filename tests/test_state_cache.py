"""Checkpoints for models that carry state (tiny LFM2 hybrid and Mamba, with SmolLM2's real chat
template): restoring equals computing from scratch, conversations skip what they share, and the
byte budget holds."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from conftest import engine, greedy, run
from kvserve.cache import (
    MarkKind, PrefixKey, StateCache, add_assistant, add_user, create_chat_renderer, create_kv_pool, render_turn_marked,
)
from kvserve.scheduler.kv_manager import KvManager
from kvserve.cache.chat_marks import mark_messages
from kvserve.llama.model import Model

STATE_ARCHS = ("lfm2", "mamba")
SYSTEM = "You are a terse assistant for a shipping company. Answer in one sentence about parcels and routes."


def _greedy(kv: KvManager, session, logits: np.ndarray, n: int) -> list[int]:
    out = []
    for _ in range(n):
        out.append(int(np.argmax(logits)))
        logits = kv.eval(session, [out[-1]])
    return out


@pytest.mark.parametrize("arch", STATE_ARCHS)
def test_restored_checkpoint_equals_scratch_by_hand(tiny, arch: str) -> None:
    model = Model(tiny(arch))
    pool, cache = create_kv_pool(model, 16, n_ctx_seq=512, n_streams=3, max_states=4, budget_bytes=1 << 20)
    kv = KvManager(pool, cache)
    assert isinstance(cache, StateCache)
    chat_a = create_chat_renderer(model, SYSTEM)
    add_user(chat_a, "Where is parcel 17?")
    turn_a = render_turn_marked(model, chat_a)
    a = kv.new_session()
    stop = cache.checkpoint_at(a, turn_a.tokens, 0, turn_a.opening)
    assert stop == turn_a.opening > 16
    kv.eval(a, turn_a.tokens[:stop])
    cache.insert(a, a.tokens, kind=MarkKind.OPENING)  # between two evals: the state where A stands
    _greedy(kv, a, kv.eval(a, turn_a.tokens[stop:]), 4)
    pool.end_session(a)

    chat_b = create_chat_renderer(model, SYSTEM)
    add_user(chat_b, "How long does a route to Oslo take?")
    turn_b = render_turn_marked(model, chat_b)
    assert turn_b.opening == turn_a.opening  # the opening does not depend on the question
    assert cache.match_len(PrefixKey("", turn_b.tokens)) == turn_b.opening
    b = kv.new_session()
    assert kv.attach(b, PrefixKey("", turn_b.tokens)) == turn_b.opening
    assert cache.checkpoint_at(b, turn_b.tokens, b.n_past, turn_b.opening) == 0  # already cached there
    restored = _greedy(kv, b, kv.eval(b, turn_b.tokens[b.n_past :]), 12)
    pool.end_session(b)
    scratch = kv.new_session()
    assert _greedy(kv, scratch, kv.eval(scratch, turn_b.tokens), 12) == restored
    pool.end_session(scratch)
    assert cache.view("")["checkpoints"][0]["kind"] == "opening" and cache.view("")["checkpoints"][0]["hits"] == 1
    cache.release()
    pool.close()
    model.close()


def _tokens_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """The bug the namespace test must catch: a checkpoint matched on its tokens, whoever saved it."""
    real = StateCache._match
    monkeypatch.setattr(StateCache, "_match", lambda self, key: next(
        (c for c in (real(self, PrefixKey(c.namespace, key.tokens)) for c in self.checkpoints) if c), None))


@pytest.mark.parametrize("mutant", [None, _tokens_alone])
def test_checkpoints_stay_in_their_namespace(tiny, monkeypatch: pytest.MonkeyPatch, mutant) -> None:
    if mutant is None:
        _checkpoints_stay_in_their_namespace(tiny("lfm2"))
        return
    mutant(monkeypatch)
    with pytest.raises(AssertionError):
        _checkpoints_stay_in_their_namespace(tiny("lfm2"))


def _checkpoints_stay_in_their_namespace(path) -> None:
    """A checkpoint (and the stream it was taken in) serves only keys of its own namespace."""
    model = Model(path)
    pool, cache = create_kv_pool(model, 16, n_ctx_seq=512, n_streams=2, max_states=4, budget_bytes=1 << 20)
    kv = KvManager(pool, cache)
    chat = create_chat_renderer(model, SYSTEM)
    add_user(chat, "Where is parcel 17?")
    turn = render_turn_marked(model, chat)
    key_a, key_b = PrefixKey("tenant:a", turn.tokens), PrefixKey("tenant:b", turn.tokens)
    a = kv.new_session(PrefixKey("tenant:a"))
    kv.eval(a, turn.tokens[: turn.opening])
    cache.insert(a, a.tokens, kind=MarkKind.OPENING)
    pool.end_session(a)
    assert cache.match_len(key_a) == pool.resident_match(key_a) == turn.opening
    assert cache.match_len(key_b) == pool.resident_match(key_b) == 0
    b = kv.new_session(PrefixKey("tenant:b"))
    assert kv.attach(b, key_b) == 0 and b.tokens == ()
    with pytest.raises(ValueError):
        kv.attach(b, key_a)  # a session reads only its own namespace's rows
    assert cache.checkpoint_at(b, turn.tokens, 0, turn.opening) == turn.opening  # B has none there yet
    assert cache.view("tenant:b")["checkpoints"] == [] and len(cache.view("tenant:a")["checkpoints"]) == 1
    pool.end_session(b)
    cache.release()
    pool.close()
    model.close()


def test_attention_models_take_no_checkpoints(tiny) -> None:
    model = Model(tiny("llama"))
    pool, cache = create_kv_pool(model, 16, n_ctx_seq=256, n_streams=2)
    kv = KvManager(pool, cache)
    chat = create_chat_renderer(model, SYSTEM)
    add_user(chat, "hello")
    turn = render_turn_marked(model, chat)
    session = kv.new_session()
    assert all(cache.checkpoint_at(session, turn.tokens, 0, mark.position) == 0 for mark in turn.checkpoint_marks())
    pool.end_session(session)
    cache.release()
    pool.close()
    model.close()


def _chat_request(e, messages: list[dict], max_tokens: int = 8):
    turn = mark_messages(e.model, e.template, messages)
    request = greedy(turn.tokens, max_tokens=max_tokens, marks=turn.checkpoint_marks())
    return request, turn


@pytest.mark.parametrize("arch", STATE_ARCHS)
def test_conversations_prefill_only_what_they_do_not_share(tiny, arch: str) -> None:
    path = tiny(arch)
    first = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Where is parcel 17?"}]
    other = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Is the Oslo route open today?"}]
    with engine(path, prefix_cache=False) as e:
        scratch = {}
        for name, messages in (("first", first), ("other", other)):
            r, _ = _chat_request(e, messages)
            scratch[name] = run(e, [r])[r.id]
    with engine(path) as e:
        r1, t1 = _chat_request(e, first)
        out1 = run(e, [r1])[r1.id]
        assert out1 == scratch["first"] and r1.state.cached_tokens == 0
        # A second conversation on the same system prompt prefills only what follows its opening.
        r2, t2 = _chat_request(e, other)
        assert run(e, [r2])[r2.id] == scratch["other"]
        assert r2.state.cached_tokens == t2.opening == t1.opening > 0
        # The next turn of the first conversation prefills at most what follows its last message's
        # close; when the answer re-tokenizes to what was generated, it resumes at the turn's end.
        reply = e.model.detokenize(out1)
        turn2 = first + [{"role": "assistant", "content": reply}, {"role": "user", "content": "And parcel 18?"}]
        r3, t3 = _chat_request(e, turn2)
        out3 = run(e, [r3])[r3.id]
        end_of_turn = len(r1.prompt) + len(out1) - 1  # the last sampled token was never evaluated
        roundtrips = t3.tokens[:end_of_turn] == r1.prompt + out1[:-1]
        assert r3.state.cached_tokens == (end_of_turn if roundtrips else t1.close)
        assert t3.tokens[: t1.close] == t1.tokens[: t1.close]
    with engine(path, prefix_cache=False) as e:
        r, _ = _chat_request(e, turn2)
        assert run(e, [r])[r.id] == out3


@pytest.mark.parametrize("arch", STATE_ARCHS)
def test_flood_keeps_the_budget_and_evicts_conversations_first(tiny, arch: str) -> None:
    path = tiny(arch)
    with engine(path, prefix_states=16) as e:
        cache = e.cache
        systems = [SYSTEM, "You are a poet who answers in rhymes about the sea, the wind and ships."]
        longest, _ = _chat_request(e, [{"role": "system", "content": systems[1]},
                                       {"role": "user", "content": "Question number 11: what happened on day 77?"}])
        probe = e.scheduler.kv.new_session()
        e.scheduler.kv.eval(probe, longest.prompt + [5, 5])
        state_size = e.pool.ctx.state_size(probe.seq)  # a hybrid's state holds its attention rows: the largest
        e.pool.end_session(probe)
        # Room for four states: two openings, the running turn's locked close, and its end-of-turn,
        # so every older conversation checkpoint must go before an opening does.
        cache.store.budget_bytes = 4 * state_size
        peak = 0
        for i in range(12):
            messages = [{"role": "system", "content": systems[i % 2]},
                        {"role": "user", "content": f"Question number {i}: what happened on day {i * 7}?"}]
            request, _ = _chat_request(e, messages, max_tokens=2)
            e.scheduler.submit(request)
            while not request.state.finished or e.scheduler.running:
                e.scheduler.step()
                peak = max(peak, cache.bytes_used)
                assert cache.bytes_used <= cache.budget_bytes
        kinds = [c["kind"] for c in cache.view("")["checkpoints"]]
        assert kinds.count("opening") == 2, kinds  # both system openings kept
        assert cache.stats().state_evictions > 0 and peak > 2 * state_size

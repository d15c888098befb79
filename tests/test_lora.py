"""LoRA adapters per request, on real llama.cpp with SmolLM2 and random adapters (kvserve.testing.lora_adapters).

What holds: scale 0 is the base model; an adapter changes the greedy output; a request under adapter
A served among requests under B and the base answers as A served alone, from scratch; A's cached rows
are never attached to B (the adapter set is part of the cache namespace), and a wrong namespace fails
that check. Over HTTP: `"model": NAME` and llama-server's `lora` field pick the same adapter, and
`/v1/models` lists the adapters.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import numpy as np
import pytest

from conftest import engine, greedy, run_traced, serve, served
from equality import SMOLLM2_TOLERANCE, TOP, assert_like_alone
from kvserve.cache import create_kv_pool
from kvserve.scheduler.kv_manager import KvManager
from kvserve.llama.lora import BASE, AdapterSet, LoraAdapters, adapter_set, describe
from kvserve.llama.model import Model
from kvserve.scheduler.engine import Engine
from kvserve.server.namespace import request_namespace
from kvserve.testing import free_port
from kvserve.testing.lora_adapters import lora_adapter

SYSTEM = "You are a helpful assistant who answers in one short sentence. " * 3
QUESTION = "Question: what is the capital of France, and why is it famous?"
A: AdapterSet = (("A", 1.0),)
B: AdapterSet = (("B", 1.0),)
SMALL = dict(ctx_size=512, parallel=4, batch_size=256)


@pytest.fixture(scope="module")
def adapters(smollm2: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    directory = tmp_path_factory.mktemp("lora")
    return {"A": lora_adapter(smollm2, directory, seed=1), "B": lora_adapter(smollm2, directory, seed=2)}


def _lora(adapters: dict[str, Path]) -> list[str]:
    return [f"{name}={path}" for name, path in adapters.items()]


def test_adapter_sets_are_canonical() -> None:
    assert adapter_set([("B", 0.5), ("A", 1), ("C", 0.0)]) == (("A", 1.0), ("B", 0.5))
    assert adapter_set([("A", 0.0)]) == BASE  # scale 0: the base model, and its cache namespace
    assert adapter_set([("A", 1.0), ("A", 0.25)]) == (("A", 0.25),)  # the last scale given wins
    assert describe(adapter_set([("B", 0.5), ("A", 1)])) == "A*1.0,B*0.5"
    with pytest.raises(ValueError, match="finite"):
        adapter_set([("A", float("nan"))])


def test_the_planner_serves_each_adapter_set_in_turn() -> None:
    """The set with work served least recently goes next: three sets take turns whatever their sizes,
    a set that arrives late is served at once, and one that leaves no longer takes a turn."""
    from types import SimpleNamespace

    from kvserve.scheduler.batch_plan import BatchPlanner

    planner = BatchPlanner(None, None, None, None)  # type: ignore[arg-type]  # only the set choice runs
    running = [SimpleNamespace(adapters=a) for a in (A, A, A, B, BASE)]
    assert [planner._next_adapters(running) for _ in range(6)] == [A, B, BASE, A, B, BASE]
    late = (("C", 0.5),)
    running.append(SimpleNamespace(adapters=late))
    assert planner._next_adapters(running) == late
    assert [planner._next_adapters(running[3:]) for _ in range(3)] == [B, BASE, late]


def test_scale_zero_is_the_base_model_and_an_adapter_changes_greedy_output(smollm2: Path,
                                                                           adapters: dict[str, Path]) -> None:
    """On llama.cpp itself: a zero scale set on the context (not dropped by kvserve) gives the base
    logits bit for bit; the adapter at scale 1 gives other greedy tokens."""
    model = Model(smollm2)
    lora = LoraAdapters(model, adapters)
    pool, cache = create_kv_pool(model, n_ctx_seq=256, n_streams=1, enabled=False)
    kv = KvManager(pool, cache)
    prompt = model.tokenize(SYSTEM + QUESTION, add_special=True)

    def greedy_tokens(n: int = 12) -> tuple[np.ndarray, list[int]]:
        session = kv.new_session()
        first = logits = kv.eval(session, prompt)
        out = []
        for _ in range(n):
            out.append(int(np.argmax(logits)))
            logits = kv.eval(session, [out[-1]])
        pool.end_session(session)
        return first, out

    try:
        base_logits, base = greedy_tokens()
        assert lora.apply(pool.ctx, (("A", 0.0),))
        zero_logits, zero = greedy_tokens()
        assert lora.apply(pool.ctx, A)
        _, under_a = greedy_tokens()
        assert lora.apply(pool.ctx, BASE)
        again_logits, _ = greedy_tokens()
    finally:
        cache.release()
        pool.close()
        lora.close()
        model.close()
    assert np.array_equal(zero_logits, base_logits) and zero == base
    assert under_a != base
    assert np.array_equal(again_logits, base_logits)  # clearing the adapters restores the base model


def _request(prompt: list[int], adapters: AdapterSet, namespace_of=lambda a: a):
    """A greedy request under `adapters`, in the namespace of `namespace_of(adapters)` (the server's
    rule: the adapter set is part of the namespace)."""
    return greedy(prompt, max_tokens=8, logprobs=TOP, adapters=adapters,
                  namespace=request_namespace(tenant=None, cache_salt=None, adapters=describe(namespace_of(adapters))))


def _alone(smollm2: Path, adapters: dict[str, Path], prompt: list[int], sets: list[AdapterSet]) -> dict:
    """Each set's output for `prompt`, each served alone in a fresh engine with the cache off."""
    out = {}
    with engine(smollm2, prefix_cache=False, lora=_lora(adapters), **SMALL) as e:
        for adapter_set_ in sets:
            request = _request(prompt, adapter_set_)
            out[adapter_set_] = run_traced(e, [request])[request.id]
    return out


def test_a_request_among_other_adapter_sets_answers_as_alone(smollm2: Path, adapters: dict[str, Path]) -> None:
    """A, B and the base together (two of A): every step carries one adapter set, the planner
    alternates between them, and each request answers as it does alone."""
    with engine(smollm2, lora=_lora(adapters), **SMALL) as e:
        prompt = e.model.tokenize(SYSTEM + QUESTION, add_special=True)
        other = e.model.tokenize(SYSTEM + "Question: name three rivers of Europe.", add_special=True)
        together = [_request(prompt, A), _request(prompt, B), _request(prompt, BASE), _request(other, A)]
        outs = run_traced(e, together)
        assert e.scheduler.times.adapter_switches >= 4  # interleaved, not one set after the other
    alone = _alone(smollm2, adapters, prompt, [A, B, BASE])
    assert len({tuple(t.token for t in outs[r.id]) for r in together[:3]}) == 3  # three different answers
    for request in together[:3]:
        assert_like_alone(alone[request.adapters], outs[request.id], SMOLLM2_TOLERANCE)


def _check_b_never_attaches_a(e: Engine, prompt: list[int], alone_b: list, namespace_of) -> None:
    first_a = _request(prompt, A, namespace_of)
    run_traced(e, [first_a])  # A's rows: donated as pages, and left in A's stream
    b = _request(prompt, B, namespace_of)
    out_b = run_traced(e, [b])[b.id]
    assert b.state.cached_tokens == 0, "B attached rows computed under A"
    assert_like_alone(alone_b, out_b, SMOLLM2_TOLERANCE)
    again_a = _request(prompt, A, namespace_of)
    run_traced(e, [again_a])
    assert again_a.state.cached_tokens > 0  # A's own rows still serve A


@pytest.fixture(scope="module")
def alone_b(smollm2: Path, adapters: dict[str, Path]) -> tuple[list[int], list]:
    model = Model(smollm2)
    prompt = model.tokenize(SYSTEM + QUESTION, add_special=True)
    model.close()
    return prompt, _alone(smollm2, adapters, prompt, [B])[B]


def test_a_cached_rows_are_never_attached_to_b(smollm2: Path, adapters: dict[str, Path], alone_b) -> None:
    prompt, out_b = alone_b
    with engine(smollm2, lora=_lora(adapters), **SMALL) as e:
        _check_b_never_attaches_a(e, prompt, out_b, lambda a: a)


def test_one_namespace_for_every_adapter_set_fails_that_check(smollm2: Path, adapters: dict[str, Path],
                                                               alone_b) -> None:
    """The mutation: B's request in A's namespace attaches A's rows, and the check sees it."""
    prompt, out_b = alone_b
    with engine(smollm2, lora=_lora(adapters), **SMALL) as e:
        with pytest.raises(AssertionError, match="B attached rows computed under A"):
            _check_b_never_attaches_a(e, prompt, out_b, lambda a: A)


# -- over HTTP ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def url(smollm2: Path, adapters: dict[str, Path]):
    with serve(smollm2, lora=_lora(adapters), **SMALL) as base_url:
        yield base_url


def _chat(url: str, **extra) -> httpx.Response:
    body = {"model": "any", "max_tokens": 8, "temperature": 0, "messages": [{"role": "user", "content": QUESTION}]}
    return httpx.post(f"{url}/v1/chat/completions", json={**body, **extra}, timeout=300)


def test_models_lists_the_adapters(url: str) -> None:
    ids = [m["id"] for m in httpx.get(f"{url}/v1/models").json()["data"]]
    assert ids[1:] == ["A", "B"] and len(ids) == 3
    adapters = httpx.get(f"{url}/lora-adapters").json()
    assert [(a["id"], a["name"], a["scale"]) for a in adapters] == [(0, "A", 1.0), (1, "B", 1.0)]


def test_model_name_and_lora_field_pick_the_same_adapter(url: str) -> None:
    by_name = _chat(url, model="A").json()
    by_id = _chat(url, lora=[{"id": 0, "scale": 1.0}]).json()
    base = _chat(url).json()
    zero = _chat(url, model="A", lora=[{"id": 0, "scale": 0.0}]).json()  # the field's scale wins: the base
    text = [r["choices"][0]["message"]["content"] for r in (by_name, by_id, base, zero)]
    assert text[0] == text[1] != text[2] == text[3]
    assert by_name["model"] == "A" and base["model"] != "A"


@pytest.mark.parametrize("lora", [[{"id": 2, "scale": 1.0}], [{"id": -1}], [{"id": 0, "scale": "x"}], {"id": 0}])
def test_a_bad_lora_field_is_a_400_naming_it(url: str, lora: object) -> None:
    response = _chat(url, lora=lora)
    assert response.status_code == 400
    assert response.json()["error"]["param"].startswith("lora")


NAN_SCALE = 1e6  # SmolLM2's activations overflow under adapter A at this scale: every logit is NaN


@pytest.mark.parametrize("stream", [False, True])
def test_a_scale_that_makes_the_logits_nan_is_a_400_not_an_empty_reply(url: str, stream: bool) -> None:
    """Greedy took token 0 of a NaN row (end-of-text) and answered an empty 200; a draw answered noise."""
    import openai

    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    nan = {"lora": [{"id": 0, "scale": NAN_SCALE}]}
    with pytest.raises(openai.BadRequestError, match=r"logits are nan .* LoRA adapters A\*1000000\.0"):
        client.chat.completions.create(model="any", messages=[{"role": "user", "content": QUESTION}], max_tokens=4,
                                       temperature=0, stream=stream, extra_body=nan)
    with pytest.raises(openai.BadRequestError, match="scale is too large"):
        client.completions.create(model="any", prompt=QUESTION, max_tokens=4, temperature=1.0, stream=stream,
                                  logprobs=2, extra_body=nan)
    assert _chat(url, model="A").status_code == 200  # the engine serves on


def test_a_served_scale_that_makes_the_logits_nan_is_an_anthropic_400(smollm2: Path, adapters: dict[str, Path]) -> None:
    """`--lora-scale` reaches the logits as a request's scale does, under every API."""
    import anthropic

    with serve(smollm2, lora=_lora(adapters), lora_scale=NAN_SCALE, **SMALL) as url:
        client = anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0)
        with pytest.raises(anthropic.BadRequestError, match="logits are nan"):
            client.messages.create(model="A", max_tokens=4, messages=[{"role": "user", "content": QUESTION}])
        answer = client.messages.create(model="any", max_tokens=4, messages=[{"role": "user", "content": QUESTION}])
    assert answer.content[0].text


def test_an_adapter_llama_cpp_cannot_load_is_one_line_and_exit_2(tmp_path: Path, tiny, adapters) -> None:
    """Not a GGUF, and an adapter of another base model (the tiny llama's): refused before serving."""
    import subprocess
    import sys

    garbage = tmp_path / "garbage.gguf"
    garbage.write_text("not a gguf")
    other_base = lora_adapter(tiny("llama"), tmp_path, seed=1)
    for path, says in ((garbage, "invalid magic"), (other_base, "incorrect shape")):
        done = subprocess.run([sys.executable, "-m", "kvserve", "--port", str(free_port()),
                               "--lora", f"A={adapters['A']}", "--lora", f"X={path}"],
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 2
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1 and "could not load the adapter 'X'" in lines[0] and says in lines[0], done.stderr


def test_a_name_given_another_adapter_file_after_a_restart_attaches_none_of_its_rows(
        smollm2: Path, adapters: dict[str, Path], tmp_path: Path) -> None:
    """The disk tier outlives the process, and an adapter's name may point at another file in the
    next one: rows are named by the adapter's file too, so `A` served from B's file attaches none of
    what `A` computed from A's file, and answers as B's file does from scratch (rows of A's file
    once attached: 64 cached tokens and other logprobs). `/v1/prefix/match` says the same."""
    long = {"messages": [{"role": "system", "content": SYSTEM * 3}, {"role": "user", "content": QUESTION}],
            "model": "A", "max_tokens": 4, "temperature": 0, "logprobs": True}
    folder = tmp_path / "disk"
    with serve(smollm2, lora=[f"A={adapters['A']}"], prefix_disk_dir=folder, **SMALL) as url:
        first = httpx.post(f"{url}/v1/chat/completions", json=long, timeout=300).json()
        assert first["usage"]["prompt_tokens"] > 64
    with serve(smollm2, lora=[f"A={adapters['B']}"], prefix_disk_dir=folder, **SMALL) as url:
        match = httpx.post(f"{url}/v1/prefix/match", json=long, timeout=60).json()
        again = httpx.post(f"{url}/v1/chat/completions", json=long, timeout=300).json()
    with serve(smollm2, lora=[f"A={adapters['B']}"], **SMALL) as url:
        alone = httpx.post(f"{url}/v1/chat/completions", json=long, timeout=300).json()
    assert match["page_tokens"] == 0 and again["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    tokens = [[t["logprob"] for t in r["choices"][0]["logprobs"]["content"]] for r in (again, alone)]
    assert again["choices"][0]["message"]["content"] == alone["choices"][0]["message"]["content"]
    assert np.allclose(tokens[0], tokens[1], atol=SMOLLM2_TOLERANCE), tokens


def test_prefix_match_answers_for_the_adapters_the_body_names(url: str) -> None:
    """`/v1/prefix/match` looks in the namespace the same body would be served in: after a base-model
    request, the adapter's match is what the adapter's request attaches (none), not the base's."""
    long = {"messages": [{"role": "system", "content": SYSTEM * 3}, {"role": "user", "content": "Say hi."}],
            "max_tokens": 2, "temperature": 0}
    assert httpx.post(f"{url}/v1/chat/completions", json=long, timeout=300).status_code == 200
    base = httpx.post(f"{url}/v1/prefix/match", json=long, timeout=60).json()
    for pick in ({"model": "A"}, {"lora": [{"id": 1, "scale": 1.0}]}):
        matched = httpx.post(f"{url}/v1/prefix/match", json={**long, **pick}, timeout=60).json()
        served = httpx.post(f"{url}/v1/chat/completions", json={**long, **pick}, timeout=300).json()
        assert base["page_tokens"] > 0 and matched["page_tokens"] == 0, (base, matched)
        assert served["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert httpx.post(f"{url}/v1/prefix/match", json={**long, "lora": [{"id": 5}]}, timeout=60).status_code == 400


def test_disk_events_name_the_adapters_of_their_pages_across_a_restart(
        smollm2: Path, adapters: dict[str, Path], tmp_path: Path) -> None:
    """A page computed under adapter A is announced with A's `lora_name` when it enters host memory,
    when it reaches the disk, and when a restarted server announces the disk: a router keying blocks
    by tokens and adapter (as llm-d does) files them under A each time (the disk's events once said
    None: the base model's)."""
    from test_kv_events_served import _caught_up

    from kvserve.testing.kv_events import BlockStored, Subscriber

    options = dict(lora=[f"A={adapters['A']}"], prefix_disk_dir=tmp_path / "disk", model_alias="m",
                   kv_events="tcp://127.0.0.1:*", kv_events_replay="tcp://127.0.0.1:*", **SMALL)
    body = {"model": "A", "max_tokens": 2, "temperature": 0,
            "messages": [{"role": "system", "content": SYSTEM * 3}, {"role": "user", "content": QUESTION}]}
    names: list[dict[str, set]] = []
    for run in range(2):
        with served(smollm2, **options) as (url, app):
            publisher = app.state.models.persistence.publisher
            subscriber = Subscriber(publisher.endpoint, publisher.replay_endpoint, "kv@")
            try:
                if run == 0:
                    assert httpx.post(f"{url}/v1/chat/completions", json=body, timeout=300).status_code == 200
                _caught_up(app, subscriber)
                stored = [e for _, _, e in subscriber.events if isinstance(e, BlockStored)]
                names.append({medium: {e.lora_name for e in stored if e.medium == medium} for medium in ("cpu", "disk")})
            finally:
                subscriber.close()
    assert names[0] == {"cpu": {"A*1.0"}, "disk": {"A*1.0"}}, names
    assert names[1] == {"cpu": set(), "disk": {"A*1.0"}}, names

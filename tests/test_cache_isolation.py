"""Cache namespaces as an attacker meets them: tenant B sends tenant A's exact prompt and must learn
nothing (no cached tokens, the whole prompt evaluated, no hit in /v1/prefix/match or /v1/cache),
while A's own next turn still hits; `cache_salt` splits further; `--cache-isolation none` shares.
Outputs under namespaces equal the cache off, and matching on tokens alone fails these checks."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from conftest import engine, greedy, run_traced, serve
from equality import SMOLLM2_TOLERANCE, TOP, assert_like_alone
from kvserve.cache import PrefixKey
from kvserve.cache.page_tree import PageTree
from kvserve.cache.kv_pool import StreamPool
from kvserve.scheduler.engine import Engine
from kvserve.server.namespace import request_namespace, tenant_id
from kvserve.testing import read_metrics

KEY_A, KEY_B = "sk-tenant-alpha", "sk-tenant-beta"
SYSTEM = "You are the archivist of a large library. Answer with the shelf number and nothing else. " * 3
SECRET = "My account number is 4417-2290. Where is Dune?"
HITS = "kvserve_prefix_cache_hit_tokens_total"
KIND_QUERIED = "kvserve_prefix_cache_namespace_queried_tokens_total"
KIND_HITS = "kvserve_prefix_cache_namespace_hit_tokens_total"


def _chat(question: str, **extra) -> dict:
    return {"model": "any", "max_tokens": 4, "temperature": 0, **extra,
            "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]}


def _post(url: str, key: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}{path}", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=120)


def _chat_cached(url: str, key: str, body: dict) -> int:
    response = _post(url, key, "/v1/chat/completions", body)
    assert response.status_code == 200, response.text
    return response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def _match(url: str, key: str, body: dict) -> int:
    return _post(url, key, "/v1/prefix/match", body).json()["cached_tokens"]


def _view(url: str, key: str, **params: str) -> dict:
    return httpx.get(f"{url}/v1/cache", params=params, headers={"Authorization": f"Bearer {key}"}).json()


def _chains(url: str, key: str, **params: str) -> list[dict]:
    return _view(url, key, **params)["chains"]


@pytest.fixture(scope="module")
def keys_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("keys") / "keys.txt"
    path.write_text(f"# two tenants\n{KEY_A}\n{KEY_B}\n")
    return path


@pytest.fixture(scope="module")
def url(smollm2, keys_file):
    with serve(smollm2, api_key_file=keys_file) as base:
        yield base


def test_tenant_b_learns_nothing_of_tenant_as_prompt(url: str) -> None:
    secret = _chat(SECRET)
    assert _chat_cached(url, KEY_A, secret) == 0

    # B probes before sending: no hit, no chain of A's; the same probes by A do see them
    assert _match(url, KEY_B, secret) == 0
    assert _match(url, KEY_A, secret) > 48
    assert not any("4417" in chain["preview"] for chain in _chains(url, KEY_B))
    assert any("4417" in chain["preview"] for chain in _chains(url, KEY_A))
    # A's stream, resident for its next turn, is A's to see: B sees only that a stream is taken
    streams_b = {s["state"] for s in _view(url, KEY_B)["pool"]["stream_states"]}
    streams_a = [s for s in _view(url, KEY_A)["pool"]["stream_states"] if s["state"] == "resident"]
    assert "resident" not in streams_b and "other" in streams_b and streams_a and streams_a[0]["tokens"] > 48

    before = read_metrics(url)
    response = _post(url, KEY_B, "/v1/chat/completions", secret).json()
    after = read_metrics(url)
    assert response["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    # the server evaluated B's whole prompt: no token of it counted as a hit, all of it queried
    assert after.value(HITS) == before.value(HITS)
    assert after.value(KIND_HITS, namespace_kind="tenant") == before.value(KIND_HITS, namespace_kind="tenant")
    assert after.value(KIND_QUERIED, namespace_kind="tenant") - before.value(
        KIND_QUERIED, namespace_kind="tenant") == response["usage"]["prompt_tokens"]
    assert after.value("kvserve_prefix_cache_namespaces") >= 2  # A's rows and B's, apart

    # A's own next turn still hits what A's first turn computed
    turn2 = _chat(SECRET)
    turn2["messages"] += [{"role": "assistant", "content": "Shelf 12."}, {"role": "user", "content": "And Emma?"}]
    assert _chat_cached(url, KEY_A, turn2) > 48


def test_cache_salt_splits_a_tenants_namespace(url: str) -> None:
    plain = _chat("Where is Ulysses?")
    _chat_cached(url, KEY_A, plain)
    assert _match(url, KEY_A, plain) > 48  # A's own namespace holds the prompt now
    assert _chat_cached(url, KEY_A, _chat("Where is Ulysses?", cache_salt="s1")) == 0
    assert _match(url, KEY_A, _chat("Where is Walden?", cache_salt="s1")) > 48
    assert _match(url, KEY_A, _chat("Where is Walden?", cache_salt="s2")) == 0
    assert _match(url, KEY_B, _chat("Where is Walden?", cache_salt="s1")) == 0  # a salt does not cross tenants
    assert _chat_cached(url, KEY_A, _chat("Where is Walden?", cache_salt="s1")) > 48
    assert any("Walden" in c["preview"] for c in _chains(url, KEY_A, cache_salt="s1"))
    assert not any("Walden" in c["preview"] for c in _chains(url, KEY_A))


def test_every_api_takes_a_cache_salt(url: str) -> None:
    """Chat, completions, Responses and Messages (in `metadata`): a new salt attaches nothing, the
    same salt again attaches the prefix its first request computed."""
    completion = {"model": "any", "max_tokens": 2, "temperature": 0, "prompt": SYSTEM + "Where is Odyssey?"}
    response = {"model": "any", "max_output_tokens": 2, "temperature": 0, "instructions": SYSTEM,
                "input": "Where is Odyssey?", "store": False}
    message = {"model": "any", "max_tokens": 2, "temperature": 0, "system": SYSTEM,
               "messages": [{"role": "user", "content": "Where is Odyssey?"}]}
    cases = [
        ("/v1/completions", lambda salt: {**completion, "cache_salt": salt},
         lambda body: body["usage"]["prompt_tokens_details"]["cached_tokens"]),
        ("/v1/responses", lambda salt: {**response, "cache_salt": salt},
         lambda body: body["usage"]["input_tokens_details"]["cached_tokens"]),
        ("/v1/messages", lambda salt: {**message, "metadata": {"cache_salt": salt}},
         lambda body: body["usage"]["cache_read_input_tokens"]),
    ]
    for path, body, cached in cases:
        _post(url, KEY_A, path, body(None))  # unsalted: rows of A's own namespace
        first = _post(url, KEY_A, path, body(f"salt-{path}"))
        assert first.status_code == 200, first.text
        assert cached(first.json()) == 0, path
        again = _post(url, KEY_A, path, body(f"salt-{path}"))
        assert cached(again.json()) > 48, path


def test_a_stored_response_is_its_keys_alone(url: str) -> None:
    """A kept response carries its conversation: another key may not read, list, continue, cancel or
    delete it."""
    created = _post(url, KEY_A, "/v1/responses", {"model": "any", "input": SECRET, "max_output_tokens": 4})
    assert created.status_code == 200, created.text
    rid = created.json()["id"]
    as_b = {"Authorization": f"Bearer {KEY_B}"}
    assert httpx.get(f"{url}/v1/responses/{rid}", headers=as_b).status_code == 404
    follow = _post(url, KEY_B, "/v1/responses", {"model": "any", "input": "And?", "previous_response_id": rid})
    assert follow.status_code == 404 and follow.json()["error"]["param"] == "previous_response_id"
    assert httpx.get(f"{url}/v1/responses/{rid}/input_items", headers=as_b).status_code == 404
    assert httpx.post(f"{url}/v1/responses/{rid}/cancel", headers=as_b).status_code == 404
    assert httpx.delete(f"{url}/v1/responses/{rid}", headers=as_b).status_code == 404
    as_a = {"Authorization": f"Bearer {KEY_A}"}
    assert httpx.get(f"{url}/v1/responses/{rid}", headers=as_a).json()["id"] == rid
    [item] = httpx.get(f"{url}/v1/responses/{rid}/input_items", headers=as_a).json()["data"]
    assert item["content"] == [{"type": "input_text", "text": SECRET}]
    assert httpx.post(f"{url}/v1/responses/{rid}/cancel", headers=as_a).status_code == 400  # not a background one


@pytest.mark.parametrize("salt", [123, "", "x" * 257, ["a"]])
def test_a_bad_cache_salt_is_a_400_naming_it(url: str, salt: object) -> None:
    chat = _post(url, KEY_A, "/v1/chat/completions", _chat("Where is Dune?", cache_salt=salt))
    assert chat.status_code == 400 and chat.json()["error"]["param"] == "cache_salt"
    responses = _post(url, KEY_A, "/v1/responses", {"input": "hi", "cache_salt": salt})
    assert responses.status_code == 400 and responses.json()["error"]["param"] == "cache_salt"
    message = {"max_tokens": 2, "messages": [{"role": "user", "content": "hi"}], "metadata": {"cache_salt": salt}}
    anthropic = _post(url, KEY_A, "/v1/messages", message)
    assert anthropic.status_code == 400 and anthropic.json()["type"] == "error"
    assert anthropic.json()["error"]["message"].startswith("metadata.cache_salt")
    match = _post(url, KEY_A, "/v1/prefix/match", _chat("Where is Dune?", cache_salt=salt))
    assert match.status_code == 400 and match.json()["error"]["param"] == "cache_salt"
    if isinstance(salt, str):
        view = httpx.get(f"{url}/v1/cache", params={"cache_salt": salt}, headers={"Authorization": f"Bearer {KEY_A}"})
        assert view.status_code == 400 and view.json()["error"]["param"] == "cache_salt"


def test_no_key_hash_or_salt_in_metrics_or_views(url: str) -> None:
    _chat_cached(url, KEY_B, _chat("Where is Dune?", cache_salt="hidden-salt"))
    page = httpx.get(f"{url}/metrics").text
    view = httpx.get(f"{url}/v1/cache", headers={"Authorization": f"Bearer {KEY_B}"}).text
    for secret in (KEY_A, KEY_B, tenant_id(KEY_A), tenant_id(KEY_B), "hidden-salt",
                   request_namespace(tenant=tenant_id(KEY_B), cache_salt="hidden-salt").split("+")[0].split(":")[1]):
        assert secret not in page and secret not in view


def test_isolation_none_shares_between_keys(smollm2, keys_file) -> None:
    with serve(smollm2, api_key_file=keys_file, cache_isolation="none") as base:
        assert _chat_cached(base, KEY_A, _chat(SECRET)) == 0
        assert _match(base, KEY_B, _chat(SECRET)) > 48
        assert _chat_cached(base, KEY_B, _chat(SECRET)) > 48
        assert _chat_cached(base, KEY_B, _chat(SECRET, cache_salt="s")) == 0  # a salt still splits


# -- the engine: every seam, the outputs, and a mutation -------------------------------------------------

NS_A, NS_B, NS_C = (request_namespace(tenant=tenant_id(key), cache_salt=None) for key in ("a", "b", "c"))


def _prompt(e: Engine) -> list[int]:
    return e.model.tokenize(SYSTEM + SECRET, add_special=True)


def check_isolation(e: Engine, prompt: list[int]) -> dict[str, tuple[list[int], list]]:
    """Tenant B right after A (A's stream resident), then C once streams are cleared (A's pages
    only): neither attaches anything; A's next turn attaches its own. Returns each request's prompt
    and traced output."""
    served: dict[str, tuple[list[int], list]] = {}

    def cached(name: str, tokens: list[int], namespace: str) -> int:
        request = greedy(tokens, max_tokens=6, namespace=namespace, logprobs=TOP)
        served[name] = (tokens, run_traced(e, [request])[request.id])
        return request.state.cached_tokens

    assert cached("a", prompt, NS_A) == 0
    assert cached("b", prompt, NS_B) == 0, "B attached A's rows (its stream in place, or its pages)"
    e.pool.drop_resident()
    assert cached("c", prompt, NS_C) == 0, "C attached A's pages"
    turn2 = prompt + [t.token for t in served["a"][1]]
    assert cached("a2", turn2, NS_A) >= len(prompt) - e.settings.page_rows
    return served


def test_namespaces_isolate_every_seam_and_outputs_equal_the_cache_off(smollm2) -> None:
    with engine(smollm2) as e:
        served = check_isolation(e, _prompt(e))
    with engine(smollm2, prefix_cache=False) as off:
        for name, (tokens, out) in served.items():
            alone = greedy(tokens, max_tokens=6, logprobs=TOP)
            assert_like_alone(run_traced(off, [alone])[alone.id], out, SMOLLM2_TOLERANCE)


def _tokens_alone_in_place(monkeypatch: pytest.MonkeyPatch) -> None:
    real = StreamPool._reusable
    monkeypatch.setattr(StreamPool, "_reusable", lambda self, stream, key: real(
        self, stream, PrefixKey(stream.namespace, key.tokens)))


def _tokens_alone_in_pages(monkeypatch: pytest.MonkeyPatch) -> None:
    real_match, real_root = PageTree.match, PageTree.root
    monkeypatch.setattr(PageTree, "match", lambda self, key, max_pages=None: real_match(
        self, PrefixKey("", key.tokens), max_pages))
    monkeypatch.setattr(PageTree, "root", lambda self, namespace: real_root(self, ""))


@pytest.mark.parametrize("mutant", [_tokens_alone_in_place, _tokens_alone_in_pages])
def test_matching_on_tokens_alone_fails_the_isolation_check(smollm2, monkeypatch: pytest.MonkeyPatch,
                                                            mutant) -> None:
    with engine(smollm2) as e:
        mutant(monkeypatch)
        with pytest.raises(AssertionError, match="attached A's"):
            check_isolation(e, _prompt(e))


def test_a_salt_in_a_query_string_is_not_logged(tiny, tmp_path: Path) -> None:
    """`GET /v1/cache?cache_salt=...` shows a salt's chains; the access log keeps the path and the
    other parameters, not the salt (it was written at INFO, for anyone who reads the logs)."""
    from kvserve.testing import ServerProcess

    log = tmp_path / "kvserve.log"
    with ServerProcess.kvserve(log, model=tiny("llama"), threads=1, parallel=2, log_format="json") as server:
        server.wait_healthy()
        assert httpx.get(f"{server.url}/v1/cache?cache_salt=MYSECRETSALT&model=x", timeout=30).status_code == 200
        encoded = httpx.get(f"{server.url}/v1/cache?cache%5Fsalt=ENCODEDSALT", timeout=30)  # read as cache_salt
        assert encoded.status_code == 200
    text = log.read_text()
    assert "/v1/cache?cache_salt=<redacted>&model=x" in text and "MYSECRETSALT" not in text
    assert "/v1/cache?cache%5Fsalt=<redacted>" in text and "ENCODEDSALT" not in text

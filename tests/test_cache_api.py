"""The prefix cache as a server user sees it: cached_tokens in usage, /v1/prefix/match, /v1/cache,
and the prefix-cache metrics."""

from __future__ import annotations

import httpx
from openai import OpenAI

from conftest import serve
from kvserve.testing import read_metrics

SYSTEM = "You are the archivist of a large library. Answer with the shelf number and nothing else. " * 3


def _chat(question: str) -> dict:
    return {"model": "any", "max_tokens": 4, "temperature": 0,
            "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]}


def test_match_reports_then_attach_uses_the_cached_prefix(base_url: str) -> None:
    client = OpenAI(base_url=f"{base_url}/v1", api_key="unused")
    first = httpx.post(f"{base_url}/v1/prefix/match", json=_chat("Where is Dune?")).json()
    assert first["cached_tokens"] == 0 and first["prompt_tokens"] > 48

    done = client.chat.completions.create(**_chat("Where is Dune?"))
    assert done.usage.prompt_tokens_details.cached_tokens == 0

    probe = httpx.post(f"{base_url}/v1/prefix/match", json=_chat("Where is Emma?")).json()
    again = httpx.post(f"{base_url}/v1/prefix/match", json=_chat("Where is Emma?")).json()
    assert probe == again  # match changes nothing
    assert probe["cached_tokens"] >= 48  # the first request's stream keeps what they share, in place

    stream = client.chat.completions.create(**_chat("Where is Emma?"), stream=True,
                                            stream_options={"include_usage": True})
    usage = [chunk.usage for chunk in stream if chunk.usage][-1]
    assert usage.prompt_tokens_details.cached_tokens == probe["cached_tokens"]

    completion = httpx.post(f"{base_url}/v1/prefix/match", json={"prompt": "plain text prompt"}).json()
    served = client.completions.create(model="any", prompt="plain text prompt", max_tokens=1).usage
    assert completion == {"prompt_tokens": served.prompt_tokens, "cached_tokens": 0, "page_size": 16,
                          "page_tokens": 0, "page_keys": []}
    assert served.prompt_tokens_details.cached_tokens == 0


def test_cache_view_and_metrics(base_url: str) -> None:
    client = OpenAI(base_url=f"{base_url}/v1", api_key="unused")
    client.chat.completions.create(**_chat("Where is Ulysses?"))
    view = httpx.get(f"{base_url}/v1/cache").json()
    assert view["enabled"] and view["held_pages"] > 0 and view["page_rows"] == 16
    assert view["chains"] and all({"id", "tokens", "pages_alive", "hits", "preview"} <= set(c) for c in view["chains"])
    assert view["pool"]["free_streams"] == view["pool"]["streams"] == 8  # idle: every stream free, rows kept
    assert 0 < view["held_bytes"] <= view["budget_bytes"]
    metrics = read_metrics(base_url)
    assert metrics.value("kvserve_prefix_cache_hit_tokens_total") > 0
    assert metrics.value("kvserve_prefix_cache_queried_tokens_total") >= metrics.value(
        "kvserve_prefix_cache_hit_tokens_total")
    assert metrics.value("kvserve_prefix_cache_held_pages") == view["held_pages"]
    assert metrics.value("kvserve_prefix_cache_held_bytes") == view["held_bytes"]
    assert metrics.value("kvserve_prefix_cache_inplace_reuse_total") >= 1  # each question continued a stream
    assert metrics.value("kvserve_live_kv_sessions") == 0  # idle: no stream, page or checkpoint held for a request
    assert metrics.value("kvserve_prefix_cache_locked_entries") == 0
    assert 0 < metrics.value("kvserve_kv_cache_usage_ratio") <= 1


def test_bad_match_body_is_a_400(base_url: str) -> None:
    response = httpx.post(f"{base_url}/v1/prefix/match", json={"messages": []})
    assert response.status_code == 400 and response.json()["error"]["param"] == "messages"


def test_a_prompt_past_the_context_is_the_400_its_request_would_get(base_url: str) -> None:
    """A router asks whether a request's prefix is cached here: one that leaves no room to generate
    is refused as its request would be, not matched (a 200 once)."""
    long = " ".join(["shelf"] * 5000)
    for route, body in (("/v1/chat/completions", {**_chat(long)}), ("/v1/completions", {"prompt": long})):
        served = httpx.post(f"{base_url}{route}", json=body, timeout=120)
        matched = httpx.post(f"{base_url}/v1/prefix/match", json=body, timeout=120)
        assert matched.status_code == served.status_code == 400, (route, matched.text)
        assert matched.json() == served.json() and matched.json()["error"]["code"] == "context_length_exceeded"


def test_hybrid_model_serves_checkpoints(tiny) -> None:
    with serve(tiny("lfm2")) as base:
        client = OpenAI(base_url=f"{base}/v1", api_key="unused")
        client.chat.completions.create(**_chat("Where is Dune?"))
        second = client.chat.completions.create(**_chat("Where is Emma?"))
        assert second.usage.prompt_tokens_details.cached_tokens > 48
        view = httpx.get(f"{base}/v1/cache").json()
        kinds = {c["kind"] for c in view["checkpoints"]}
        assert "opening" in kinds and 0 < view["state_bytes"] <= view["state_budget_bytes"]
        metrics = read_metrics(base)
        assert metrics.value("kvserve_prefix_state_hits_total") >= 1
        assert metrics.value("kvserve_prefix_state_bytes") == view["state_bytes"]
        assert metrics.value("kvserve_prefix_cache_locked_entries") == metrics.value("kvserve_live_kv_sessions") == 0
        openings = sum(c["kind"] == "opening" for c in view["checkpoints"])
        assert metrics.value("kvserve_prefix_state_checkpoints", kind="opening") == openings

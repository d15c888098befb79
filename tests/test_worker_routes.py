"""The surface routers read from each replica: /server_info, vLLM's /tokenize and /detokenize, the
/render endpoints, vLLM-named metrics, and the request leniency routers rely on."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import httpx
import pytest
from fastapi.testclient import TestClient

from conftest import serve, settings
from kvserve.testing import read_metrics

SYSTEM = "You are the archivist of a large library. Answer with the shelf number and nothing else. " * 3
MESSAGES = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Where is Dune?"}]


@pytest.fixture(scope="module")
def model(tiny) -> Path:
    return tiny("llama")


@pytest.fixture(scope="module")
def url(model: Path) -> Iterator[str]:
    with serve(model, threads=1) as base:
        yield base


def _served_prompt_tokens(url: str, path: str, body: dict) -> int:
    response = httpx.post(f"{url}{path}", json={**body, "max_tokens": 1}, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()["usage"]["prompt_tokens"]


def test_server_info_names_the_model_and_the_cache(url: str, model: Path) -> None:
    info = httpx.get(f"{url}/server_info").json()
    listed = httpx.get(f"{url}/v1/models").json()["data"][0]
    assert info["served_model_name"] == listed["id"] == model.stem
    assert info["model_path"] == str(model)
    assert (info["tp_size"], info["dp_size"]) == (1, 1)
    assert info["context_length"] == listed["max_model_len"]
    cache = info["cache"]
    assert cache["prefix_cache"] is True and cache["kind"] == "pages"
    assert (cache["ctx_size"], cache["parallel"], cache["page_rows"]) == (4096, 8, 16)


def test_chat_tokenize_and_render_are_the_served_prompt(url: str) -> None:
    served = _served_prompt_tokens(url, "/v1/chat/completions", {"messages": MESSAGES})
    tokenized = httpx.post(f"{url}/tokenize", json={"model": "any", "messages": MESSAGES}).json()
    rendered = httpx.post(f"{url}/v1/chat/completions/render", json={"model": "any", "messages": MESSAGES}).json()
    assert tokenized["count"] == len(tokenized["tokens"]) == served
    assert rendered == {"token_ids": tokenized["tokens"]}
    assert tokenized["max_model_len"] == httpx.get(f"{url}/v1/models").json()["data"][0]["max_model_len"]

    text = httpx.post(f"{url}/detokenize", json={"model": "any", "tokens": rendered["token_ids"]}).json()["prompt"]
    assert text.startswith("<|im_start|>system\n" + SYSTEM)  # the template's control tokens, spelled out
    assert text.endswith("Where is Dune?<|im_end|>\n<|im_start|>assistant\n")


def test_completion_tokenize_and_render_are_the_served_prompt(url: str) -> None:
    prompt = "The archivist keeps the maps on shelf"
    served = _served_prompt_tokens(url, "/v1/completions", {"prompt": prompt})
    tokenized = httpx.post(f"{url}/tokenize", json={"model": "any", "prompt": prompt}).json()
    rendered = httpx.post(f"{url}/v1/completions/render", json={"model": "any", "prompt": prompt}).json()
    assert tokenized["count"] == served and rendered["token_ids"] == tokenized["tokens"]
    assert httpx.post(f"{url}/detokenize", json={"tokens": tokenized["tokens"]}).json() == {"prompt": prompt}


@pytest.mark.parametrize("path, body, param", [
    ("/tokenize", {"model": "any"}, "prompt"),
    ("/tokenize", {"messages": []}, "messages"),
    ("/detokenize", {"tokens": [-1]}, "tokens"),
    ("/detokenize", {"tokens": [10**9]}, "tokens"),
    ("/detokenize", {"tokens": "abc"}, "tokens"),
    ("/v1/chat/completions/render", {"prompt": "no messages"}, "messages"),
    ("/v1/completions/render", {"prompt": ""}, "prompt"),
])
def test_bad_bodies_are_openai_400s(url: str, path: str, body: dict, param: str) -> None:
    response = httpx.post(f"{url}{path}", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param


def test_fields_routers_add_are_ignored_and_max_completion_tokens_counts(url: str) -> None:
    # What vllm-router and smg add to bodies they forward (SGLang's sampling extensions).
    extras = {"no_stop_trim": False, "skip_special_tokens": True, "separate_reasoning": True,
              "return_hidden_states": False, "continue_final_message": False, "rid": "abc"}
    body = {"model": "any", "messages": MESSAGES, "temperature": 0, "max_completion_tokens": 3,
            "ignore_eos": True, **extras}
    response = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 3


def test_worker_routes_need_the_api_key(model: Path) -> None:
    with serve(model, threads=1, api_key="s3cret") as base:
        assert httpx.get(f"{base}/server_info").status_code == 401
        assert httpx.post(f"{base}/tokenize", json={"prompt": "x"}).status_code == 401
        key = {"Authorization": "Bearer s3cret"}
        assert httpx.post(f"{base}/v1/completions/render", json={"prompt": "x"}, headers=key).status_code == 200


def test_health_is_503_until_the_model_is_loaded(model: Path) -> None:
    from kvserve.server.app import create_app

    # Without entering the client's context the lifespan (which loads the model) never runs.
    response = TestClient(create_app(settings(model))).get("/health")
    assert (response.status_code, response.json()) == (503, {"status": "loading"})


def test_vllm_metrics_are_off_by_default(url: str) -> None:
    assert "vllm:" not in httpx.get(f"{url}/metrics").text


def test_vllm_metrics_mirror_the_kvserve_ones(model: Path) -> None:
    with serve(model, threads=1, metrics_compat="vllm") as base:
        for question in ("Where is Dune?", "Where is Emma?"):  # the second attaches the system prompt
            messages = [MESSAGES[0], {"role": "user", "content": question}]
            _served_prompt_tokens(base, "/v1/chat/completions", {"messages": messages})
        metrics = read_metrics(base)

    def vllm(name: str) -> float:
        return metrics.value(f"vllm:{name}", model_name=model.stem)

    assert vllm("num_requests_running") == metrics.value("kvserve_requests_running") == 0
    assert vllm("num_requests_waiting") == metrics.value("kvserve_requests_waiting") == 0
    assert vllm("kv_cache_usage_perc") == metrics.value("kvserve_kv_cache_usage_ratio") > 0
    hits = vllm("prefix_cache_hits_total")
    assert hits == metrics.value("kvserve_prefix_cache_hit_tokens_total") > 0
    assert vllm("prefix_cache_queries_total") == metrics.value("kvserve_prefix_cache_queried_tokens_total") > hits

"""--api-key: every route but /health and /metrics (unless --metrics-need-key) needs `Authorization: Bearer <key>`."""

from __future__ import annotations

import httpx
import openai
import pytest

from conftest import serve


def test_bad_or_missing_key_is_an_openai_401_and_health_stays_open(tiny) -> None:
    with serve(tiny("llama"), api_key="s3cret") as url:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"},
                        {"Authorization": "Basic s3cret"}, {"Authorization": "Bearer"}):
            response = httpx.get(f"{url}/v1/models", headers=headers)
            assert response.status_code == 401
            error = response.json()["error"]
            assert error["type"] == "authentication_error" and set(error) == {"message", "type", "param", "code"}
            assert "s3cret" not in response.text
        assert httpx.post(f"{url}/v1/prefix/match", json={"prompt": "x"}).status_code == 401
        assert httpx.get(f"{url}/health").status_code == 200
        assert httpx.get(f"{url}/metrics").status_code == 200
        for scheme in ("bearer", "BEARER"):  # the scheme's case is free (RFC 7235)
            assert httpx.get(f"{url}/v1/models", headers={"Authorization": f"{scheme} s3cret"}).status_code == 200
        good = openai.OpenAI(base_url=f"{url}/v1", api_key="s3cret")
        assert good.completions.create(model="m", prompt="hi", max_tokens=2).usage.completion_tokens >= 1
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{url}/v1", api_key="nope", max_retries=0).models.list()


def test_metrics_need_the_key_when_asked(tiny) -> None:
    with serve(tiny("llama"), api_key="s3cret", metrics_need_key=True) as url:
        assert httpx.get(f"{url}/metrics").status_code == 401
        assert httpx.get(f"{url}/metrics", headers={"Authorization": "Bearer s3cret"}).status_code == 200
        assert httpx.get(f"{url}/health").status_code == 200


def test_the_key_is_checked_before_the_body_is_read(tiny) -> None:
    """Without a key, a malformed or oversized body is a 401 in the route's own shape, not a 400 or
    413: a caller without a key makes the server read and parse nothing (it once got the 400)."""
    with serve(tiny("llama"), api_key="s3cret", max_body_mb=1) as url:
        for path in ("/v1/chat/completions", "/models/load", "/v1/prefix/match"):
            for body in (b"{bad", b'{"messages": "\\ud800"}', b"x" * (2 << 20)):
                response = httpx.post(f"{url}{path}", content=body, headers={"content-type": "application/json"})
                assert response.status_code == 401, (path, response.status_code)
                assert response.json()["error"]["type"] == "authentication_error"
        anthropic = httpx.post(f"{url}/v1/messages", content=b"{bad", headers={"x-api-key": "nope"})
        assert anthropic.status_code == 401 and anthropic.json()["type"] == "error"
        assert anthropic.json()["error"]["type"] == "authentication_error"
        with_key = httpx.post(f"{url}/v1/chat/completions", content=b"{bad",
                              headers={"Authorization": "Bearer s3cret", "content-type": "application/json"})
        assert with_key.status_code == 400  # with the key, the body's own error
        for path in ("/health", "/", "/ui/cache", "/openapi.json", "/metrics"):
            assert httpx.get(f"{url}{path}").status_code == 200, path

"""API keys: with any configured, every route but /health (and /metrics, unless --metrics-need-key)
needs one, as `Authorization: Bearer <key>` (OpenAI's clients) or `x-api-key: <key>` (Anthropic's)."""

from __future__ import annotations

import hmac

from fastapi import Request

from kvserve.server.errors import APIError


def require_key(request: Request) -> None:
    keys: list[bytes] = request.app.state.api_keys
    if not keys:
        return
    given = [request.headers.get("authorization", "").encode()]
    if "x-api-key" in request.headers:
        given.append(b"Bearer " + request.headers["x-api-key"].encode())
    # Every key is compared, so the time taken tells nothing about which one (or how much) matched.
    matched = False
    for expected in keys:
        for value in given:
            matched |= hmac.compare_digest(value, expected)
    if not matched:
        raise APIError(401, "invalid or missing API key", type="authentication_error", code="invalid_api_key")


def bearer_values(keys: list[str]) -> list[bytes]:
    return [f"Bearer {key}".encode() for key in keys]

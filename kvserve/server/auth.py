"""API keys: with any configured, every route but /health, the playground's pages, FastAPI's
/docs, /redoc and /openapi.json (and /metrics, unless --metrics-need-key) needs one, as `Authorization: Bearer <key>` (OpenAI's clients) or `x-api-key: <key>` (Anthropic's).

Under `--cache-isolation key` each key is a tenant: the request's `state.tenant` is the key's id (a
digest, never the key), which puts its cached rows in a namespace of their own. Otherwise, and
without keys, it is None: the shared namespace. Whatever the isolation, `state.owner` is the key's id
(None without keys): what a key stores (kept responses) only that key reads back.

`KeyCheck` (middleware.py) refuses a request without an accepted key before its body is read;
`require_key`, on every guarded route, then sets the caller's tenant and owner."""

from __future__ import annotations

import hmac
from dataclasses import dataclass
from typing import Mapping

from fastapi import Request

from kvserve.server.errors import APIError
from kvserve.server.namespace import tenant_id


@dataclass(frozen=True)
class Keys:
    """The accepted keys as the bearer values compared, and the tenant each stands for (None: shared)."""

    bearers: list[bytes]
    owners: list[str]  # each key's id (a digest)
    isolate: bool

    @classmethod
    def of(cls, keys: list[str], isolate: bool) -> "Keys":
        return cls([f"Bearer {key}".encode() for key in keys], [tenant_id(key) for key in keys], isolate)

    def match(self, headers: Mapping[str, str]) -> int | None:
        """The index of the key `headers` carry (`Authorization: Bearer`, the scheme in any case as
        RFC 7235 says, or `x-api-key`), None for none. Every key is compared, so the time taken tells
        nothing about which one (or how much) matched."""
        scheme, _, credentials = headers.get("authorization", "").partition(" ")
        given = [b"Bearer " + credentials.strip().encode()] if scheme.lower() == "bearer" else []
        if "x-api-key" in headers:
            given.append(b"Bearer " + headers["x-api-key"].encode())
        matched: int | None = None
        for index, expected in enumerate(self.bearers):
            for value in given:
                if hmac.compare_digest(value, expected):
                    matched = index
        return matched


def refusal() -> APIError:
    return APIError(401, "invalid or missing API key", type="authentication_error", code="invalid_api_key")


async def require_key(request: Request) -> None:
    """A 401 without an accepted key; with one, `request.state.owner` is its id and `.tenant` its tenant."""
    keys: Keys = request.app.state.api_keys
    request.state.tenant = request.state.owner = None
    if not keys.bearers:
        return
    matched = keys.match(request.headers)
    if matched is None:
        raise refusal()
    request.state.owner = keys.owners[matched]
    request.state.tenant = keys.owners[matched] if keys.isolate else None


def tenant_of(request: Request) -> str | None:
    """The caller's tenant, as `require_key` found it (None: the shared namespace)."""
    return getattr(request.state, "tenant", None)


def owner_of(request: Request) -> str | None:
    """The id of the caller's key, as `require_key` found it (None: the server has no keys)."""
    return getattr(request.state, "owner", None)

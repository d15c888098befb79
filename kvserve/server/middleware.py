"""ASGI middleware that sees every HTTP request before the routes do."""

from __future__ import annotations

import json
import logging
import re
import uuid
from typing import Any, Callable

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvserve.server.auth import refusal

from kvserve.server.errors import error_body, error_body_at
from kvserve.server.logs import request_id

_log = logging.getLogger("kvserve.server")

# A client's id is echoed only if it is short and printable: it goes into logs and headers.
_CLIENT_ID = re.compile(r"[A-Za-z0-9._:/+=-]{1,128}")


class RequestId:
    """Takes `X-Request-Id` from the client (or makes one), puts it in the logging context and
    echoes it on the response."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        given = dict(scope["headers"]).get(b"x-request-id", b"").decode("latin-1")
        rid = given if _CLIENT_ID.fullmatch(given) else uuid.uuid4().hex

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), (b"x-request-id", rid.encode())]
            await send(message)

        token = request_id.set(rid)
        try:
            await self.app(scope, receive, send_with_id)
        finally:
            request_id.reset(token)


class ErrorBoundary:
    """Whatever a route raises that no handler answers is a bug, neither the client's fault nor the
    engine's: an OpenAI-shaped 500 `server_error` with no traceback, logged (with the request id, as
    every line) and counted in kvserve_unexpected_errors_total{route}. Once a response has started
    (a stream) it can only be logged, counted and cut short."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def watched(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, watched)
        except Exception:
            route = getattr(scope.get("route"), "path", "unmatched")  # set by the router that matched
            _log.exception("unexpected error serving %s %s", scope.get("method"), route)
            scope["app"].state.metrics.unexpected.labels(route=route).inc()
            if not started:
                text = f"the server failed unexpectedly; its log has the details under request id {request_id.get()}"
                body = error_body(text, type="server_error", code="internal_error")
                await _send_json(send, 500, error_body_at(scope["path"], 500, body))


class KeyCheck:
    """With keys, a request for a path that is not `public` and carries no accepted key is a 401 in
    its API's shape before its body is read: a caller without a key makes the server read and parse
    nothing (`require_key` on each guarded route still sets the caller's tenant)."""

    def __init__(self, app: ASGIApp, public: Callable[[str], bool]) -> None:
        self.app = app
        self.public = public

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and not self.public(scope["path"]):
            keys = scope["app"].state.api_keys
            if keys.bearers and keys.match(Headers(scope=scope)) is None:
                body = refusal().body
                return await _send_json(send, 401, error_body_at(scope["path"], 401, body))
        await self.app(scope, receive, send)


class BodyLimit:
    """Reads the body up front and answers 413 past `max_bytes`, and 400 for a JSON body with a
    lone surrogate in a string (JSON allows the escape, UTF-8 cannot carry it: no tokenizer, grammar
    or response could take it); the app then reads the body from memory (every route parses the
    whole body anyway)."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        body = bytearray()
        more = True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > self.max_bytes:
                return await self._too_large(scope["path"], send)
        param = surrogate_param(bytes(body))
        if param is not None:
            text = (f"{param or 'the body'} holds a lone surrogate (a \\ud800-\\udfff escape without its pair), "
                    "which is not text")
            return await _send_json(send, 400, error_body_at(scope["path"], 400, error_body(text, param=param or None)))
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if replayed:
                return await receive()  # after the body: the disconnect, whenever it comes
            replayed = True
            return {"type": "http.request", "body": bytes(body), "more_body": False}

        await self.app(scope, replay, send)

    async def _too_large(self, path: str, send: Send) -> None:
        limit_mb = self.max_bytes / (1024 * 1024)
        body = error_body(f"the request body is larger than {limit_mb:g} MiB (--max-body-mb)", code="request_too_large")
        await _send_json(send, 413, error_body_at(path, 413, body))


async def _send_json(send: Send, status: int, body: dict) -> None:
    payload = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]})
    await send({"type": "http.response.body", "body": payload})


# A JSON escape of a surrogate: the only way one can reach a body (UTF-8 cannot spell it).
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
_SURROGATE = re.compile(r"[\ud800-\udfff]")


def surrogate_param(body: bytes) -> str | None:
    """Where a JSON body holds a string (or key) with a lone surrogate, as a parameter name
    (`messages[0].content`; '' for the body itself); None if nowhere, or if it is no JSON."""
    if not _SURROGATE_ESCAPE.search(body):
        return None  # the usual body: no escape of a surrogate at all, nothing to parse
    try:
        value = json.loads(body)
    except (ValueError, RecursionError):
        return None  # the app answers a body that is not JSON
    stack: list[tuple[str, Any]] = [("", value)]
    while stack:
        path, node = stack.pop()
        if isinstance(node, str):
            if _SURROGATE.search(node):
                return path
        elif isinstance(node, list):
            stack.extend(reversed([(f"{path}[{i}]", item) for i, item in enumerate(node)]))  # the first on top
        elif isinstance(node, dict):
            if any(_SURROGATE.search(key) for key in node):
                return path
            stack.extend(reversed([(f"{path}.{key}" if path else key, item) for key, item in node.items()]))
    return None

"""ASGI middleware that sees every HTTP request before the routes do."""

from __future__ import annotations

import json
import re
import uuid

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvserve.server.errors import error_body, error_body_at
from kvserve.server.logs import request_id

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


class BodyLimit:
    """Reads the body up front and answers 413 past `max_bytes`; the app then reads it from memory
    (every route parses the whole body anyway)."""

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
        payload = json.dumps(error_body_at(path, 413, body)).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]})
        await send({"type": "http.response.body", "body": payload})

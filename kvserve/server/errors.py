"""OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}`, never FastAPI's 422 body;
under /v1/messages, Anthropic's: `{"type": "error", "error": {"type", "message"}}`."""

from __future__ import annotations

import json
import re
from contextlib import contextmanager
from http import HTTPStatus
from typing import Iterator, Sequence

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvserve.llama.special_cuts import TooManySpecialTokens
from kvserve.server.schemas import ErrorResponse


class APIError(Exception):
    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.body = error_body(message, type=type, param=param, code=code)
        self.headers = headers


SHUTTING_DOWN = "the server is shutting down"


def shutting_down(message: str = SHUTTING_DOWN) -> APIError:
    """A 503: the server drains, or the engine a request waited for stopped."""
    return APIError(503, message, type="server_error", code="shutting_down")


def queue_full(message: str) -> APIError:
    """A 429: as many requests are in flight as this server queues; try again in a second."""
    return APIError(429, message, type="rate_limit_error", code="queue_full", headers={"Retry-After": "1"})


def error_body(message: str, *, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def error_responses(*statuses: int, model: type[BaseModel] = ErrorResponse) -> dict[int | str, dict]:
    """OpenAPI entries for the error statuses a route can answer, all in `model`'s shape."""
    return {status: {"model": model, "description": HTTPStatus(status).phrase} for status in statuses}


ANTHROPIC_ROUTES = "/v1/messages"  # and the routes below it
# Anthropic's error type for each status kvserve answers; 503 (draining, a queue timeout) is its
# overload, which Anthropic's own API answers with 529.
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
                    503: "overloaded_error", 529: "overloaded_error"}


def anthropic_error_body(status: int, message: str) -> dict:
    kind = _ANTHROPIC_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def error_body_at(path: str, status: int, body: dict) -> dict:
    """An OpenAI error `body` as the API served at `path` words it; Anthropic's has no `param`,
    so its message names the parameter."""
    if not (path == ANTHROPIC_ROUTES or path.startswith(f"{ANTHROPIC_ROUTES}/")):
        return body
    param, message = body["error"]["param"], body["error"]["message"]
    if param is not None and not message.startswith(param):
        message = f"{param}: {message}"
    return anthropic_error_body(status, message)


def invalid(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


def context_length_exceeded(limit: int, prompt_tokens: int, param: str) -> APIError:
    """OpenAI's wording and code: LiteLLM and LangChain match on them to trim the history and retry."""
    what = "messages" if param == "messages" else "prompt"
    return APIError(
        400,
        f"This model's maximum context length is {limit} tokens. However, your {what} resulted in "
        f"{prompt_tokens} tokens, which leaves no room for the completion. Please reduce the length of the {what}.",
        param=param, code="context_length_exceeded",
    )


def engine_error(message: str, status: int, code: str | None = None) -> APIError:
    """A request the engine ended with an error: the client's fault below 500, the server's above."""
    return APIError(status, message, type="invalid_request_error" if status < 500 else "server_error", code=code)


def _where(loc: Sequence) -> tuple:
    """An error's location without where the request carried it: ('query', 'limit') -> ('limit',)."""
    return tuple(loc[1:]) if loc and loc[0] in ("body", "query", "path", "header") else tuple(loc)


def _param(loc: tuple) -> str | None:
    """('body', 'messages', 0, 'role') -> 'messages[0].role'; union branches (a type such as `str`,
    or a tagged model, named after its class) are no parameter names and are left out."""
    out = ""
    for part in _where(loc):
        if isinstance(part, int):
            out += f"[{part}]"
        elif not (str(part).startswith(("function-", "list[", "str", "int", "literal[")) or str(part)[:1].isupper()):
            out += ("." if out else "") + str(part)
    return out or None


def invalid_body(errors: Sequence[dict]) -> APIError:
    """The 400 for a body that failed validation, naming the first offending parameter. Where a
    union failed in each of its branches, the deepest error is the branch the value was meant for."""
    def field(error: dict) -> object:
        return next(iter(_where(error.get("loc", ()))), None)

    alike = [e for e in errors if field(e) == field(errors[0])]
    first = max(alike, key=lambda e: len(e.get("loc", ())))
    if first.get("type") == "json_invalid":
        return invalid("the request body is not valid JSON")
    param = _param(tuple(first.get("loc", ())))
    message = str(first.get("msg", "invalid request")).removeprefix("Value error, ")
    return invalid(f"{param}: {message}" if param else message, param)


Spellings = Sequence[tuple[re.Pattern[str], str]]  # a pattern over a chat parameter, and its replacement


@contextmanager
def respelled(spellings: Spellings) -> Iterator[None]:
    """Errors raised inside (by code shared with chat) name the parameter as another API spells it,
    in `param` and where the message starts with it: by the first of `spellings` that matches."""
    try:
        yield
    except APIError as exc:
        detail = exc.body["error"]
        param, message = detail["param"], detail["message"]
        for pattern, spelling in spellings:
            if param is not None and pattern.match(param):
                renamed = pattern.sub(spelling, param, count=1)
                if message.startswith(f"{param}: "):
                    message = f"{renamed}: {message.removeprefix(f'{param}: ')}"
                param = renamed
                break
        raise APIError(exc.status, message, type=detail["type"], param=param, code=detail["code"],
                       headers=exc.headers) from exc


def install_error_handlers(app: FastAPI) -> None:
    def answer(request: Request, error: APIError) -> JSONResponse:
        body = error_body_at(request.url.path, error.status, error.body)
        return JSONResponse(body, status_code=error.status, headers=error.headers)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return answer(request, exc)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return answer(request, invalid_body(exc.errors()))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return answer(request, APIError(exc.status_code, str(exc.detail), type=kind))

    @app.exception_handler(TooManySpecialTokens)
    async def _specials(request: Request, exc: TooManySpecialTokens) -> JSONResponse:
        return answer(request, invalid(f"the prompt cannot be tokenized: {exc}"))

    @app.exception_handler(json.JSONDecodeError)
    async def _json(request: Request, exc: json.JSONDecodeError) -> JSONResponse:
        return answer(request, invalid("the request body is not valid JSON"))

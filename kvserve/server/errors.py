"""OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}`, never FastAPI's 422 body."""

from __future__ import annotations

import json
from http import HTTPStatus
from typing import Sequence

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvserve.server.schemas import ErrorResponse


class APIError(Exception):
    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.body = error_body(message, type=type, param=param, code=code)
        self.headers = headers


def error_body(message: str, *, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def error_responses(*statuses: int) -> dict[int | str, dict]:
    """OpenAPI entries for the error statuses a route can answer, all in the OpenAI shape."""
    return {status: {"model": ErrorResponse, "description": HTTPStatus(status).phrase} for status in statuses}


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


def engine_error(message: str, status: int) -> APIError:
    """A request the engine ended with an error: the client's fault below 500, the server's above."""
    return APIError(status, message, type="invalid_request_error" if status < 500 else "server_error")


def _param(loc: tuple) -> str | None:
    """('body', 'messages', 0, 'role') -> 'messages[0].role'; union branches (a type such as `str`,
    or a tagged model, named after its class) are no parameter names and are left out."""
    parts = [p for p in loc if p != "body"]
    out = ""
    for part in parts:
        if isinstance(part, int):
            out += f"[{part}]"
        elif not (str(part).startswith(("function-", "list[", "str", "int", "literal[")) or str(part)[:1].isupper()):
            out += ("." if out else "") + str(part)
    return out or None


def invalid_body(errors: Sequence[dict]) -> APIError:
    """The 400 for a body that failed validation, naming the first offending parameter. Where a
    union failed in each of its branches, the deepest error is the branch the value was meant for."""
    def field(error: dict) -> object:
        return next((part for part in error.get("loc", ()) if part != "body"), None)

    alike = [e for e in errors if field(e) == field(errors[0])]
    first = max(alike, key=lambda e: len(e.get("loc", ())))
    if first.get("type") == "json_invalid":
        return invalid("the request body is not valid JSON")
    param = _param(tuple(first.get("loc", ())))
    message = str(first.get("msg", "invalid request")).removeprefix("Value error, ")
    return invalid(f"{param}: {message}" if param else message, param)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body, status_code=exc.status, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        error = invalid_body(exc.errors())
        return JSONResponse(error.body, status_code=error.status)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return JSONResponse(error_body(str(exc.detail), type=kind), status_code=exc.status_code)

    @app.exception_handler(json.JSONDecodeError)
    async def _json(_: Request, exc: json.JSONDecodeError) -> JSONResponse:
        return JSONResponse(error_body("the request body is not valid JSON"), status_code=400)

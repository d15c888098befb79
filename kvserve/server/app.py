"""The HTTP surface: OpenAI endpoints (with and without /v1), health, metrics and cache views."""

from __future__ import annotations

import asyncio
import logging
import time
from contextlib import asynccontextmanager
from http import HTTPStatus
from typing import AsyncIterator, Awaitable, TypeVar

import uvicorn
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kvserve.config import Settings
from kvserve.scheduler.async_engine import EngineStopped, QueueFull, RequestStream
from kvserve.scheduler.engine import Engine
from kvserve.scheduler.request import RequestOutput
from kvserve.server import cache_routes, prompts, worker_routes
from kvserve.server.auth import bearer_values, require_key
from kvserve.server.errors import APIError, engine_error, install_error_handlers
from kvserve.server.logs import log_config
from kvserve.server.metrics import Metrics, RequestTimer
from kvserve.server.middleware import BodyLimit, RequestId
from kvserve.server.responses import LogprobFormatter, Shape, collect, stream
from kvserve.server.schemas import ChatCompletionRequest, CompletionRequest, ErrorResponse
from kvserve.server.shutdown import SHUTTING_DOWN, DrainingServer

_log = logging.getLogger("kvserve.server")
T = TypeVar("T")


def _engine(request: Request) -> Engine:
    return request.app.state.engine


def _rejected(request: Request, error: APIError) -> APIError:
    """Count a request refused for load (429 or 503) before it is answered."""
    request.app.state.metrics.rejected.labels(status=str(error.status)).inc()
    return error


def _accepting(request: Request) -> None:
    if request.app.state.draining:
        raise _rejected(request, APIError(503, SHUTTING_DOWN, type="server_error", code="shutting_down"))


def _errors(*statuses: int) -> dict[int | str, dict]:
    """OpenAPI entries for the error statuses a route can answer, all in the OpenAI shape."""
    return {status: {"model": ErrorResponse, "description": HTTPStatus(status).phrase} for status in statuses}


# What the generation routes answer besides their body: SSE when streaming, and every refusal.
_GENERATION = {200: {"content": {"text/event-stream": {}}}, **_errors(400, 413, 429, 500, 503)}

api = APIRouter(dependencies=[Depends(require_key)], responses=_errors(401))
public = APIRouter()


@public.get("/health")
async def health(request: Request) -> JSONResponse:
    engine: Engine | None = getattr(request.app.state, "engine", None)
    if request.app.state.draining:
        return JSONResponse({"status": "draining"}, status_code=503)
    if engine is None or not engine.async_engine.running:
        return JSONResponse({"status": "loading"}, status_code=503)
    return JSONResponse({"status": "ok"})


@public.get("/metrics")
async def metrics(request: Request) -> Response:
    if request.app.state.settings.metrics_need_key:
        require_key(request)
    return Response(generate_latest(request.app.state.metrics.registry), media_type=CONTENT_TYPE_LATEST)


@api.get("/v1/models")
@api.get("/models")
async def models(request: Request) -> dict:
    engine = _engine(request)
    return {
        "object": "list",
        "data": [{
            "id": engine.settings.served_name,
            "object": "model",
            "created": request.app.state.started,
            "owned_by": "kvserve",
            "max_model_len": engine.max_seq_len,
        }],
    }


@api.post("/v1/chat/completions", dependencies=[Depends(_accepting)], responses=_GENERATION)
@api.post("/chat/completions", dependencies=[Depends(_accepting)], responses=_GENERATION)
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
    engine = _engine(request)
    prompt = await asyncio.to_thread(prompts.chat_prompt, engine.model, engine.template, body)
    params = prompts.chat_sampling(engine.model, body, prompt.tools)
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    job = prompts.build_request(prompt.tokens, body, params, logprobs, engine.scheduler.config, "chatcmpl")
    job.marks = prompt.marks
    job.special_text = prompt.tools is not None and prompt.tools.special_text
    shape = Shape(True, engine.settings.served_name, job, tools=prompt.tools)
    return await _respond(request, engine, shape, body.stream, body.stream_options)


@api.post("/v1/completions", dependencies=[Depends(_accepting)], responses=_GENERATION)
@api.post("/completions", dependencies=[Depends(_accepting)], responses=_GENERATION)
async def completions(body: CompletionRequest, request: Request) -> Response:
    engine = _engine(request)
    prompt = await asyncio.to_thread(prompts.completion_prompt, engine.model, body)
    params = prompts.sampling_params(engine.model, body, None)
    job = prompts.build_request(prompt, body, params, body.logprobs, engine.scheduler.config, "cmpl")
    return await _respond(request, engine, Shape(False, engine.settings.served_name, job), body.stream, body.stream_options)


async def _timed(outputs: RequestStream, timer: RequestTimer) -> AsyncIterator[RequestOutput]:
    """The outputs, observed for metrics and logged at the end; the stream is closed however this ends."""
    reasons: list[str] = []
    try:
        async for output in outputs:
            timer.observe(output)
            reasons += [d.finish_reason.value for d in output.deltas if d.finish_reason is not None]
            if output.usage is not None:
                _log.info("%s: %d prompt tokens (%d cached), %d generated, finish %s", outputs.request.id,
                          output.usage.prompt_tokens, output.usage.cached_tokens, output.usage.completion_tokens,
                          ",".join(reasons) or output.error)
            yield output
    finally:
        outputs.close()
    timer.finished(reasons)


class _ClientGone(Exception):
    """The client closed the connection before its response was ready."""


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """`work`'s result, or `_ClientGone` (with `work` cancelled) if the client leaves first."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        done, _ = await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not task.done():
            task.cancel()
    if task not in done:
        raise _ClientGone
    return task.result()


async def _respond(request: Request, engine: Engine, shape: Shape, streaming: bool, options) -> Response:
    """Waits for the first output before answering, so a request the engine refuses (queue timeout,
    a prompt too big for the cache, a failed decode) gets its own status, not a 200 stream."""
    try:
        outputs = engine.async_engine.open(shape.request)
    except QueueFull as exc:
        busy = APIError(429, str(exc), type="rate_limit_error", code="queue_full", headers={"Retry-After": "1"})
        raise _rejected(request, busy) from exc
    except EngineStopped as exc:
        raise APIError(503, str(exc), type="server_error", code="shutting_down") from exc
    timer = RequestTimer(request.app.state.metrics, shape.request.arrival)
    formatter = LogprobFormatter(engine.model)
    try:
        first = await _unless_disconnected(request, outputs.peek())
        if first.error is not None:
            error = engine_error(first.error, first.status)
            raise _rejected(request, error) if error.status == 503 else error
        if streaming:
            include_usage = bool(options and options.include_usage)
            return StreamingResponse(
                stream(shape, _timed(outputs, timer), formatter, include_usage),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        return JSONResponse(await _unless_disconnected(request, collect(shape, _timed(outputs, timer), formatter)))
    except _ClientGone:
        outputs.close()
        return Response(status_code=499)  # nginx's "client closed request": nobody reads it, logs do
    except BaseException:
        outputs.close()
        raise


def create_app(settings: Settings) -> FastAPI:
    """The app; the model loads at startup and is released, in order, at shutdown."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        app.state.engine = await asyncio.to_thread(Engine.load, settings)
        app.state.engine.async_engine.start()
        try:
            yield
        finally:
            await app.state.engine.async_engine.stop()
            app.state.engine.close()

    app = FastAPI(title="kvserve", version="0.1.0", lifespan=lifespan)
    app.state.settings = settings
    app.state.api_keys = bearer_values(settings.api_keys())
    app.state.draining = False
    app.state.started = int(time.time())
    app.state.metrics = Metrics(lambda: app.state.engine.scheduler.snapshot, lambda: app.state.engine.scheduler.times,
                                lambda: app.state.engine.async_engine, settings)
    install_error_handlers(app)
    _document_400s_not_422s(app)
    app.include_router(public)
    app.include_router(api)
    app.include_router(cache_routes.router, dependencies=[Depends(require_key)], responses=_errors(400, 401, 413))
    app.include_router(worker_routes.router, dependencies=[Depends(require_key)], responses=_errors(400, 401, 413))
    # The last added runs outermost: RequestId wraps BodyLimit, so the id is set before anything logs or answers.
    app.add_middleware(BodyLimit, max_bytes=int(settings.max_body_mb * 1024 * 1024))
    app.add_middleware(RequestId)
    return app


def _document_400s_not_422s(app: FastAPI) -> None:
    """FastAPI documents a 422 for every body; kvserve answers a bad body with an OpenAI 400."""
    generate = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = generate()
            for operations in schema["paths"].values():
                for operation in operations.values():
                    operation["responses"].pop("422", None)
            for unused in ("HTTPValidationError", "ValidationError"):
                schema.get("components", {}).get("schemas", {}).pop(unused, None)
        return app.openapi_schema

    app.openapi = openapi


def serve(settings: Settings) -> None:
    app = create_app(settings)
    config = uvicorn.Config(app, host=settings.host, port=settings.port, log_config=log_config(settings.log_format))
    DrainingServer(config, app, settings.drain_timeout).run()

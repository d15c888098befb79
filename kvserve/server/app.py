"""The HTTP surface: OpenAI endpoints (with and without /v1), health, metrics and cache views."""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from contextlib import asynccontextmanager
from typing import AsyncIterator

import uvicorn
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kvserve.config import Settings
from kvserve.scheduler.engine import Engine
from kvserve.scheduler.request import Request as EngineRequest
from kvserve.scheduler.request import RequestOutput
from kvserve.server import cache_routes, prompts, worker_routes
from kvserve.server.errors import APIError, install_error_handlers
from kvserve.server.metrics import Metrics, RequestTimer
from kvserve.server.responses import EngineFailure, LogprobFormatter, Shape, collect, stream
from kvserve.server.schemas import ChatCompletionRequest, CompletionRequest

_log = logging.getLogger("kvserve.server")


def _engine(request: Request) -> Engine:
    return request.app.state.engine


def _check_key(request: Request) -> None:
    key = request.app.state.settings.api_key
    if not key:
        return
    given = request.headers.get("authorization", "")
    expected = f"Bearer {key}"
    if not hmac.compare_digest(given.encode(), expected.encode()):
        raise APIError(401, "invalid or missing API key", type="authentication_error", code="invalid_api_key")


api = APIRouter(dependencies=[Depends(_check_key)])
public = APIRouter()


@public.get("/health")
async def health(request: Request) -> JSONResponse:
    engine: Engine | None = getattr(request.app.state, "engine", None)
    if engine is None or not engine.async_engine.running:
        return JSONResponse({"status": "loading"}, status_code=503)
    return JSONResponse({"status": "ok"})


@public.get("/metrics")
async def metrics(request: Request) -> Response:
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


@api.post("/v1/chat/completions")
@api.post("/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
    engine = _engine(request)
    prompt, stops = await asyncio.to_thread(prompts.chat_prompt, engine.model, engine.template, body)
    grammar = prompts.grammar_for(body.response_format)
    params = prompts.sampling_params(engine.model, body, grammar)
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    job = prompts.build_request(prompt, body, params, logprobs, engine.max_seq_len, "chatcmpl")
    job.stops = stops
    return await _respond(request, engine, Shape(True, engine.settings.served_name, job), body.stream, body.stream_options)


@api.post("/v1/completions")
@api.post("/completions")
async def completions(body: CompletionRequest, request: Request) -> Response:
    engine = _engine(request)
    prompt = await asyncio.to_thread(prompts.completion_prompt, engine.model, body)
    params = prompts.sampling_params(engine.model, body, None)
    job = prompts.build_request(prompt, body, params, body.logprobs, engine.max_seq_len, "cmpl")
    return await _respond(request, engine, Shape(False, engine.settings.served_name, job), body.stream, body.stream_options)


async def _timed(outputs: AsyncIterator[RequestOutput], timer: RequestTimer) -> AsyncIterator[RequestOutput]:
    reasons: list[str] = []
    async for output in outputs:
        timer.observe(output)
        reasons += [d.finish_reason.value for d in output.deltas if d.finish_reason is not None]
        yield output
    timer.finished(reasons)


async def _respond(request: Request, engine: Engine, shape: Shape, streaming: bool, options) -> Response:
    job: EngineRequest = shape.request
    timer = RequestTimer(request.app.state.metrics, job.arrival)
    outputs = _timed(engine.async_engine.generate(job), timer)
    formatter = LogprobFormatter(engine.model)
    if streaming:
        include_usage = bool(options and options.include_usage)
        return StreamingResponse(
            stream(shape, outputs, formatter, include_usage),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
    try:
        return JSONResponse(await collect(shape, outputs, formatter))
    except EngineFailure as exc:
        raise APIError(500, str(exc), type="server_error") from exc


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
    app.state.started = int(time.time())
    app.state.metrics = Metrics(lambda: app.state.engine.scheduler.snapshot, lambda: app.state.engine.scheduler.times,
                                settings)
    install_error_handlers(app)
    app.include_router(public)
    app.include_router(api)
    app.include_router(cache_routes.router, dependencies=[Depends(_check_key)])
    app.include_router(worker_routes.router, dependencies=[Depends(_check_key)])
    return app


def serve(settings: Settings) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    uvicorn.run(create_app(settings), host=settings.host, port=settings.port, log_level="info")

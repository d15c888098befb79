"""The HTTP surface: OpenAI endpoints (with and without /v1), Anthropic's Messages API, health, metrics
and cache views."""

from __future__ import annotations

import time
from contextlib import asynccontextmanager
from functools import partial
from typing import AsyncIterator

import uvicorn
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kvserve.config import Settings
from kvserve.scheduler.engine import Engine
from kvserve.server.catalog import ModelSpec, catalog
from kvserve.server.persistence import Persistence
from kvserve.server.model_set import ModelSet, ReleaseLeases, engine_for
from kvserve.server import cache_routes, embeddings, prompts, ui_routes, worker_routes
from kvserve.server.auth import Keys, require_key, tenant_of
from kvserve.server.errors import error_responses, install_error_handlers
from kvserve.server.generation import Answer, accepting, respond
from kvserve.server.logs import log_config
from kvserve.server.metrics import Metrics
from kvserve.server.middleware import BodyLimit, ErrorBoundary, KeyCheck, RequestId
from kvserve.server.responses import LogprobFormatter, Shape, collect, stream
from kvserve.server.messages_api import routes as messages_api
from kvserve.server.messages_api.schemas import AnthropicErrorResponse
from kvserve.server.responses_api import routes as responses_api
from kvserve.server.responses_api.sqlite_store import SqliteResponseStore
from kvserve.server.responses_api.store import ResponseStore
from kvserve.server.schemas import ChatCompletionRequest, CompletionRequest, StreamOptions
from kvserve.server.shutdown import DrainingServer


# What the generation routes answer besides their body: SSE when streaming, and every refusal.
_GENERATION = {200: {"content": {"text/event-stream": {}}}, **error_responses(400, 413, 429, 500, 503)}

api = APIRouter(dependencies=[Depends(require_key)], responses=error_responses(401))
public = APIRouter()


@public.get("/health")
async def health(request: Request) -> JSONResponse:
    models: ModelSet | None = getattr(request.app.state, "models", None)
    if request.app.state.draining:
        return JSONResponse({"status": "draining"}, status_code=503)
    if models is None or not models.serving:
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
    """Every model, loaded or not, with its status (llama-server router mode's shape), and each
    model's LoRA adapters as vLLM lists them."""
    models: ModelSet = request.app.state.models
    base = {"object": "model", "created": request.app.state.started, "owned_by": "kvserve"}
    data = []
    for model in models.models:
        data.append({**base, **models.describe(model)})
        data += [{"id": name, **base, "root": str(path), "parent": model.spec.name, "status": data[-1]["status"]}
                 for name, path in model.spec.settings.lora_paths().items()]
    return {"object": "list", "data": data}


class ModelName(BaseModel):
    model: str


@api.post("/models/load")
async def load_model(body: ModelName, request: Request) -> dict:
    """llama-server router mode's load: `{"model": NAME}`, answered once it is loaded."""
    await request.app.state.models.load(body.model)
    return {"success": True}


@api.post("/models/unload")
async def unload_model(body: ModelName, request: Request) -> dict:
    """llama-server router mode's unload: `{"model": NAME}`; 409 while it serves requests."""
    unloaded = await request.app.state.models.unload(body.model)
    return {"success": True, "unloaded": unloaded}


@api.post("/v1/chat/completions", dependencies=[Depends(accepting)], responses=_GENERATION)
@api.post("/chat/completions", dependencies=[Depends(accepting)], responses=_GENERATION)
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
    engine = await engine_for(request, body.model, keep_alive=body.keep_alive, generate=True)
    job, reply = await prompts.chat_job(engine, body, tenant=tenant_of(request))
    shape = Shape(True, prompts.served_model(engine, body), job, reply=reply)
    return await respond(request, engine, job, _answer(engine, shape, body.stream, body.stream_options))


@api.post("/v1/completions", dependencies=[Depends(accepting)], responses=_GENERATION)
@api.post("/completions", dependencies=[Depends(accepting)], responses=_GENERATION)
async def completions(body: CompletionRequest, request: Request) -> Response:
    engine = await engine_for(request, body.model, keep_alive=body.keep_alive, generate=True)
    prompt = await prompts.completion_tokens(engine.model, body)
    params = prompts.sampling_params(engine.model, body, None)
    job = prompts.build_request(prompt, body, params, body.logprobs, engine, "cmpl", "prompt",
                                tenant=tenant_of(request), adapters=prompts.adapters_for(engine, body))
    return await respond(request, engine, job, _answer(engine, Shape(False, prompts.served_model(engine, body), job),
                                                        body.stream, body.stream_options))


def _answer(engine: Engine, shape: Shape, streaming: bool, options: StreamOptions | None) -> Answer:
    """Chat and text completion bodies: whole, or SSE chunks when `streaming`."""
    formatter = LogprobFormatter(engine.model)
    include_usage = bool(options and options.include_usage)
    continuous = include_usage and bool(options and options.continuous_usage_stats)
    chunks = partial(stream, shape, logprobs=formatter, include_usage=include_usage, continuous_usage=continuous)
    return Answer(partial(collect, shape, logprobs=formatter), chunks if streaming else None, shape.finish_reasons)


def create_app(settings: Settings, specs: list[ModelSpec] | None = None,
               persistence: Persistence | None = None) -> FastAPI:
    """The app over `specs` (default: the models `settings` name); the models marked to load at
    start load before it serves, and every loaded model is released, in order, at shutdown."""
    model_set = ModelSet(settings, catalog(settings) if specs is None else specs, persistence)
    response_store = _response_store(settings)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await model_set.start()
        app.state.models = model_set
        try:
            yield
        finally:
            await model_set.close()
            if isinstance(response_store, SqliteResponseStore):
                response_store.close()

    app = FastAPI(title="kvserve", version="0.1.0", lifespan=lifespan)
    app.state.settings = settings
    app.state.api_keys = Keys.of(settings.api_keys(), isolate=settings.cache_isolation == "key")
    app.state.draining = False
    app.state.started = int(time.time())
    app.state.response_store = response_store
    app.state.metrics = Metrics(partial(_engine_views, model_set), settings, lambda: model_set.persistence)
    install_error_handlers(app)
    _document_400s_not_422s(app)
    app.include_router(public)
    app.include_router(api)
    app.include_router(responses_api.router, dependencies=[Depends(require_key)], responses=error_responses(401))
    app.include_router(messages_api.router, dependencies=[Depends(require_key)],
                       responses=error_responses(401, model=AnthropicErrorResponse))
    app.include_router(embeddings.router, dependencies=[Depends(require_key)], responses=error_responses(401))
    guarded = dict(dependencies=[Depends(require_key)], responses=error_responses(400, 401, 413))
    app.include_router(cache_routes.router, **guarded)
    app.include_router(worker_routes.router, **guarded)
    if settings.ui:
        ui_routes.install(app)
    for path in app.openapi()["paths"]:  # every route's series from the start, at 0
        app.state.metrics.unexpected.labels(route=path)
    # The last added runs outermost: RequestId wraps the rest, so the id is set before anything logs or answers.
    app.add_middleware(BodyLimit, max_bytes=int(settings.max_body_mb * 1024 * 1024))
    app.add_middleware(KeyCheck, public=partial(_public, settings))  # before the body is read
    app.add_middleware(ErrorBoundary)
    app.add_middleware(RequestId)
    app.add_middleware(ReleaseLeases)  # outermost: a lease ends after the last byte of its response
    return app


_PUBLIC = {"/health", "/", "/ui/cache", "/docs", "/docs/oauth2-redirect", "/redoc", "/openapi.json"}


def _public(settings: Settings, path: str) -> bool:
    """Paths that need no key: health, the playground's pages (they ask for the key), FastAPI's
    description of the routes, and the metrics unless --metrics-need-key."""
    return (path in _PUBLIC or path.startswith("/ui/static/")
            or (path == "/metrics" and not settings.metrics_need_key))


def _response_store(settings: Settings) -> ResponseStore | SqliteResponseStore:
    """Kept responses: in SQLite in the data dir when there is one (they survive a restart), else in memory."""
    bounds = (settings.response_store_count, int(settings.response_store_mb * 1024 * 1024), settings.response_store_ttl)
    if settings.prefix_disk_dir is None:
        return ResponseStore(*bounds)
    settings.prefix_disk_dir.mkdir(parents=True, exist_ok=True)
    return SqliteResponseStore(settings.prefix_disk_dir, *bounds)


def _engine_views(models: ModelSet) -> list:
    return [(m.spec.name, m.engine.scheduler.snapshot, m.engine.scheduler.times, m.engine.async_engine)
            for m in models.loaded]


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


def serve(settings: Settings, specs: list[ModelSpec] | None = None, persistence: Persistence | None = None) -> int:
    """Serve until a signal stops the server; the process's exit status (`DrainingServer.exit_status`)."""
    app = create_app(settings, specs, persistence)
    config = uvicorn.Config(app, host=settings.host, port=settings.port, log_config=log_config(settings.log_format))
    server = DrainingServer(config, app, settings.drain_timeout)
    server.run()
    return server.exit_status

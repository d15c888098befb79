"""What routers and fleet tooling ask each replica, in the shapes they already speak.

- `/server_info` (SGLang's name): smg reads the model name, path and parallel sizes from it;
- `/tokenize`, `/detokenize` (vLLM's shape) and `/v1/{chat/,}completions/render`: vllm-router's
  cache_aware policy matches the tokens a replica would really prefill, so these reuse the request
  path's own prompt functions (`prompts`), never a second rendering.
"""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict

from kvserve import __version__
from kvserve.config import ModelSettings
from kvserve.server.model_set import ModelSet, engine_for, loaded_engine_for
from kvserve.server import prompts
from kvserve.server.schemas import ChatCompletionRequest, CompletionRequest

router = APIRouter()


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    tokens: list[int]


@router.get("/server_info")
async def server_info(request: Request, model: str | None = None) -> dict:
    """One model's facts (`?model=`; with several, the first loaded one's unless named), and every
    model. A model not loaded is reported as its settings say, and stays unloaded; with several
    models of which none is loaded and none named, every model alone: a router's probe loads nothing."""
    models: ModelSet = request.app.state.models
    listed = [models.describe(m) for m in models.models]
    if model is None and not models.single:
        if not models.loaded:
            return {"version": __version__, "engine": "kvserve", "models": listed}
        model = models.loaded[0].spec.name
    served = models.find(model)
    engine = loaded_engine_for(request, model)
    if engine is None:
        return {**_configured(served.spec.settings, listed), **models.describe(served)}  # as /v1/models lists it
    configured = _configured(engine.settings, listed)  # an embedder's are its model's, as it loaded them
    pool = engine.pool
    return {
        **configured,
        "status": {"value": served.status.value},
        "context_length": engine.max_seq_len,
        "max_total_tokens": pool.n_cells,
        "kind": engine.kind,
        "flash_attn": engine.attention.as_dict(),  # what runs and why (--flash-attn and the self-check)
        "flash_attn_enabled": engine.pool.ctx.flash_attn,
        "adapter_switches": engine.scheduler.times.adapter_switches,  # steps that changed the adapter set
        "speculative": engine.scheduler.speculator.describe(),  # what drafts, within what length
        "cache": {
            **configured["cache"],
            "kind": engine.cache.keeps,
            "kv_streams": pool.n_streams,  # one per running sequence, of ctx_size cells each
            "kv_bytes": pool.ctx.kv_bytes,  # the memory of every stream, as llama.cpp allocated it
            **engine.cache.caps(),  # the limits the cache keeps to (host bytes, checkpoints)
        },
    }


def _configured(s: ModelSettings, listed: list[dict]) -> dict:
    """What `/server_info` says of a model from its settings alone: all it says of one not loaded."""
    return {
        "served_model_name": s.served_name,
        "model_path": str(s.model),
        "tp_size": 1,  # one llama.cpp context per replica: scale out with more replicas
        "dp_size": 1,
        "version": __version__,
        "models": listed,
        "engine": "kvserve",
        "lora_adapters": list(s.lora_paths()),  # by name, in id order
        "cache": {"prefix_cache": s.prefix_cache, "ctx_size": s.ctx_size, "parallel": s.parallel,
                  "page_rows": s.page_rows, "cache_type_k": s.cache_type_k, "cache_type_v": s.cache_type_v},
    }


@router.get("/lora-adapters")
async def lora_adapters(request: Request, model: str | None = None) -> list[dict]:
    """llama-server's list of adapters (of `?model=`'s): a request's `lora` entries name them by `id`;
    `scale` is what picking one by its model name applies."""
    s = request.app.state.models.find(model).spec.settings
    return [{"id": i, "name": name, "path": str(path), "scale": s.lora_scale}
            for i, (name, path) in enumerate(s.lora_paths().items())]


@router.post("/tokenize")
async def tokenize(body: dict, request: Request) -> dict:
    """vLLM's /tokenize: `{"prompt"}` or `{"messages"}`, tokenized as that completion or chat would be
    (a chat, by a model that generates)."""
    engine = await engine_for(request, body.get("model") if isinstance(body.get("model"), str) else None,
                              generate="messages" in body)
    tokens = await prompts.body_prompt(engine.model, engine.template, body)
    return {"tokens": tokens, "count": len(tokens), "max_model_len": engine.max_seq_len}


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, request: Request) -> dict:
    model = (await engine_for(request, body.model)).model
    prompts.check_token_ids(model, body.tokens, "tokens")
    # Special tokens spelled out, so that a rendered chat detokenizes to its template text.
    return {"prompt": await asyncio.to_thread(model.detokenize, body.tokens, special=True)}


@router.post("/v1/chat/completions/render")
async def render_chat(body: ChatCompletionRequest, request: Request) -> dict:
    engine = await engine_for(request, body.model, generate=True)
    return {"token_ids": await prompts.prompt_tokens(engine.model, engine.template, body)}


@router.post("/v1/completions/render")
async def render_completion(body: CompletionRequest, request: Request) -> dict:
    engine = await engine_for(request, body.model, generate=True)
    return {"token_ids": await prompts.prompt_tokens(engine.model, engine.template, body)}

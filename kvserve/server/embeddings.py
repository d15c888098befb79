"""POST /v1/embeddings in OpenAI's shape: one L2-normalized, pooled vector per input.

An input is a text (tokenized as llama-server does: the model's special tokens added, special-token
text parsed) or a token array taken as it is. Every input is checked before any is queued, so a bad
one is a 400 naming it (`input[i]`), and nothing is embedded for a request that fails.
"""

from __future__ import annotations

import asyncio
import base64
import uuid
from typing import Literal, Union

import numpy as np
from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr

from kvserve.llama.model import Model
from kvserve.scheduler.async_engine import EngineStopped, QueueFull
from kvserve.scheduler.embeddings import EmbeddingFailed, EmbeddingJob
from kvserve.scheduler.engine import Engine
from kvserve.server.model_set import engine_for
from kvserve.server.schemas import KeepAlive
from kvserve.server.errors import APIError, engine_error, error_responses, invalid, queue_full, shutting_down
# the generation routes' watch on the client (to be made public there once issue 21's rework of that module lands)
from kvserve.server.generation import _ClientGone, _unless_disconnected, accepting, rejected

MAX_INPUTS = 2048  # OpenAI's bound on inputs per request

Input = Union[StrictStr, list[StrictStr], list[StrictInt], list[list[StrictInt]]]


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")  # unknown fields are ignored, as in every body kvserve reads


class EmbeddingRequest(_Body):
    input: Input
    model: str | None = None
    keep_alive: KeepAlive = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)
    user: str | None = None


class EmbeddingData(_Body):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: Union[list[float], str]  # base64: the float32 values, little-endian, as OpenAI encodes them


class EmbeddingUsage(_Body):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(_Body):
    object: Literal["list"] = "list"
    data: list[EmbeddingData]
    model: str
    usage: EmbeddingUsage


router = APIRouter()
_RESPONSES = error_responses(400, 413, 429, 500, 503)


_ROUTE = dict(dependencies=[Depends(accepting)], responses=_RESPONSES, response_model=EmbeddingResponse)


@router.post("/v1/embeddings", **_ROUTE)
@router.post("/embeddings", **_ROUTE)
async def embeddings(body: EmbeddingRequest, request: Request) -> Response:
    engine = await engine_for(request, body.model, keep_alive=body.keep_alive)
    embedder = engine.embedder
    if body.dimensions is not None and body.dimensions != embedder.dimensions:
        raise invalid(f"this model's embeddings have {embedder.dimensions} dimensions; they cannot be shortened",
                      "dimensions")
    inputs = await asyncio.to_thread(input_tokens, engine.model, body.input, embedder.config.batch_tokens)
    job = EmbeddingJob(id=f"embd-{uuid.uuid4().hex}", inputs=inputs)
    try:
        vectors = await _unless_disconnected(request, engine.async_engine.embed(job))
    except _ClientGone:
        return Response(status_code=499)  # the job was cancelled: its inputs not yet embedded are dropped
    except QueueFull as exc:
        raise rejected(request, queue_full(str(exc))) from exc
    except EngineStopped as exc:
        raise shutting_down(str(exc)) from exc
    except EmbeddingFailed as exc:
        error = engine_error(str(exc), exc.status, exc.code)
        raise rejected(request, error) if error.status == 503 else error from exc
    n_tokens = sum(len(tokens) for tokens in inputs)
    return JSONResponse({  # built as a dict: validating 256 x n_embd floats again would only cost time
        "object": "list",
        "data": [{"object": "embedding", "index": i, "embedding": _encoded(v, body.encoding_format)}
                 for i, v in enumerate(vectors)],
        "model": engine.settings.served_name,
        "usage": {"prompt_tokens": n_tokens, "total_tokens": n_tokens},
    })


def input_tokens(model: Model, value: Input, max_tokens: int) -> list[list[int]]:
    """The token ids of each input; a 400 naming the first input that is empty, not text, outside
    the vocabulary or longer than `max_tokens`."""
    if isinstance(value, str) or (value and isinstance(value[0], int)):
        items, params = [value], ["input"]
    else:
        items, params = list(value), [f"input[{i}]" for i in range(len(value))]
    if not items:
        raise invalid("input must not be empty", "input")
    if len(items) > MAX_INPUTS:
        raise invalid(f"input has {len(items)} items; at most {MAX_INPUTS} per request", "input")
    return [_tokens(model, item, param, max_tokens) for item, param in zip(items, params)]


def _tokens(model: Model, item: str | list[int], param: str, max_tokens: int) -> list[int]:
    if isinstance(item, str):
        try:
            item.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise invalid(f"{param} is not valid Unicode text (it holds a lone surrogate)", param) from exc
        tokens = model.tokenize(item, add_special=True, parse_special=True) if item else []
    else:
        if any(not 0 <= t < model.info.n_vocab for t in item):
            raise invalid(f"{param}: token ids must be in [0, {model.info.n_vocab})", param)
        tokens = list(item)
    if not tokens:
        raise invalid(f"{param} must not be empty", param)
    if len(tokens) > max_tokens:
        raise APIError(400, f"{param} has {len(tokens)} tokens; this server embeds at most {max_tokens} tokens "
                            "per input (--embedding-batch, or the model's trained context where smaller)", param=param, code="context_length_exceeded")
    return tokens


def _encoded(vector: np.ndarray, encoding: str) -> list[float] | str:
    if encoding == "base64":
        return base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")
    return vector.tolist()

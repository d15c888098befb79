"""`/v1/responses`: create a response (whole or streamed); retrieve, delete or list the input items
of a stored one (a cancel is refused: no response runs in the background).

A response is served as the chat request it translates to (`to_chat`), so it shares chat's prompt
rendering, grammars and prefix cache: a continuation (`previous_response_id`) renders the earlier
turns exactly as they were served and attaches them from the cache.
"""

from __future__ import annotations

from functools import partial
from typing import AsyncIterator, Callable

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import Response

from kvserve.scheduler.engine import Engine
from kvserve.server import prompts
from kvserve.server.model_set import engine_for
from kvserve.server.auth import owner_of, tenant_of
from kvserve.server.errors import APIError, engine_error, error_responses
from kvserve.server.generation import Answer, Outputs, accepting, respond
from kvserve.server.responses import LogprobFormatter, sse_event
from kvserve.server.responses_api import to_chat
from kvserve.server.responses_api.bodies import ResponseHead, as_input
from kvserve.server.responses_api.events import ResponseEvents
from kvserve.server.responses_api.input_items import Order, input_items, page, with_id
from kvserve.server.responses_api.schemas import CreateResponse, Includable
from kvserve.server.responses_api.store import ResponseStore, StoredResponse

router = APIRouter()

_CREATE = {200: {"content": {"text/event-stream": {}}}, **error_responses(400, 404, 413, 429, 500, 503)}
Keep = Callable[[dict], None]


def _store(request: Request) -> ResponseStore:
    return request.app.state.response_store


def _stored(request: Request, response_id: str, param: str | None = None) -> StoredResponse:
    stored = _store(request).get(response_id, owner_of(request))
    if stored is None:
        raise _not_found(response_id, param)
    return stored


def _not_found(response_id: str, param: str | None = None) -> APIError:
    what = "Previous response" if param else "Response"
    return APIError(404, f"{what} with id '{response_id}' not found.", param=param)


@router.post("/v1/responses", dependencies=[Depends(accepting)], responses=_CREATE)
@router.post("/responses", dependencies=[Depends(accepting)], responses=_CREATE)
async def create_response(body: CreateResponse, request: Request) -> Response:
    engine = await engine_for(request, body.model, keep_alive=body.keep_alive, generate=True)
    store = _store(request)
    history = _stored(request, body.previous_response_id, "previous_response_id").context \
        if body.previous_response_id else []
    with to_chat.in_responses_terms():
        job, reply = await prompts.chat_job(engine, to_chat.chat_request(body, history), tenant=tenant_of(request))
    events = ResponseEvents(ResponseHead(body, engine.settings.served_name),
                            LogprobFormatter(engine.model) if body.wants_logprobs else None, reply)
    context = history + [with_id(item) for item in body.items]
    owner = owner_of(request)

    def keep(final: dict) -> None:
        if body.store and final["status"] != "failed":
            store.put(final, context + [as_input(item) for item in final["output"]], owner)

    streamed = partial(_streamed, events, keep) if body.stream else None
    return await respond(request, engine, job, Answer(partial(_whole, events, keep), streamed, events.finish_reasons))


async def _whole(events: ResponseEvents, keep: Keep, outputs: Outputs) -> dict:
    async for output in outputs:
        if output.error is not None:
            raise engine_error(output.error, output.status, output.code)
        events.feed(output)
    keep(events.final)
    return events.final


async def _streamed(events: ResponseEvents, keep: Keep, outputs: Outputs) -> AsyncIterator[str]:
    for event in events.started():
        yield sse_event(event)
    async for output in outputs:
        for event in events.feed(output):
            yield sse_event(event)
    keep(events.final)


@router.get("/v1/responses/{response_id}", responses=error_responses(404))
@router.get("/responses/{response_id}", responses=error_responses(404))
async def get_response(response_id: str, request: Request) -> dict:
    return _stored(request, response_id).body


@router.delete("/v1/responses/{response_id}", responses=error_responses(404))
@router.delete("/responses/{response_id}", responses=error_responses(404))
async def delete_response(response_id: str, request: Request) -> dict:
    if not _store(request).delete(response_id, owner_of(request)):
        raise _not_found(response_id)
    return {"id": response_id, "object": "response", "deleted": True}


@router.get("/v1/responses/{response_id}/input_items", responses=error_responses(400, 404))
@router.get("/responses/{response_id}/input_items", responses=error_responses(400, 404))
async def list_input_items(
    response_id: str, request: Request, limit: int = Query(20, ge=1, le=100), order: Order = "desc",
    after: str | None = None, before: str | None = None,
    include: list[Includable] = Query([]),  # none adds anything to an input item here
    include_brackets: list[Includable] = Query([], alias="include[]"),  # the openai SDK's spelling
) -> dict:
    return page(input_items(_stored(request, response_id)), order, limit, after, before)


@router.post("/v1/responses/{response_id}/cancel", responses=error_responses(400, 404))
@router.post("/responses/{response_id}/cancel", responses=error_responses(400, 404))
async def cancel_response(response_id: str, request: Request) -> dict:
    _stored(request, response_id)
    raise APIError(400, "Cannot cancel a synchronous response: only a response created with background=true "
                        "can be cancelled, and this server runs none in the background.")

"""`/v1/messages` and `/v1/messages/count_tokens`: Anthropic's Messages API.

A message is served as the chat request it translates to (`to_chat`), so it shares chat's prompt
rendering, tool formats (the generic mode included), grammars and prefix cache; only the shapes
differ. Errors under these routes take Anthropic's shape (see `errors.error_body_at`).
"""

from __future__ import annotations

import asyncio
from functools import partial
from typing import AsyncIterator

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from kvserve.scheduler.engine import Engine
from kvserve.server import prompts
from kvserve.server.model_set import engine_for
from kvserve.server.auth import tenant_of
from kvserve.server.errors import engine_error, error_responses
from kvserve.server.generation import Answer, Outputs, accepting, respond
from kvserve.server.messages_api import to_chat
from kvserve.server.messages_api.events import MessageEvents, MessageHead
from kvserve.server.messages_api.schemas import AnthropicErrorResponse, CountTokens, CreateMessage
from kvserve.server.responses import sse_event

router = APIRouter()

_CREATE = {200: {"content": {"text/event-stream": {}}},
           **error_responses(400, 413, 429, 500, 503, model=AnthropicErrorResponse)}


@router.post("/v1/messages", dependencies=[Depends(accepting)], responses=_CREATE)
async def create_message(body: CreateMessage, request: Request) -> Response:
    engine = await engine_for(request, body.model, keep_alive=body.keep_alive, generate=True)
    with to_chat.in_messages_terms():
        job, reply = await prompts.chat_job(engine, to_chat.chat_request(body), tenant=tenant_of(request))
    events = MessageEvents(MessageHead(engine.settings.served_name, len(job.prompt), body.max_tokens), reply)
    streamed = partial(_streamed, events) if body.stream else None
    return await respond(request, engine, job, Answer(partial(_whole, events), streamed, events.finish_reasons))


async def _whole(events: MessageEvents, outputs: Outputs) -> dict:
    async for output in outputs:
        if output.error is not None:
            raise engine_error(output.error, output.status, output.code)
        events.feed(output)
    return events.message


async def _streamed(events: MessageEvents, outputs: Outputs) -> AsyncIterator[str]:
    for event in events.started():
        yield sse_event(event)
    async for output in outputs:
        for event in events.feed(output):
            yield sse_event(event)


@router.post("/v1/messages/count_tokens", responses=error_responses(400, 413, model=AnthropicErrorResponse))
async def count_tokens(body: CountTokens, request: Request) -> dict:
    """`{"input_tokens"}`: the prompt the same body would be served with, tools included."""
    engine = await engine_for(request, body.model, keep_alive=body.keep_alive, generate=True)
    with to_chat.in_messages_terms():
        prompt = await asyncio.to_thread(prompts.chat_prompt, engine.model, engine.template, to_chat.chat_request(body))
    return {"input_tokens": len(prompt.tokens)}

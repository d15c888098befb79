"""Serving one generation over HTTP: admission, a status chosen from the first output, then a whole
body or an SSE stream. What the body looks like is the endpoint's business (an `Answer`)."""

from __future__ import annotations

import asyncio
import logging
from collections import defaultdict
from dataclasses import dataclass
from typing import AsyncIterator, Awaitable, Callable, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvserve.scheduler.async_engine import EngineStopped, QueueFull, RequestStream
from kvserve.scheduler.engine import Engine
from kvserve.scheduler.request import Request as EngineRequest
from kvserve.scheduler.request import RequestOutput
from kvserve.server.errors import APIError, engine_error
from kvserve.server.metrics import RequestTimer
from kvserve.server.shutdown import SHUTTING_DOWN

_log = logging.getLogger("kvserve.server")
T = TypeVar("T")
Outputs = AsyncIterator[RequestOutput]


@dataclass
class Answer:
    """How an endpoint turns a request's outputs into its body."""

    whole: Callable[[Outputs], Awaitable[dict]]
    stream: Callable[[Outputs], AsyncIterator[str]] | None = None  # set when the client asked for SSE
    # a choice's finish reason as the body says it, from its whole text and the engine's reason
    # (a tool call turns `stop` into `tool_calls`); None: the engine's
    finish_reason: Callable[[str, str], str] | None = None


def rejected(request: Request, error: APIError) -> APIError:
    """Count a request refused for load (429 or 503) before it is answered."""
    request.app.state.metrics.rejected.labels(status=str(error.status)).inc()
    return error


def accepting(request: Request) -> None:
    """A dependency of every generation route: no new work while draining."""
    if request.app.state.draining:
        raise rejected(request, APIError(503, SHUTTING_DOWN, type="server_error", code="shutting_down"))


async def respond(request: Request, engine: Engine, job: EngineRequest, answer: Answer) -> Response:
    """Waits for the first output before answering, so a request the engine refuses (queue timeout,
    a prompt too big for the cache, a failed decode) gets its own status, not a 200 stream."""
    try:
        outputs = engine.async_engine.open(job)
    except QueueFull as exc:
        busy = APIError(429, str(exc), type="rate_limit_error", code="queue_full", headers={"Retry-After": "1"})
        raise rejected(request, busy) from exc
    except EngineStopped as exc:
        raise APIError(503, str(exc), type="server_error", code="shutting_down") from exc
    timer = RequestTimer(request.app.state.metrics, job.arrival)
    try:
        first = await _unless_disconnected(request, outputs.peek())
        if first.error is not None:
            error = engine_error(first.error, first.status)
            raise rejected(request, error) if error.status == 503 else error
        if answer.stream is not None:
            return StreamingResponse(
                answer.stream(_timed(outputs, timer, answer.finish_reason)),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        return JSONResponse(await _unless_disconnected(request, answer.whole(_timed(outputs, timer, answer.finish_reason))))
    except _ClientGone:
        outputs.close()
        return Response(status_code=499)  # nginx's "client closed request": nobody reads it, logs do
    except BaseException:
        outputs.close()
        raise


async def _timed(outputs: RequestStream, timer: RequestTimer,
                 finish_reason: Callable[[str, str], str] | None) -> Outputs:
    """The outputs, observed for metrics and logged at the end; the stream is closed however this ends."""
    reasons: list[str] = []
    texts: dict[int, list[str]] = defaultdict(list)  # each choice's text so far, where finish_reason reads it
    try:
        async for output in outputs:
            timer.observe(output)
            for d in output.deltas:
                if finish_reason is not None:
                    texts[d.index].append(d.text)
                if d.finish_reason is not None:
                    reason = d.finish_reason.value
                    reasons.append(finish_reason("".join(texts[d.index]), reason) if finish_reason else reason)
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

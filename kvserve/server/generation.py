"""Serving one generation over HTTP: admission, a status chosen from the first output, then a whole
body or an SSE stream. What the body looks like is the endpoint's business (an `Answer`)."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import AsyncIterator, Awaitable, Callable, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvserve.scheduler.async_engine import EngineStopped, QueueFull, RequestStream
from kvserve.scheduler.engine import Engine
from kvserve.scheduler.request import Request as EngineRequest
from kvserve.scheduler.request import FinishReason, RequestOutput
from kvserve.server.errors import APIError, engine_error, queue_full, shutting_down
from kvserve.server.metrics import NO_MODEL, RequestTimer

_log = logging.getLogger("kvserve.server")
T = TypeVar("T")
Outputs = AsyncIterator[RequestOutput]


@dataclass
class Answer:
    """How an endpoint turns a request's outputs into its body."""

    whole: Callable[[Outputs], Awaitable[dict]]
    stream: Callable[[Outputs], AsyncIterator[str]] | None = None  # set when the client asked for SSE
    # Each choice's finish reason in chat's terms, as the body said it (a reply that called tools:
    # `tool_calls`), appended by `whole` or `stream` as they end the choice: what metrics count.
    finish_reasons: list[str] = field(default_factory=list)


def rejected(request: Request, error: APIError, engine: Engine | None = None) -> APIError:
    """Count a request refused for load (429 or 503) before it is answered, under its model's name:
    `engine`'s, else the model the request leased (`engine_for`); none yet while draining."""
    metrics = request.app.state.metrics
    if engine is None:
        leases = getattr(request.state, "model_leases", None)
        engine = leases[-1].engine if leases else None
    model_name = metrics.model(engine.settings.served_name) if engine is not None else NO_MODEL
    metrics.rejected.labels(model_name=model_name, status=str(error.status)).inc()
    return error


async def accepting(request: Request) -> None:
    """A dependency of every generation route: no new work while draining."""
    if request.app.state.draining:
        raise rejected(request, shutting_down())


async def respond(request: Request, engine: Engine, job: EngineRequest, answer: Answer) -> Response:
    """Waits for the first output before answering, so a request the engine refuses (queue timeout,
    a prompt too big for the cache, a failed decode) gets its own status, not a 200 stream."""
    try:
        outputs = engine.async_engine.open(job)
    except QueueFull as exc:
        raise rejected(request, queue_full(str(exc)), engine) from exc
    except EngineStopped as exc:
        raise shutting_down(str(exc)) from exc
    served = _Served(outputs, RequestTimer(request.app.state.metrics, job.arrival, engine.settings.served_name))
    try:
        first = await _unless_disconnected(request, outputs.peek())
        if first.error is not None:
            error = engine_error(first.error, first.status, first.code)
            raise rejected(request, error, engine) if error.status == 503 else error
        if answer.stream is not None:
            return StreamingResponse(
                served.ended_after(answer.stream(served.outputs()), answer.finish_reasons, job.n),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        body = await _unless_disconnected(request, answer.whole(served.outputs()))
        served.end(answer.finish_reasons)
        return JSONResponse(body)
    except _ClientGone:
        outputs.close()
        served.end([FinishReason.ABORT.value] * job.n)
        return Response(status_code=499)  # nginx's "client closed request": nobody reads it, logs do
    except BaseException:
        outputs.close()
        raise


class _Served:
    """One request's outputs as its answer reads them, observed for metrics; once the answer is
    whole, `end` logs the request and counts the finish reasons the answer gave."""

    def __init__(self, stream: RequestStream, timer: RequestTimer) -> None:
        self._stream = stream
        self._timer = timer
        self._last: RequestOutput | None = None

    async def outputs(self) -> Outputs:
        """The outputs; the stream is closed however this ends."""
        try:
            async for output in self._stream:
                self._timer.observe(output)
                self._last = output
                yield output
        finally:
            self._stream.close()

    async def ended_after(self, chunks: AsyncIterator[str], reasons: list[str], n: int) -> AsyncIterator[str]:
        """The chunks, then `end`; a stream its client left counts each of its `n` choices aborted."""
        try:
            async for chunk in chunks:
                yield chunk
        except (GeneratorExit, asyncio.CancelledError):
            self.end([FinishReason.ABORT.value] * n)
            raise
        self.end(reasons)

    def end(self, reasons: list[str]) -> None:
        usage = self._last.usage if self._last is not None else None
        if usage is not None:
            _log.info("%s: %d prompt tokens (%d cached), %d generated, finish %s", self._stream.request.id,
                      usage.prompt_tokens, usage.cached_tokens, usage.completion_tokens,
                      ",".join(reasons) or self._last.error)
        self._timer.finished(reasons)


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

"""The bridge between asyncio and the engine thread.

One single-thread executor runs every scheduler step and every other call that touches the llama
context, so llama.cpp only ever sees one thread. `llama_decode` releases the GIL, so the event loop
keeps serving HTTP while a step runs. With no work, the thread does the scheduler's idle work
(`Scheduler.idle`: a ubatch timing for `--speculative auto`) one short piece at a time, looking for
requests between pieces; in the engine's first seconds a timing waits until it has served nothing
for a moment (`Scheduler.idle_delay`). After each step the loop lets the readers take its outputs
before it starts the next (`_until_taken`): a chunk is sent between decodes, not beside one.

Beside another model's engine, an engine with nothing to do for `THREAD_IDLE_S` lets its thread end
(the next call starts another). llama.cpp's OpenMP workers belong to the thread that decoded and
live as long as it does; while two sets live, libgomp manages more threads than there are cores and
spins each worker far less at a barrier, so the other engine decodes slower (the 1.5B: 46-47 ms a
token beside an idle embedding model's engine, 32 alone). Alone, an engine keeps its thread: a new
one cost a SmolLM2 request 3-6 ms.
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, TypeVar

from kvserve.scheduler.cores import CORES
from kvserve.scheduler.embeddings import EmbeddingJob
from kvserve.scheduler.request import Request, RequestOutput
from kvserve.scheduler.scheduler import Scheduler
from kvserve.scheduler.stall_watch import StallWatch

T = TypeVar("T")
THREAD_IDLE_S = 1.0  # an engine idle this long beside another lets its thread end
READER_TURNS = 16  # event loop turns a step's readers get to take its outputs before the next step
STOPPED = "the model was unloaded before the request ended"
_log = logging.getLogger("kvserve.engine")


class EngineStopped(RuntimeError):
    """The engine is not running (not started yet, or shut down)."""


class QueueFull(RuntimeError):
    """Every slot is taken and the waiting queue is at its bound."""


class RequestStream:
    """A request's outputs, in order, until the one carrying usage or an error.

    `close` is synchronous and idempotent, so a cancelled task's `finally` can always call it: a
    stream closed before the engine finished its request aborts it, which frees its sequences at
    the next step.
    """

    def __init__(self, engine: "AsyncEngine", request: Request) -> None:
        self.request = request
        self.finished = False  # the engine emitted the last output
        self._engine = engine
        self._queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self._first: RequestOutput | None = None
        self._read_last = False
        self._closed = False

    def put(self, output: RequestOutput) -> None:
        self.finished = _is_last(output)
        self._queue.put_nowait(output)

    async def peek(self) -> RequestOutput:
        """The first output, which iteration will still yield: a response can wait for it before
        choosing its status."""
        if self._first is None:
            self._first = await self._queue.get()
        return self._first

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if self._read_last:
            raise StopAsyncIteration
        output = await self.peek()
        self._first = None
        self._read_last = _is_last(output)
        return output

    @property
    def taken(self) -> bool:
        """Its reader took every output put so far (or it is closed: nobody will)."""
        return self._closed or (self._first is None and self._queue.empty())

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            if not self.finished:
                self._engine.abort(self.request.id)


def _is_last(output: RequestOutput) -> bool:
    return output.usage is not None or output.error is not None


async def _until_taken(streams: list[RequestStream]) -> None:
    """Let the readers of a step's outputs take them, and so send them, before the next step starts,
    for up to `READER_TURNS` turns of the event loop. A step decodes on every core: a reader left
    to run beside it waited for one, and its work slowed the decode (the first chunk of a 1.5B's
    reply was sent 4-6 ms after its step ended in 3 of 6 restarts)."""
    for _ in range(READER_TURNS):
        if all(stream.taken for stream in streams):
            return
        await asyncio.sleep(0)


class AsyncEngine:
    def __init__(self, scheduler: Scheduler, max_queue: int, stall_seconds: float, threads: int = 1) -> None:
        self.scheduler = scheduler
        self.threads = self._threads_now = threads  # --threads: what its contexts were made with
        self.max_queue = max_queue
        self.stall_watch = StallWatch(scheduler, stall_seconds, self.call)
        self._executor: ThreadPoolExecutor | None = None  # started by the first call after an idle spell
        self._last_call: Future | None = None  # the thread runs calls in order: once it is done, all are
        self._streams: dict[str, RequestStream] = {}
        self._embedding_jobs = 0  # awaited by `embed`
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._watch_task: asyncio.Task[None] | None = None

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    @property
    def in_flight(self) -> int:
        return len(self._streams) + self._embedding_jobs

    def oldest_waiting_seconds(self) -> float:
        """Age of the oldest request in flight not yet admitted (0: none). Read on the event loop, from
        the requests' own arrival and admission times, so it keeps growing while a step is stuck."""
        now = time.monotonic()
        return max((now - s.request.arrival for s in self._streams.values() if s.request.state.admitted_at is None),
                   default=0.0)

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        CORES.join(self)
        self._task = loop.create_task(self._loop(), name="kvserve-engine-loop")
        self._watch_task = loop.create_task(self.stall_watch.run(), name="kvserve-stall-watch")

    async def stop(self) -> None:
        """Stop the loop (idle work gives up at its next check), let the thread finish the call it
        runs, and end each request still open with an error: no reader waits on a stopped engine."""
        self.scheduler.stopping = True
        for task in (self._watch_task, self._task):
            if task is None:
                continue
            task.cancel()
            await asyncio.wait([task])  # its end, however it ends (a cancellation of our caller still raises)
            if not task.cancelled() and task.exception() is not None:
                _log.error("the engine's task %s had failed", task.get_name(), exc_info=task.exception())
        if self._executor is not None:
            self._executor.shutdown(wait=True)
        CORES.leave(self)
        for request_id, stream in list(self._streams.items()):
            stream.put(RequestOutput(request_id, [], error=STOPPED, status=503, code="model_unloaded"))
        self._streams.clear()

    async def call(self, fn: Callable[[], T]) -> T:
        """Run `fn` on the engine thread, between steps; idle work it finds running gives up at its
        next check (a cache view or a router's prefix match waited 6-7 s for the ubatch timing)."""
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvserve-engine")
        scheduler = self.scheduler
        scheduler.calls_submitted += 1  # this thread alone counts these, the engine's thread the others

        def started() -> T:
            scheduler.calls_started += 1
            return fn()

        call = self._last_call = self._executor.submit(started)
        try:
            return await asyncio.wrap_future(call)
        finally:
            if call.cancelled():  # its caller left before it ran: it never will, nor count as started
                scheduler.calls_submitted -= 1

    async def _wait_for_work(self) -> None:
        """Until woken; each `THREAD_IDLE_S` without work while another engine runs, let the thread end."""
        while True:
            try:
                await asyncio.wait_for(self._wakeup.wait(), THREAD_IDLE_S)
                return
            except asyncio.TimeoutError:
                if not CORES.alone(self):
                    self._end_thread()

    def _end_thread(self) -> None:
        """Let the engine thread end, once nothing submitted to it is left to run (never two threads
        on the context: a call abandoned by its caller still runs to its end first)."""
        if self._executor is not None and (self._last_call is None or self._last_call.done()):
            self._executor.shutdown(wait=False)
            self._executor = None

    def open(self, request: Request) -> RequestStream:
        """Submit a request; its stream must be closed when read. Past `--parallel` + `--max-queue` requests in
        flight, nothing is submitted and `QueueFull` is raised."""
        self._check_room()
        stream = RequestStream(self, request)
        self._streams[request.id] = stream
        self.scheduler.submit(request)
        self._wakeup.set()
        return stream

    async def embed(self, job: EmbeddingJob) -> list:
        """The job's vectors, embedded between generation steps; the same queue bound as `open`.
        Raises `EmbeddingFailed`; cancelling the wait drops the job at the next step."""
        self._check_room()
        if self.scheduler.embedder is None:
            raise EngineStopped("this engine serves no embeddings")
        self._embedding_jobs += 1
        try:
            self.scheduler.embedder.submit(job)
            self._wakeup.set()
            return await asyncio.wrap_future(job.future)
        finally:
            self._embedding_jobs -= 1
            job.future.cancel()  # no-op once it has a result; otherwise the engine drops the job

    def _step(self) -> list[RequestOutput]:
        """One step with this engine's share of the threads (`CORES`: all of them while no other
        model's engine has work)."""
        return self._with_threads(self.scheduler.step)

    def _with_threads(self, fn: Callable[[], T]) -> T:
        with CORES.share(self, self.threads, self.scheduler.has_work) as n:
            if n != self._threads_now:
                self.scheduler.set_threads(n)
                self._threads_now = n
            return fn()

    def _check_room(self) -> None:
        if not self.running:
            raise EngineStopped("the engine is not running")
        if self.in_flight >= self.scheduler.config.max_running + self.max_queue:
            raise QueueFull(f"{self.in_flight} requests are in flight, the most this server queues")

    def abort(self, request_id: str) -> None:
        self._streams.pop(request_id, None)
        self.scheduler.abort(request_id)
        self._wakeup.set()

    async def drain(self, timeout: float, message: str, code: str, cut: asyncio.Event) -> int:
        """Wait up to `timeout` seconds, or until `cut` is set, for the requests in flight to end,
        then fail the rest with a 503 saying `message` (its `code`); returns how many were failed."""
        deadline = time.monotonic() + timeout
        while self.in_flight and time.monotonic() < deadline and not cut.is_set():
            await asyncio.sleep(0.05)
        left = list(self._streams)
        for request_id in left:
            self.scheduler.abort(request_id, error=message, code=code)
        embedder = self.scheduler.embedder
        failed = await self.call(lambda: embedder.fail_all(message, code)) if embedder and self.running else 0
        self._wakeup.set()
        return len(left) + failed

    async def _loop(self) -> None:
        while True:
            if not self.scheduler.has_work():
                if not self.scheduler.wants_idle():
                    await self._wait_for_work()
                elif (delay := self.scheduler.idle_delay()) <= 0:  # one piece of idle work, then look again
                    await self.call(lambda: self._with_threads(self.scheduler.idle))
                    continue
                else:  # not yet: unless a request comes first
                    try:
                        await asyncio.wait_for(self._wakeup.wait(), delay)
                    except asyncio.TimeoutError:
                        continue
            self._wakeup.clear()
            started = time.perf_counter()
            outputs = await self.call(self._step)
            fed = []
            for output in outputs:
                stream = self._streams.get(output.request_id)
                if stream is None:
                    continue
                if _is_last(output):  # it leaves here, read or not: `in_flight` counts what the engine serves
                    del self._streams[output.request_id]
                stream.put(output)
                fed.append(stream)
            await _until_taken(fed)
            self.scheduler.times.loop_seconds += time.perf_counter() - started

"""The bridge between asyncio and the engine thread.

One single-thread executor runs every scheduler step and every other call that touches the llama
context, so llama.cpp only ever sees one thread. `llama_decode` releases the GIL, so the event loop
keeps serving HTTP while a step runs.
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from typing import AsyncIterator, Callable, TypeVar

from kvserve.scheduler.request import Request, RequestOutput
from kvserve.scheduler.scheduler import Scheduler

T = TypeVar("T")


class EngineStopped(RuntimeError):
    """The engine is not running (not started yet, or shut down)."""


class AsyncEngine:
    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvserve-engine")
        self._streams: dict[str, asyncio.Queue[RequestOutput]] = {}
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._loop(), name="kvserve-engine-loop")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        self._executor.shutdown(wait=True)

    async def call(self, fn: Callable[[], T]) -> T:
        """Run `fn` on the engine thread, between steps."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn)

    async def generate(self, request: Request) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs until the one carrying usage or an error. Leaving early aborts it."""
        if not self.running:
            raise EngineStopped("the engine is not running")
        queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self._streams[request.id] = queue
        self.scheduler.submit(request)
        self._wakeup.set()
        done = False
        try:
            while not done:
                output = await queue.get()
                done = output.usage is not None or output.error is not None
                yield output
        finally:
            del self._streams[request.id]
            if not done:
                self.scheduler.abort(request.id)
                self._wakeup.set()

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if not self.scheduler.has_work():
                await self._wakeup.wait()
            self._wakeup.clear()
            started = time.perf_counter()
            outputs = await loop.run_in_executor(self._executor, self.scheduler.step)
            for output in outputs:
                queue = self._streams.get(output.request_id)
                if queue is not None:
                    queue.put_nowait(output)
            self.scheduler.times.loop_seconds += time.perf_counter() - started

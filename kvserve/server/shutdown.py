"""Graceful shutdown: SIGTERM (or Ctrl-C) drains before uvicorn stops.

The first signal marks the app draining (new generation requests and /health answer 503), gives
the requests in flight `--drain-timeout` seconds, fails the rest with an error the client sees,
then lets uvicorn close the sockets and run the lifespan shutdown, which releases the cache and
the pool in order. A second signal exits at once.
"""

from __future__ import annotations

import asyncio
import logging
from types import FrameType

import uvicorn
from fastapi import FastAPI

_log = logging.getLogger("kvserve.server")

SHUTTING_DOWN = "the server is shutting down"


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, app: FastAPI, drain_timeout: float) -> None:
        super().__init__(config)
        self.fastapi = app
        self.drain_timeout = drain_timeout
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain: asyncio.Task[None] | None = None  # held: the loop keeps only weak references to tasks

    async def serve(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # Not uvicorn's own handler: it would re-raise the signal after shutdown, and the process
        # would die by SIGTERM instead of exiting 0.
        if self.fastapi.state.draining or self._loop is None:
            self.should_exit = self.force_exit = True
            return
        self.fastapi.state.draining = True
        self._loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        self._drain = asyncio.get_running_loop().create_task(self._drain_then_exit())

    async def _drain_then_exit(self) -> None:
        try:
            models = getattr(self.fastapi.state, "models", None)
            if models is not None:
                models.draining = True  # no model loads or unloads for a request from now
            engines = [m.engine.async_engine for m in models.loaded] if models is not None else []
            running = [engine for engine in engines if engine.running]
            if running:
                _log.info("draining: %d requests in flight, up to %gs", sum(e.in_flight for e in running), self.drain_timeout)
                failed = sum(await asyncio.gather(*(e.drain(self.drain_timeout, SHUTTING_DOWN, "shutting_down") for e in running)))
                _log.info("drained; %d requests were cut short", failed)
        finally:  # whatever the drain met, the server stops
            self.should_exit = True

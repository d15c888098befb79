"""Graceful shutdown: SIGTERM (or Ctrl-C) drains before uvicorn stops.

The first signal marks the app draining (new generation requests and /health answer 503), gives
the requests in flight `--drain-timeout` seconds, fails the rest with an error the client sees,
then lets uvicorn close the sockets and run the lifespan shutdown, which releases the cache and
the pool in order; the process exits 0.

Invariants:
- a second signal cuts the drain short: what is in flight fails at once with the same error, the
  shutdown goes on as after a drain, and the process exits 128 + the second signal's number (130
  for Ctrl-C, 143 for SIGTERM), as a shell reports a process a signal interrupted;
- a signal before the server listens (the model still loading), or a third one, exits at once
  (`signals.exit_now`).
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import signal
from types import FrameType

import uvicorn
from fastapi import FastAPI

from kvserve.server.errors import SHUTTING_DOWN
from kvserve.server.signals import exit_now, interrupted_status

_log = logging.getLogger("kvserve.server")


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, app: FastAPI, drain_timeout: float) -> None:
        super().__init__(config)
        self.fastapi = app
        self.drain_timeout = drain_timeout
        self.signals: list[int] = []  # those received, in order
        self._loop: asyncio.AbstractEventLoop | None = None
        self._cut = asyncio.Event()  # set by the second signal: the drain waits no longer
        self._drain: asyncio.Task[None] | None = None  # held: the loop keeps only weak references to tasks

    @property
    def exit_status(self) -> int:
        """0 after a drain; a cut drain's status says which signal cut it."""
        return interrupted_status(self.signals[1]) if len(self.signals) > 1 else 0

    async def serve(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # Not uvicorn's own handler: it would re-raise the signal after shutdown, and the process
        # would die by SIGTERM instead of exiting 0. Run outside the context of the request the
        # signal interrupted, whose id would tag the lines logged here.
        contextvars.Context().run(self._signalled, sig)

    def _signalled(self, sig: int) -> None:
        self.signals.append(sig)
        if not self.started or self._loop is None or len(self.signals) > 2:  # the loop: set once started
            exit_now(sig)
        if len(self.signals) == 2:
            _log.warning("%s again: failing the requests in flight now", signal.Signals(sig).name)
            self._loop.call_soon_threadsafe(self._cut.set)
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
                drains = (e.drain(self.drain_timeout, SHUTTING_DOWN, "shutting_down", self._cut) for e in running)
                failed = sum(await asyncio.gather(*drains))
                _log.info("drained; %d requests were cut short", failed)
        finally:  # whatever the drain met, the server stops
            self.should_exit = True

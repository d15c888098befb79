"""A watchdog for the engine: it notices when requests wait or run while no step makes progress.

A stall is `bound` seconds in which the scheduler had work and no step evaluated a token or ended a
request, whether steps keep running without moving anything (a request waiting on cells nobody will
free) or one step never returns. Invariant: one warning per stall, with the scheduler's state, and
one line when progress resumes.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Awaitable, Callable

from kvserve.scheduler.scheduler import Scheduler

_log = logging.getLogger("kvserve.scheduler")

# How long a stall report waits for the engine thread to describe its state; a thread stuck inside
# one step never answers, and that is itself the answer.
_DESCRIBE_TIMEOUT = 2.0


class StallWatch:
    def __init__(self, scheduler: Scheduler, bound: float, on_engine_thread: Callable[[Callable[[], str]], Awaitable[str]]) -> None:
        self.scheduler = scheduler
        self.bound = bound
        self.stalls = 0  # stalls reported since start
        self._on_engine_thread = on_engine_thread

    async def run(self) -> None:
        poll = min(1.0, self.bound / 4)
        idle_since = time.monotonic()
        stalled = False
        while True:
            await asyncio.sleep(poll)
            now = time.monotonic()
            if not self.scheduler.has_work():
                idle_since, stalled = now, False
                continue
            stuck_for = now - max(self.scheduler.last_progress, idle_since)
            if stuck_for < self.bound:
                if stalled:
                    _log.info("engine progress resumed")
                stalled = False
            elif not stalled:
                stalled = True
                self.stalls += 1
                _log.warning("engine stall: no progress for %.0fs with work to do; %s", stuck_for, await self._state())

    async def _state(self) -> str:
        try:
            return await asyncio.wait_for(self._on_engine_thread(self.scheduler.describe), _DESCRIBE_TIMEOUT)
        except asyncio.TimeoutError:
            return f"the engine thread has not come back from one step (running {self.scheduler.n_running}, " \
                   f"waiting {self.scheduler.n_waiting})"

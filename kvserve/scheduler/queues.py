"""The requests a scheduler holds: `running` ones, in admission order (the newest last), and
`waiting` ones, the next first (a preempted request goes back to the head).

Every part of the scheduler shares the one `Queues` and mutates its lists in place, never replacing
them; a request sits in at most one of them.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from kvserve.scheduler.request import Request


@dataclass
class Queues:
    running: list[Request] = field(default_factory=list)
    waiting: deque[Request] = field(default_factory=deque)

    def remove(self, request: Request) -> None:
        if request in self.running:
            self.running.remove(request)
        if request in self.waiting:
            self.waiting.remove(request)

"""The CPU threads that the loaded models' engines share: each step takes its share, and engines
with work at the same time split the threads between them instead of each running all of them.

Two llama.cpp thread pools on the same cores spin at their barriers while the other holds the
cores, and taking whole turns leaves a chat model idle through every long embedding batch (bench
models: one process taking turns gave chat 0.23x of two processes with the threads split). So an
engine with work steps with `threads // engines with work` threads (at least 1), at the same time
as the others.

Invariants:
- the threads of the steps running at once never exceed the largest `threads` of the engines that
  asked (an engine alone, the usual case, always gets all of its own);
- an engine is counted as having work from its first `step` until a step ends with none left;
- a step that does not fit waits for a running one to end; it never waits while nothing runs.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Callable, Iterator


class Cores:
    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._busy: dict[object, int] = {}  # engine -> its own --threads, while it has work
        self._running: set[object] = set()  # every engine started and not stopped
        self._in_use = 0

    @contextlib.contextmanager
    def share(self, engine: object, threads: int, has_work: Callable[[], bool]) -> Iterator[int]:
        """Threads for one step of `engine` (whose own setting is `threads`), held while it runs."""
        with self._cond:
            self._busy[engine] = threads
            while True:
                budget = max(self._busy.values())
                n = min(threads, max(1, budget // len(self._busy)))
                if self._in_use == 0 or self._in_use + n <= budget:
                    break
                self._cond.wait()
            self._in_use += n
        try:
            yield n
        finally:
            with self._cond:
                self._in_use -= n
                if not has_work():
                    self._busy.pop(engine, None)
                self._cond.notify_all()

    def join(self, engine: object) -> None:
        """`engine` starts (its model loaded)."""
        with self._cond:
            self._running.add(engine)

    def leave(self, engine: object) -> None:
        """`engine` stops (its model unloads): it no longer counts as having work."""
        with self._cond:
            self._busy.pop(engine, None)
            self._running.discard(engine)
            self._cond.notify_all()

    def alone(self, engine: object) -> bool:
        """Whether no other engine is running beside `engine`."""
        with self._cond:
            return self._running <= {engine}


CORES = Cores()  # one per process: every engine of the server shares the machine's cores

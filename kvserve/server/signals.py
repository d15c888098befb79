"""SIGINT and SIGTERM where there is nothing to drain: before the server listens (settings read,
the model loading) and past the second signal of a drain (`shutdown.DrainingServer`).

Invariant: such a signal ends the process at once, with one line in the log and the status a shell
gives a process a signal interrupted (128 + its number: 130 for Ctrl-C, 143 for SIGTERM); nothing
is waited for, not even llama.cpp's load, which cannot be interrupted.
"""

from __future__ import annotations

import logging
import os
import signal
from contextlib import contextmanager
from types import FrameType
from typing import Iterator, NoReturn

_log = logging.getLogger("kvserve.server")


def interrupted_status(sig: int) -> int:
    return 128 + sig


def exit_now(sig: int, frame: FrameType | None = None) -> NoReturn:
    """A signal handler: one line, then the process ends, whatever its threads are doing."""
    _log.warning("%s: exiting at once", signal.Signals(sig).name)
    os._exit(interrupted_status(sig))


@contextmanager
def exiting_at_once() -> Iterator[None]:
    """Inside, SIGINT and SIGTERM call `exit_now` (unless a server inside installs its own handlers)."""
    previous = {sig: signal.signal(sig, exit_now) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)

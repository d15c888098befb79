"""SIGINT and SIGTERM where there is nothing more to drain: past the second signal of a drain
(`shutdown.DrainingServer`).

Invariant: such a signal ends the process at once, with one line in the log and the status a shell
gives a process a signal interrupted (128 + its number: 130 for Ctrl-C, 143 for SIGTERM); nothing
is waited for.
"""

from __future__ import annotations

import logging
import os
import signal
from types import FrameType
from typing import NoReturn

_log = logging.getLogger("kvserve.server")


def interrupted_status(sig: int) -> int:
    return 128 + sig


def exit_now(sig: int, frame: FrameType | None = None) -> NoReturn:
    """A signal handler: one line, then the process ends, whatever its threads are doing."""
    _log.warning("%s: exiting at once", signal.Signals(sig).name)
    os._exit(interrupted_status(sig))

"""Process-wide llama.cpp initialisation: the backend once, and its log routed to Python's logging."""

from __future__ import annotations

import contextlib
import ctypes
import logging
import threading
from typing import Callable, Iterator

import llama_cpp

_log = logging.getLogger("kvserve.llama")
_lock = threading.Lock()
_ready = False

# enum ggml_log_level (ggml.h): 0 none, 1 debug, 2 info, 3 warn, 4 error, 5 continues the previous
# message at its level. How much of it a log shows is the logging configuration's choice.
_LEVELS = {1: logging.DEBUG, 2: logging.INFO, 3: logging.WARNING, 4: logging.ERROR}
_CONTINUATION = 5
_last_level = logging.DEBUG


_listeners: list[Callable[[str], None]] = []
_quiet = threading.local()  # `quiet()`'s depth on the thread that logs


@llama_cpp.llama_log_callback
def _forward_log(level: int, text: bytes, _user_data: ctypes.c_void_p) -> None:
    global _last_level
    if level != _CONTINUATION:
        _last_level = _LEVELS.get(level, logging.DEBUG)
    line = text.decode("utf-8", errors="replace").rstrip()
    for listener in _listeners:
        listener(line)
    level = logging.DEBUG if getattr(_quiet, "depth", 0) else _last_level
    if line and _log.isEnabledFor(level):
        _log.log(level, line)


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """What llama.cpp logs on this thread during the block, at DEBUG whatever its level: the errors of
    a call whose failure is expected and handled (an aborted decode)."""
    _quiet.depth = getattr(_quiet, "depth", 0) + 1
    try:
        yield
    finally:
        _quiet.depth -= 1


@contextlib.contextmanager
def log_lines() -> Iterator[list[str]]:
    """Every line llama.cpp logs during the block, at any level: some choices it makes (flash
    attention under `auto`) are reported only there."""
    lines: list[str] = []
    _listeners.append(lines.append)
    try:
        yield lines
    finally:
        _listeners.remove(lines.append)


def ensure_backend() -> None:
    """Initialise llama.cpp exactly once per process (thread-safe)."""
    global _ready
    with _lock:
        if not _ready:
            llama_cpp.llama_backend_init()
            llama_cpp.llama_log_set(_forward_log, ctypes.c_void_p(0))
            _ready = True

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

# ggml's levels: 1 info, 2 warn, 3 error, 4 debug, 5 continuation. The model loader dumps its
# metadata at "warn", so llama.cpp's warnings go to DEBUG and only its errors stand out.
_FORWARDED_LEVELS = {2: logging.DEBUG, 3: logging.ERROR}


_listeners: list[Callable[[str], None]] = []


@llama_cpp.llama_log_callback
def _forward_log(level: int, text: bytes, _user_data: ctypes.c_void_p) -> None:
    line = text.decode("utf-8", errors="replace").rstrip()
    for listener in _listeners:
        listener(line)
    if level in _FORWARDED_LEVELS and line:
        _log.log(_FORWARDED_LEVELS[level], line)


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

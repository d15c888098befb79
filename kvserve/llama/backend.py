"""Process-wide llama.cpp initialisation: the backend once, and its log routed to Python's logging."""

from __future__ import annotations

import ctypes
import logging
import threading

import llama_cpp

_log = logging.getLogger("kvserve.llama")
_lock = threading.Lock()
_ready = False

# enum ggml_log_level (ggml.h): 0 none, 1 debug, 2 info, 3 warn, 4 error, 5 continues the previous
# message at its level. How much of it a log shows is the logging configuration's choice.
_LEVELS = {1: logging.DEBUG, 2: logging.INFO, 3: logging.WARNING, 4: logging.ERROR}
_CONTINUATION = 5
_last_level = logging.DEBUG


@llama_cpp.llama_log_callback
def _forward_log(level: int, text: bytes, _user_data: ctypes.c_void_p) -> None:
    global _last_level
    if level != _CONTINUATION:
        _last_level = _LEVELS.get(level, logging.DEBUG)
    if text.strip() and _log.isEnabledFor(_last_level):
        _log.log(_last_level, text.decode("utf-8", errors="replace").rstrip())


def ensure_backend() -> None:
    """Initialise llama.cpp exactly once per process (thread-safe)."""
    global _ready
    with _lock:
        if not _ready:
            llama_cpp.llama_backend_init()
            llama_cpp.llama_log_set(_forward_log, ctypes.c_void_p(0))
            _ready = True

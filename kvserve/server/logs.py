"""Logging: every line carries the request id of the HTTP request it belongs to, as text or JSON."""

from __future__ import annotations

import json
import logging
from urllib.parse import unquote_plus
from contextvars import ContextVar
from datetime import datetime, timezone
from typing import Any

# Set by the request-id middleware for the task serving one HTTP request (and tasks it starts).
request_id: ContextVar[str | None] = ContextVar("request_id", default=None)


class RequestIdFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        record.request_id = request_id.get() or "-"
        return True


class SecretQueryFilter(logging.Filter):
    """An access line's `cache_salt` query value is not logged (under `--cache-isolation none` a salt
    is all that keeps one caller's cached rows from another's)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.name == "uvicorn.access" and isinstance(record.args, tuple) and len(record.args) >= 3:
            path = record.args[2]
            if isinstance(path, str) and "?" in path:
                record.args = (*record.args[:2], _redacted(path), *record.args[3:])
        return True


def _redacted(path: str) -> str:
    """`path` with the value of each query parameter that decodes to `cache_salt` (however its name
    is encoded: the server decodes it before reading it) replaced."""
    route, _, query = path.partition("?")
    pairs = []
    for pair in query.split("&"):
        name, equals, _value = pair.partition("=")
        pairs.append(f"{name}=<redacted>" if equals and unquote_plus(name) == "cache_salt" else pair)
    return f"{route}?{'&'.join(pairs)}"


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, request_id, message (and exception)."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, timezone.utc).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "request_id": getattr(record, "request_id", "-"),
            "message": record.getMessage(),
        }
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False)


def log_config(log_format: str) -> dict[str, Any]:
    """A `logging.config.dictConfig` for kvserve and uvicorn (uvicorn applies it at start)."""
    formatter = (
        {"()": JsonFormatter}
        if log_format == "json"
        else {"format": "%(asctime)s %(levelname)s %(name)s [%(request_id)s] %(message)s"}
    )
    handler = {"class": "logging.StreamHandler", "formatter": "default", "filters": ["request_id", "secrets"],
               "stream": "ext://sys.stderr"}
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "filters": {"request_id": {"()": RequestIdFilter}, "secrets": {"()": SecretQueryFilter}},
        "formatters": {"default": formatter},
        "handlers": {"default": handler},
        "root": {"handlers": ["default"], "level": "INFO"},
        "loggers": {
            **{name: {"handlers": [], "propagate": True} for name in ("uvicorn", "uvicorn.error", "uvicorn.access")},
            # llama.cpp's INFO is its loading report, some 200 lines per model: warnings and errors only
            "kvserve.llama": {"level": "WARNING"},
        },
    }

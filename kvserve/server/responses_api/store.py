"""Finished responses kept in memory, for `GET`/`DELETE /v1/responses/{id}` and `previous_response_id`.

Each replica has its own store, shared with no other. This one is the store of a server without a
data dir: nothing is persisted, and a restart empties it (with `--prefix-disk-dir` the server keeps
them in SQLite instead, `sqlite_store`, with the same bounds and owners). A stored response belongs
to the API key that created it: another key can neither read, continue nor delete it, and is told
it does not exist.
"""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable

from kvserve.server.responses_api.schemas import InputItem


@dataclass(frozen=True)
class StoredResponse:
    body: dict  # the response object, as it was answered
    context: list[InputItem]  # every item it saw (earlier turns and its input) then its output
    size: int  # bytes of both as JSON: what the store's budget counts
    expires: float
    owner: str | None = None  # the id of the key that stored it (None: a server without keys)


def size_of(body: dict, context: list[InputItem]) -> int:
    """Bytes of a response and its context as JSON: what a store's byte budget counts."""
    return len(json.dumps(body)) + sum(len(item.model_dump_json().encode()) for item in context)


class ResponseStore:
    """At most `max_count` responses and `max_bytes` of them; each expires `ttl` seconds after it
    was stored. When a new one does not fit, the oldest go first; one bigger than the whole budget
    is not kept. A lock guards every method, so the event loop and worker threads may share it."""

    def __init__(self, max_count: int, max_bytes: int, ttl: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.max_count = max_count
        self.max_bytes = max_bytes
        self.ttl = ttl
        self.bytes_used = 0
        self._clock = clock
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()  # oldest first
        self._lock = threading.Lock()

    def put(self, body: dict, context: list[InputItem], owner: str | None = None) -> bool:
        """Keep `body` under its id, for `owner` alone; False when it does not fit at all."""
        size = size_of(body, context)
        if self.max_count < 1 or size > self.max_bytes:
            return False
        entry = StoredResponse(body, context, size, self._clock() + self.ttl, owner)
        with self._lock:
            self._drop(body["id"])
            self._drop_expired()
            while self._entries and (len(self._entries) >= self.max_count or self.bytes_used + size > self.max_bytes):
                self._drop(next(iter(self._entries)))
            self._entries[body["id"]] = entry
            self.bytes_used += size
        return True

    def get(self, response_id: str, owner: str | None = None) -> StoredResponse | None:
        """The response stored under `response_id` by `owner`; None for any other owner."""
        with self._lock:
            self._drop_expired()
            entry = self._entries.get(response_id)
            return entry if entry is not None and entry.owner == owner else None

    def delete(self, response_id: str, owner: str | None = None) -> bool:
        with self._lock:
            self._drop_expired()
            entry = self._entries.get(response_id)
            return entry is not None and entry.owner == owner and self._drop(response_id)

    def __len__(self) -> int:
        with self._lock:
            self._drop_expired()
            return len(self._entries)

    def _drop_expired(self) -> None:
        # Entries are in storing order and share one ttl, so the expired ones are a prefix.
        now = self._clock()
        while self._entries and next(iter(self._entries.values())).expires <= now:
            self._drop(next(iter(self._entries)))

    def _drop(self, response_id: str) -> bool:
        entry = self._entries.pop(response_id, None)
        if entry is not None:
            self.bytes_used -= entry.size
        return entry is not None

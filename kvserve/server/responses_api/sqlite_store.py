"""Finished responses kept in SQLite, in the server's data dir: the store that outlives a restart.

The same store as `store.ResponseStore` (its methods, owners, count and byte bounds, oldest-first
eviction), on one file, `DIR/responses.sqlite3`. Invariants:

- One row per response id; `seq` is the storing order (a stored id is stored again at the end),
  so the oldest row has the smallest `seq`.
- `expires` is wall-clock time (`time.time()` unless a test passes a clock): a monotonic clock
  starts again at each boot, so only the wall clock means the same after a restart. A row whose
  `expires` has passed is never answered; `put` deletes those rows.
- After a `put` the unexpired rows number at most `max_count` and their `size` sums to at most
  `max_bytes` (opening trims to the bounds too, in case they shrank since the last run). No row
  expires later than the TTL of the run that opened the store: opening brings later ones in.
- Writes run in `BEGIN IMMEDIATE` transactions, so the bounds hold even with two stores on one
  file; within a store one lock serialises every use of its one connection, which the event loop
  and worker threads share (`check_same_thread=False`). WAL journal, `synchronous=NORMAL`: a
  crash of the machine may lose the last responses, never the file.
- A file that is not a readable database of this layout is renamed aside
  (`responses.sqlite3.corrupt-<unix time>`, with its -wal and -shm) and an empty one started, at
  open or when a query meets corruption later; a row that does not decode (its body not a response
  object with its id and a list `output`, its context not input items) is absent and deleted.
  Other SQLite errors (disk full, a lock held too long) are logged, and the call answers as if
  the response were not there: a store that fails costs a continuation, never the server.
"""

from __future__ import annotations

import contextlib
import json
import logging
import sqlite3
import threading
import time
from pathlib import Path
from typing import Callable, TypeVar

from pydantic import TypeAdapter, ValidationError

from kvserve.server.responses_api.schemas import InputItem
from kvserve.server.responses_api.store import StoredResponse, size_of

_log = logging.getLogger("kvserve.server")

FILE_NAME = "responses.sqlite3"
_CONTEXT = TypeAdapter(list[InputItem])
# SQLITE_CORRUPT and SQLITE_NOTADB: the file, not the query, is at fault (Python 3.10's errors carry
# no code, only these messages).
_CORRUPT_CODES = {11, 26}
_CORRUPT_MESSAGES = ("database disk image is malformed", "file is not a database")
_SCHEMA = """
CREATE TABLE IF NOT EXISTS responses (
    seq INTEGER PRIMARY KEY,
    id TEXT NOT NULL UNIQUE,
    owner TEXT,
    expires REAL NOT NULL,
    size INTEGER NOT NULL,
    body TEXT NOT NULL,
    context TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS responses_expires ON responses (expires);
"""
_COLUMNS = ["seq", "id", "owner", "expires", "size", "body", "context"]
T = TypeVar("T")


class _Unusable(sqlite3.DatabaseError):
    """A database that opens but is not one this store can use."""


def _response_object(body: object, response_id: str) -> dict:
    """A stored body that decodes: a response object, a dict whose `id` is `response_id` and whose
    `output` is a list; anything else (valid JSON or not) raises ValueError."""
    if not (isinstance(body, dict) and body.get("id") == response_id and isinstance(body.get("output"), list)):
        raise ValueError("the body is not this response's object")
    return body


def _corrupt(error: sqlite3.Error) -> bool:
    return (isinstance(error, _Unusable) or getattr(error, "sqlite_errorcode", None) in _CORRUPT_CODES
            or any(message in str(error) for message in _CORRUPT_MESSAGES))


class SqliteResponseStore:
    """`ResponseStore`'s interface over `directory / responses.sqlite3`; `close()` when done."""

    def __init__(self, directory: Path, max_count: int, max_bytes: int, ttl: float,
                 clock: Callable[[], float] = time.time) -> None:
        self.path = Path(directory) / FILE_NAME
        self.max_count = max_count
        self.max_bytes = max_bytes
        self.ttl = ttl
        self._clock = clock
        self._lock = threading.Lock()
        self._db = self._open()

    def put(self, body: dict, context: list[InputItem], owner: str | None = None) -> bool:
        """Keep `body` under its id, for `owner` alone; False when it does not fit at all."""
        size = size_of(body, context)
        if self.max_count < 1 or size > self.max_bytes:
            return False
        row = (body["id"], owner, self._clock() + self.ttl, size, json.dumps(body),
               "[" + ",".join(item.model_dump_json() for item in context) + "]")
        return self._use(lambda: self._insert(row, size), False)

    def get(self, response_id: str, owner: str | None = None) -> StoredResponse | None:
        """The response stored under `response_id` by `owner`; None for any other owner."""
        return self._use(lambda: self._select(response_id, owner), None)

    def delete(self, response_id: str, owner: str | None = None) -> bool:
        return self._use(lambda: self._write(
            "DELETE FROM responses WHERE id = ? AND owner IS ? AND expires > ?",
            (response_id, owner, self._clock())) > 0, False)

    def __len__(self) -> int:
        return self._use(lambda: self._db.execute(
            "SELECT COUNT(*) FROM responses WHERE expires > ?", (self._clock(),)).fetchone()[0], 0)

    @property
    def bytes_used(self) -> int:
        return self._use(lambda: self._db.execute(
            "SELECT COALESCE(SUM(size), 0) FROM responses WHERE expires > ?", (self._clock(),)).fetchone()[0], 0)

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def _open(self) -> sqlite3.Connection:
        """The database at `self.path`, checked and trimmed to the bounds; a corrupt one is moved
        aside and an empty one opened in its place. Other errors (a folder it may not write) raise."""
        try:
            return self._checked(self._connect())
        except sqlite3.DatabaseError as error:
            if not _corrupt(error):
                raise
            self._move_aside(error)
            return self._checked(self._connect())

    def _connect(self) -> sqlite3.Connection:
        # isolation_level=None: no implicit transactions; writes open their own BEGIN IMMEDIATE.
        return sqlite3.connect(self.path, timeout=10.0, isolation_level=None, check_same_thread=False)

    def _checked(self, db: sqlite3.Connection) -> sqlite3.Connection:
        """`db`, now this store's connection, once it passed `quick_check` and holds the table."""
        try:
            verdict = db.execute("PRAGMA quick_check").fetchone()[0]
            if verdict != "ok":
                raise _Unusable(f"quick_check: {verdict}")
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=NORMAL")
            db.executescript(_SCHEMA)
            columns = [row[1] for row in db.execute("PRAGMA table_info(responses)")]
            if columns != _COLUMNS:
                raise _Unusable(f"a responses table of another layout: {', '.join(columns)}")
            self._db = db
            self._transaction(self._trim)
            return db
        except sqlite3.Error:
            db.close()
            raise

    def _move_aside(self, error: Exception) -> None:
        aside = f"{self.path}.corrupt-{int(time.time())}"
        _log.warning("response store %s is unreadable (%s): moved to %s, starting an empty one",
                     self.path, error, aside)
        for suffix in ("", "-wal", "-shm"):
            source = Path(f"{self.path}{suffix}")
            if source.exists():
                source.replace(f"{aside}{suffix}")

    def _use(self, query: Callable[[], T], failed: T) -> T:
        """`query()` under the lock; on an SQLite error, `failed` (after starting an empty
        database when the file turned out corrupt)."""
        with self._lock:
            try:
                return query()
            except sqlite3.Error as error:
                _log.warning("response store %s: %s", self.path, error)
                if _corrupt(error):
                    self._reopen(error)
                return failed

    def _reopen(self, error: sqlite3.Error) -> None:
        self._db.close()
        self._move_aside(error)
        try:
            self._checked(self._connect())
        except sqlite3.Error as again:  # self._db stays closed: every call answers `failed`
            _log.warning("response store %s: cannot start an empty one (%s)", self.path, again)

    def _insert(self, row: tuple, size: int) -> bool:
        def insert() -> None:
            self._db.execute("DELETE FROM responses WHERE id = ?", (row[0],))
            self._make_room(size, 1)
            self._db.execute("INSERT INTO responses (id, owner, expires, size, body, context) VALUES (?, ?, ?, ?, ?, ?)",
                             row)

        self._transaction(insert)
        return True

    def _trim(self) -> None:
        """At open: no row outlives this run's TTL (one lowered since the last run applies at once),
        and the rows fit the bounds (they may have shrunk too)."""
        latest = self._clock() + self.ttl
        self._db.execute("UPDATE responses SET expires = ? WHERE expires > ?", (latest, latest))
        self._make_room(0, 0)

    def _make_room(self, size: int, slots: int) -> None:
        """Delete the expired rows, then the oldest until `slots` more rows of `size` bytes fit."""
        self._db.execute("DELETE FROM responses WHERE expires <= ?", (self._clock(),))
        count, total = self._db.execute("SELECT COUNT(*), COALESCE(SUM(size), 0) FROM responses").fetchone()
        last = None
        for seq, row_size in self._db.execute("SELECT seq, size FROM responses ORDER BY seq").fetchall():
            if count + slots <= self.max_count and total + size <= self.max_bytes:
                break
            count, total, last = count - 1, total - row_size, seq
        if last is not None:
            self._db.execute("DELETE FROM responses WHERE seq <= ?", (last,))

    def _select(self, response_id: str, owner: str | None) -> StoredResponse | None:
        row = self._db.execute("SELECT owner, expires, size, body, context FROM responses "
                               "WHERE id = ? AND owner IS ? AND expires > ?",
                               (response_id, owner, self._clock())).fetchone()
        if row is None:
            return None
        owner, expires, size, body, context = row
        try:
            response = _response_object(json.loads(body), response_id)
            return StoredResponse(response, _CONTEXT.validate_json(context), size, expires, owner)
        except (ValueError, ValidationError) as error:  # json's errors are ValueErrors
            _log.warning("response store %s: dropping %s, which does not decode (%s)", self.path, response_id, error)
            self._write("DELETE FROM responses WHERE id = ?", (response_id,))
            return None

    def _write(self, sql: str, parameters: tuple) -> int:
        """Rows `sql` changed, in a transaction of its own."""
        return self._transaction(lambda: self._db.execute(sql, parameters).rowcount)

    def _transaction(self, work: Callable[[], T]) -> T:
        self._db.execute("BEGIN IMMEDIATE")
        try:
            result = work()
        except BaseException:
            with contextlib.suppress(sqlite3.Error):
                self._db.execute("ROLLBACK")
            raise
        self._db.execute("COMMIT")
        return result

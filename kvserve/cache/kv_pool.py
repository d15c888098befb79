"""The KV pool: one context's streams (a stream per sequence), handed out as sessions.

A session is one stream: sequence id `seq` lives in stream `seq`, `n_ctx_seq` cells long. When a
session ends its stream keeps its rows (it is *resident*) until a new session needs the stream; a
new session whose tokens continue what a resident stream holds is placed there and keeps those
rows (in-place reuse: nothing copied, nothing recomputed). Placement matches on a `PrefixKey`: a
stream's rows belong to the namespace of the session that computed them.

Invariants (checked by tests through llama.cpp's own positions):
- a stream holds exactly its live session's `tokens`, or, idle, its `resident` tokens: positions
  `0 .. len-1`, nothing else;
- a session's tokens are read-only here and everywhere but in `KvManager`, which alone writes
  them (`Session._in_stream`), as it places, attaches, forks, evaluates and cuts; the pool places
  sessions and moves rows, and says what a new session kept in place (`open`);
- a stream is either live (one session) or idle; sessions never exceed the streams;
- a session is placed only in a stream whose resident rows are of its own namespace, and a fork
  takes its parent's namespace with its rows;
- rows are cut back to `n` only where the stream keeps what a token at `n` attends (`can_cut`):
  never for a recurrent state; for a sliding window, only while the stream still holds the window's
  rows before `n` (`llama_memory_seq_pos_min` <= n - n_swa + 1), since llama.cpp reuses a cell once
  it falls out of its sequence's window.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Protocol

from kvserve.cache.page_tree import tick
from kvserve.cache.prefix_key import PrefixKey
from kvserve.llama.context import Context


class PoolExhausted(RuntimeError):
    """No stream is free, or a sequence would outgrow its stream."""


@dataclass(eq=False)
class Session:
    """One sequence: its stream's id, the tokens the stream holds, in order, and the namespace they
    were computed under (what it may attach, keep in place and donate). `KvManager` alone writes
    the tokens; everyone else reads them as a tuple."""

    seq: int
    namespace: str = ""
    _in_stream: list[int] = field(default_factory=list, repr=False)

    @property
    def tokens(self) -> tuple[int, ...]:
        return tuple(self._in_stream)

    @property
    def n_past(self) -> int:
        return len(self._in_stream)


@dataclass(eq=False)
class Stream:
    seq: int
    resident: list[int] = field(default_factory=list)  # what an idle stream still holds
    namespace: str = ""  # of the resident rows
    session: Session | None = None
    last_used: int = 0


class KvPool(Protocol):
    """What a scheduler (and a cache user by hand) asks of the streams of a context."""

    ctx: Context
    inplace_reuses: int  # sessions placed in a stream that held their prefix
    inplace_tokens: int  # the tokens those kept

    @property
    def n_streams(self) -> int: ...

    @property
    def n_ctx_seq(self) -> int: ...

    @property
    def n_cells(self) -> int: ...

    @property
    def used_cells(self) -> int: ...

    @property
    def free_streams(self) -> int: ...

    @property
    def live_sessions(self) -> int: ...

    @property
    def empty_streams(self) -> int: ...

    def resident_key(self, seq: int) -> PrefixKey | None:
        """What idle stream `seq` holds, as its namespace's key for it; None if it is live or empty."""
        ...

    def stream_view(self, namespace: str) -> list[dict]:
        """Each stream as /v1/cache shows a caller of `namespace`: `live` (a session runs in it),
        `resident` (idle, its rows kept for a continuation), `empty`, or `other` (its rows are of
        another namespace, so neither they nor their length are shown), and the tokens it holds."""
        ...

    def resident_match(self, key: PrefixKey) -> int:
        """Leading tokens of `key` an idle stream of its namespace holds and `new_session(key)` keeps.
        Touches nothing."""
        ...

    def held(self, seq: int) -> list[int]:
        """The tokens stream `seq` holds: its live session's, or an idle stream's resident ones."""
        ...

    def open(self, key: PrefixKey | None = None) -> tuple[Session, int]:
        """A new session for `key` and how many of its leading tokens its stream kept in place
        (`KvManager.new_session` records them)."""
        ...

    def namespaces(self) -> set[str]: ...

    def can_cut(self, seq: int, n: int) -> bool: ...

    def fork(self, parent: Session, child: Session) -> None: ...

    def end_session(self, session: Session) -> None: ...

    def close(self) -> None: ...


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens `a` and `b` share (compared 64 at a time, in C, while they agree)."""
    n = min(len(a), len(b))
    i = 0
    while i + 64 <= n and a[i : i + 64] == b[i : i + 64]:
        i += 64
    while i < n and a[i] == b[i]:
        i += 1
    return i


# Fewer leading tokens than this are not worth an idle stream's rows: a new session takes an empty
# stream (or the least recently used one) instead of cutting a stream that holds a whole history.
MIN_REUSE = 16


class StreamPool:
    """Hands out a stream per session and keeps what an ended session's stream holds for reuse."""

    def __init__(self, ctx: Context, on_end: Callable[[Session], None] | None = None, reuse: bool = True) -> None:
        """`on_end` is told of every session that ends (the prefix cache unlocks what it lent it);
        without `reuse`, every session starts from an empty stream (no prefix caching at all)."""
        if ctx.unified:
            raise ValueError("the pool needs a stream per sequence")
        self.ctx = ctx
        self.streams = [Stream(seq) for seq in range(ctx.n_seq_max)]
        self.reuse = reuse
        self.inplace_reuses = 0  # sessions placed in a stream that held their prefix
        self.inplace_tokens = 0  # the tokens those reuses did not recompute
        self._on_end = on_end

    @property
    def n_streams(self) -> int:
        return len(self.streams)

    @property
    def n_ctx_seq(self) -> int:
        return self.ctx.n_ctx_seq

    @property
    def n_cells(self) -> int:
        return self.n_streams * self.n_ctx_seq

    @property
    def used_cells(self) -> int:
        return sum(s.session.n_past if s.session else len(s.resident) for s in self.streams)

    @property
    def live_sessions(self) -> int:
        return sum(s.session is not None for s in self.streams)

    @property
    def free_streams(self) -> int:
        return self.n_streams - self.live_sessions

    @property
    def empty_streams(self) -> int:
        return sum(s.session is None and not s.resident for s in self.streams)

    def resident_key(self, seq: int) -> PrefixKey | None:
        stream = self.streams[seq]
        return PrefixKey(stream.namespace, list(stream.resident)) if stream.session is None and stream.resident else None

    def stream_view(self, namespace: str) -> list[dict]:
        return [self._stream_state(s, namespace) for s in self.streams]

    @staticmethod
    def _stream_state(stream: Stream, namespace: str) -> dict:
        held = stream.session.tokens if stream.session else stream.resident
        owner = stream.session.namespace if stream.session else stream.namespace
        if held and owner != namespace:
            return {"seq": stream.seq, "state": "other", "tokens": 0}
        state = "live" if stream.session else "resident" if held else "empty"
        return {"seq": stream.seq, "state": state, "tokens": len(held)}

    @property
    def sessions(self) -> list[Session]:
        return [s.session for s in self.streams if s.session is not None]

    # -- placement ----------------------------------------------------------------------------------

    def _reusable(self, stream: Stream, key: PrefixKey) -> int:
        """What of `stream`'s resident rows a session for `key` keeps, one token short of them."""
        if stream.namespace != key.namespace:
            return 0
        n = min(common_prefix(stream.resident, key.tokens), len(key.tokens) - 1)
        if n < MIN_REUSE or (n < len(stream.resident) and not self.can_cut(stream.seq, n)):
            return 0
        return n

    def can_cut(self, seq: int, n: int) -> bool:
        """Whether `seq`'s rows from position `n` on can go and leave what the token at `n` attends:
        never a recurrent state's; under a sliding window, only while llama.cpp still holds the rows
        of positions n - n_swa + 1 .. n - 1 (the lowest position it holds says so)."""
        if self.ctx.model.info.carries_state:
            return False
        return not self.ctx.n_swa or self.ctx.seq_pos_min(seq) <= max(0, n - self.ctx.n_swa + 1)

    def _best(self, key: PrefixKey) -> tuple[Stream | None, int]:
        best, best_n = None, 0
        for stream in self.streams:
            if stream.session is None and stream.resident:
                n = self._reusable(stream, key)
                if n > best_n:
                    best, best_n = stream, n
        return best, best_n

    def resident_match(self, key: PrefixKey) -> int:
        return self._best(key)[1] if self.reuse else 0

    def held(self, seq: int) -> list[int]:
        stream = self.streams[seq]
        return list(stream.session.tokens) if stream.session else stream.resident

    def open(self, key: PrefixKey | None = None) -> tuple[Session, int]:
        """A session of `key`'s namespace (default: the shared one), in the idle stream of that
        namespace that holds the longest prefix of `key` (kept in place), else in the idle stream
        beside the most live ones, then an empty one, then the least recently used (whose rows go;
        pages the prefix cache took of them stay). Live ids in runs matter more than those rows:
        llama.cpp puts sequences into one ubatch only while their ids run consecutively, and each
        ubatch reads every weight again. Returns it, empty, and how many leading tokens of `key`
        its stream kept in place, which `KvManager.new_session` records as the session's."""
        key = key or PrefixKey("")
        stream, n = self._best(key) if key.tokens and self.reuse else (None, 0)
        if stream is None:
            idle = [s for s in self.streams if s.session is None]
            if not idle:
                raise PoolExhausted("every stream runs a sequence")
            live = {s.seq for s in self.streams if s.session is not None}
            stream = min(idle, key=lambda s: (-((s.seq - 1 in live) + (s.seq + 1 in live)),
                                              bool(s.resident), s.last_used))
        session = Session(seq=stream.seq, namespace=key.namespace)
        if n:
            self.ctx.seq_rm(stream.seq, n, -1)
            self.inplace_reuses += 1
            self.inplace_tokens += n
        else:
            self._clear(stream)
        stream.resident = []
        stream.session = session
        stream.last_used = tick()
        return session, n

    def _clear(self, stream: Stream) -> None:
        if stream.resident:
            self.ctx.seq_rm(stream.seq)
            stream.resident = []

    # -- sessions -----------------------------------------------------------------------------------

    def fork(self, parent: Session, child: Session) -> None:
        """Copy `parent`'s rows into `child`'s stream, now; they stay of the parent's namespace.
        `KvManager.fork` records the tokens. (llama.cpp's cross-stream `seq_cp` copies only at the
        next decode: a request that ended first left the copy pending, to land later over whatever
        the stream held by then.)"""
        self.ctx.seq_rm(child.seq)
        self.ctx.write_seq_state(child.seq, self.ctx.read_seq_state(parent.seq))
        child.namespace = parent.namespace

    def end_session(self, session: Session) -> None:
        """The session ends; its stream keeps its rows until a new session needs the stream (or
        forgets them now, without `reuse`)."""
        stream = self.streams[session.seq]
        if stream.session is not session:
            raise ValueError("not a live session of this pool")
        stream.session = None
        stream.resident = list(session.tokens)
        stream.namespace = session.namespace
        stream.last_used = tick()
        if not self.reuse:
            self._clear(stream)
        if self._on_end is not None:
            self._on_end(session)

    def namespaces(self) -> set[str]:
        """The namespaces of the rows idle streams keep."""
        return {s.namespace for s in self.streams if s.session is None and s.resident}

    def drop_resident(self) -> None:
        """Clear every idle stream (shutdown, tests)."""
        for stream in self.streams:
            if stream.session is None:
                self._clear(stream)

    def close(self) -> None:
        """Free the context. Every session must have ended."""
        if self.live_sessions:
            raise RuntimeError("sessions still run in this pool: end them first")
        self.ctx.close()

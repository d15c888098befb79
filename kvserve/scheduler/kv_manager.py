"""The KV side of requests, and the one allocation API the scheduler asks: can this request start
(`room_for`), place its sequences (`start`), reserve room for the next tokens of one and a draft's
lookahead (`allocate`), keep what a decode evaluated and cut what verification rejected (`commit`),
free them (`release`). Nothing else counts KV cells for the scheduler, and nothing else anywhere
writes what a stream holds (`Session._in_stream`): the pool and the caches move rows and say what
they kept, attached or copied (`open`, `attach`, `fork`), and the methods under "what a stream
holds" record it, for the scheduler and for a caller driving sessions by hand (`eval`).

Each sequence has a stream of `n_ctx_seq` cells of its own, so a request fits when its prompt and
one generated token fit one stream, and a sequence can always grow to the end of its stream.
Every lookup is by the request's `PrefixKey`, and every session of a request is of its namespace.

Invariants:
- a session holds exactly the tokens llama.cpp has for its seq id: `new_session` and `attach` set
  what was kept in place or attached, `fork` what was copied, `eval` and `commit` append what a
  decode evaluated, `commit` cuts (`llama_memory_seq_rm`) the rows of draft tokens that
  verification rejected; nothing else writes them; so after every step
  `llama_memory_seq_pos_max` of a running sequence is its session's length - 1;
- a draft model's stream of a seq id holds a prefix of what the target stream of that id holds (plus,
  within a step, the draft): `start`, `fork_waiting_siblings` and `release` trim it to the target
  stream's tokens, `commit` cuts it to the session's accepted length;
- rows are cut only where the stream keeps what the next token attends (`StreamPool.can_cut`):
  never in a recurrent state, so speculation is off for those models (`cuts_rows`); in a
  sliding-window stream wherever the decode left the window before the cut point. Where it did
  not, `commit` drops the stream's rows and the sequence is evaluated again from its first token;
- a choice holds a session from its start until its request ends or is preempted; `release` frees
  every one of them;
- a forked choice never donates: its prompt is choice 0's; choice 0 donates its prompt once it is
  evaluated, and, where the cache takes them (`donates_prefill`), its pages every `DONATE_EVERY`
  tokens before that;
- checkpoints are planned and taken for choice 0 only, whose prefill stops at each of them;
- a request's sessions are of its namespace, so what it keeps in place, attaches or donates never
  crosses into another namespace; hits are counted by namespace kind, never by namespace.
"""

from __future__ import annotations

import contextlib
import enum
from collections import Counter
from dataclasses import replace
from typing import Callable, Iterator

import numpy as np

from kvserve.cache.cache_stats import CacheStats
from kvserve.cache.chat_marks import MarkKind
from kvserve.cache.kv_pool import KvPool, PoolExhausted, Session
from kvserve.cache.prefix_cache import InsertAt, PrefixCache
from kvserve.cache.prefix_key import PrefixKey, namespace_kind
from kvserve.llama.batch import Batch
from kvserve.scheduler.draft_model import DraftModel
from kvserve.scheduler.request import Choice, Request


# A prompt still being evaluated donates its whole pages each time it passes another this many tokens,
# not only at its end, to a cache that takes them (`PrefixCache.donates_prefill`: one with a disk
# tier, which writes them behind): a crash in a long prefill loses at most the stretch since. A
# 16,384-token prompt of the 1.5B takes 5-8 minutes on 2 cores, and its 1,024 pages (448 MB), all
# donated at its end, were still being written 2 s after the answer: a SIGKILL then lost 294 of them.
DONATE_EVERY = 2048


class Room(enum.Enum):
    NOW = "now"
    LATER = "later"  # once running requests give streams back
    NEVER = "never"  # the prompt does not fit one stream


class KvManager:
    def __init__(self, pool: KvPool, cache: PrefixCache, draft: DraftModel | None = None) -> None:
        self.pool = pool
        self.cache = cache
        self.draft = draft
        self.model = pool.ctx.model
        self.inplace_queried = 0  # prompt tokens of the sessions placed in place (the cache saw none of them)
        self.given_back = (0, 0)  # tokens looked up and attached by `borrowed_session`, no prompt's
        self.kind_queried: Counter[str] = Counter()  # prompt tokens of started requests, by namespace kind
        self.kind_hits: Counter[str] = Counter()  # of those, not evaluated (kept in place or attached)
        self.recomputed = 0  # sequences evaluated again: a draft's decode overwrote the window of their cut

    # -- admission ------------------------------------------------------------------------------------

    def room_for(self, request: Request, n_sequences: int) -> Room:
        """Whether `n_sequences` of the request can start now: a free stream each, the prompt and a
        generated token within one stream."""
        if len(request.prompt) + 1 > self.pool.n_ctx_seq:
            return Room.NEVER
        return Room.NOW if self.pool.free_streams >= n_sequences else Room.LATER

    def cached_len(self, key: PrefixKey) -> int:
        """Leading tokens of `key` that starting it now would not evaluate (a stream of its namespace
        keeps them in place, or the cache attaches them)."""
        return max(self.pool.resident_match(key), self.cache.match_len(key))

    def gains_from_waiting(self, shared: int, cached: int) -> bool:
        return self.cache.gains_from_waiting(shared, cached)

    def start(self, request: Request, choices: list[Choice], placed: list[Choice]) -> bool:
        """A session for each of `choices`; those in `placed` start from what is kept in place or
        cached of their tokens, the others empty. False, with none held, when streams ran out."""
        first_start = request.state.admitted_at is None
        try:
            for choice in choices:
                key = PrefixKey(request.namespace, choice.tokens if choice in placed else [])
                choice.session = self._place(key) if key.tokens else self.new_session(key)
        except PoolExhausted:
            self.release(request, donate=False)
            return False
        for choice in choices:
            self._follow(choice.session.seq)
        for choice in placed:
            request.state.cached_tokens = max(request.state.cached_tokens, min(choice.session.n_past, len(request.prompt)))
        if first_start:
            kind = namespace_kind(request.namespace)
            self.kind_queried[kind] += len(request.prompt)
            self.kind_hits[kind] += request.state.cached_tokens
        return True

    def _place(self, key: PrefixKey):
        """In the idle stream of the key's namespace holding the longest prefix, unless the cache
        attaches more."""
        kept = self.pool.resident_match(key)
        if kept and kept >= self.cache.match_len(key):
            self.inplace_queried += len(key.tokens)
            return self.new_session(key)
        session = self.new_session(PrefixKey(key.namespace))
        self.attach(session, key)
        return session

    def stats(self) -> CacheStats:
        """The cache's counters, with what streams kept in place counted as hits."""
        stats = self.cache.stats()
        queried, attached = self.given_back
        return replace(stats, queried_tokens=stats.queried_tokens + self.inplace_queried - queried,
                       hit_tokens=stats.hit_tokens + self.pool.inplace_tokens - attached,
                       namespaces=len(self.cache.namespaces() | self.pool.namespaces()),
                       kind_queried=dict(self.kind_queried), kind_hits=dict(self.kind_hits))

    def plan_checkpoints(self, request: Request) -> None:
        """Keep the request's marks at which a checkpoint of choice 0 is worth a stop of its prefill."""
        session = request.state.choices[0].session
        stops: dict[int, MarkKind] = {}
        for mark in request.marks:  # shallowest first: an opening kind wins a stop two marks share
            stop = self.cache.checkpoint_at(session, request.prompt, session.n_past, mark.position)
            if stop:
                stops.setdefault(stop, mark.kind)
        request.state.checkpoints = stops

    # -- growing ------------------------------------------------------------------------------------------

    @property
    def cuts_rows(self) -> bool:
        """Whether rejected draft rows can ever be cut from a stream: never from a recurrent state."""
        return not self.model.info.carries_state

    def allocate(self, choice: Choice, n_new: int, lookahead: int = 0) -> int | None:
        """Room in the choice's stream for its next `n_new` tokens and up to `lookahead` draft tokens
        after them: how many of all those it reserved (`n_new` plus the lookahead that fits), or None
        when `n_new` do not fit. The stream is the sequence's own, so nothing is taken from others."""
        room = self.pool.n_ctx_seq - choice.session.n_past
        if n_new > room:
            return None
        return n_new + max(0, min(lookahead, room - n_new))

    def reserve(self, choice: Choice, n_tokens: int) -> bool:
        """Whether the choice's stream has room for its next `n_tokens`."""
        return self.allocate(choice, n_tokens) is not None

    def commit(self, choice: Choice, n_accepted: int, n_decoded: int | None = None) -> None:
        """The decode evaluated `n_decoded` (default `n_accepted`) tokens after the session; the first
        `n_accepted` of them are the choice's next tokens and stay, the rows of the rest (rejected
        draft tokens) are cut from the stream. Where the decode overwrote sliding-window rows that
        the next token attends, the stream is emptied instead, and the choice's tokens are evaluated
        again from the first (`recomputed` counts it)."""
        session = choice.session
        start = session.n_past
        session._in_stream.extend(choice.tokens[start : start + n_accepted])
        if n_decoded is not None and n_decoded > n_accepted:
            if self.pool.can_cut(session.seq, session.n_past):
                self.pool.ctx.seq_rm(session.seq, session.n_past, -1)
            else:
                self.pool.ctx.seq_rm(session.seq)
                session._in_stream.clear()
                self.recomputed += 1
        if self.draft is not None:
            self.draft.cut(session.seq, session.n_past)

    def checkpoint_if_at_mark(self, request: Request, choice: Choice) -> None:
        session = choice.session
        kind = request.state.checkpoints.get(session.n_past) if choice.index == 0 else None
        if kind is not None:
            self.cache.insert(session, session.tokens, preview=self._preview(request), kind=kind)

    def donate_prefill_progress(self, request: Request, choice: Choice, n_evaluated: int) -> None:
        """`choice` evaluated `n_evaluated` more of its prompt: where that passed another
        `DONATE_EVERY` tokens short of the prompt's end, insert the pages evaluated so far (after pages
        attached from disk, to disk only). Each insert reads the stream's state and keeps the new
        pages' rows: for 16,384 tokens, seven reads of 2,048 to 14,336 tokens' rows beside the
        minutes their prefill takes."""
        session = choice.session
        n_past = session.n_past
        if (self.cache.donates_prefill and choice.index == 0 and n_past < len(request.prompt)
                and n_past // DONATE_EVERY > (n_past - n_evaluated) // DONATE_EVERY):
            self.cache.insert(session, session.tokens, preview=self._preview(request), at=InsertAt.PREFILL)

    def donate_evaluated_prompt(self, request: Request, choice: Choice) -> None:
        """Insert the prompt the moment `choice` has evaluated it, so requests waiting on this prefix
        attach it now rather than when the request ends."""
        if self.cache.donates_prompt and choice.session.n_past == len(request.prompt) and not choice.forked:
            self.cache.insert(choice.session, choice.session.tokens, preview=self._preview(request))

    def fork_waiting_siblings(self, request: Request, parent: Choice) -> list[Choice]:
        """The prompt is evaluated: the siblings waiting for it get a copy of the parent's stream."""
        siblings = [c for c in request.state.choices if c.waits_for_fork]
        for sibling in siblings:
            self.fork(parent.session, sibling.session)
            sibling.waits_for_fork = False
            sibling.forked = True
            self._follow(sibling.session.seq)
        return siblings

    # -- what a stream holds: the only writes of `Session._in_stream` ------------------------------------------

    def new_session(self, key: PrefixKey | None = None) -> Session:
        """A session of `key`'s namespace holding what its stream kept in place of `key`
        (`StreamPool.open`)."""
        session, kept = self.pool.open(key)
        session._in_stream[:] = key.tokens[:kept] if key else []
        return session

    @contextlib.contextmanager
    def borrowed_session(self, give_back: Callable[[], bool]) -> Iterator[Session]:
        """An empty session for the engine's idle work (a ubatch timing), in the stream a new
        session would take: an empty one, else the least recently used idle one, whose rows go.
        Where they went, what the cache holds of them is attached back afterwards (while
        `give_back()` says so: a request that waits attaches what it needs itself), so that a
        conversation's next turn still finds its prefix in a stream and continues it there. That
        attach is no prompt's: `stats` leaves it out, and counts the next turn once, in place."""
        held = {seq: self.pool.resident_key(seq) for seq in range(self.pool.n_streams)}
        session = self.new_session()
        try:
            yield session
        finally:
            self._end(session)
        gone = held.get(session.seq)
        if gone is not None and give_back():
            back = self.new_session(PrefixKey(gone.namespace))
            queried, attached = self.given_back
            self.given_back = (queried + len(gone.tokens), attached + self.attach(back, gone))
            self._end(back)

    def attach(self, session: Session, key: PrefixKey) -> int:
        """The cache's longest prefix of `key` set into an empty session; its length."""
        restored = self.cache.attach(session, key)
        session._in_stream[:] = restored
        return len(restored)

    def fork(self, parent: Session, child: Session) -> None:
        """`child` becomes a copy of `parent`'s stream, of its namespace."""
        self.pool.fork(parent, child)
        child._in_stream[:] = parent._in_stream

    def eval(self, session: Session, tokens: list[int]) -> np.ndarray:
        """Decode `tokens` after the session's history, alone (a caller driving sessions by hand, not
        the scheduler); returns a copy of the last logits."""
        if not tokens:
            raise ValueError("eval needs at least one token")
        if len(tokens) > self.pool.n_ctx_seq - session.n_past:
            raise PoolExhausted(f"no room for {len(tokens)} tokens in a {self.pool.n_ctx_seq}-cell stream")
        ctx = self.pool.ctx
        batch = Batch(ctx.n_batch)
        try:
            for start in range(0, len(tokens), ctx.n_batch):
                batch.clear()
                chunk = tokens[start : start + ctx.n_batch]
                for i, token in enumerate(chunk):
                    batch.add(token, session.n_past + i, session.seq, i == len(chunk) - 1)
                ctx.decode(batch)
                session._in_stream.extend(chunk)
            return ctx.logits(batch.n_tokens - 1).copy()
        finally:
            batch.close()

    # -- the end --------------------------------------------------------------------------------------------

    def release(self, request: Request, donate: bool) -> None:
        """Free every session of the request; unforked ones first donate what they evaluated to the
        cache. Each stream keeps its rows for a next turn until another session needs it."""
        for choice in [c for c in request.state.choices if c.session is not None]:
            session = choice.session
            if donate and not choice.forked:
                self.cache.insert(session, session.tokens, preview=self._preview(request), at=InsertAt.ENDING)
            self._end(session)
            choice.session = None
            choice.forked = False

    def _end(self, session: Session) -> None:
        """End `session`; its stream keeps its rows for a next turn, and its draft stream follows."""
        self.pool.end_session(session)
        self._follow(session.seq)

    def _follow(self, seq: int) -> None:
        """The draft stream of `seq` keeps only what the target stream still holds."""
        if self.draft is not None:
            self.draft.trim(seq, self.pool.held(seq))

    def _preview(self, request: Request) -> str:
        return self.model.detokenize(request.prompt[-24:])

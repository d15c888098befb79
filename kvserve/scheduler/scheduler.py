"""Continuous batching: every step decodes one token of each running sequence and fills the rest of
the token budget with prompt chunks, in one `llama_decode`.

The scheduler runs on the engine thread, the only thread that touches the llama context. Other
threads hand it work through `submit` and `abort`, which only append to thread-safe deques.

Invariants:
- a sequence's session holds exactly the tokens llama.cpp has for its seq id;
- every admitted request ends with exactly one output carrying `usage` (or `error`), and its
  sessions are released (donated to the prefix cache first);
- a batch never exceeds the token budget, never outruns free KV cells (the cache evicts, then
  the newest running request is preempted), and never repeats a sequence twice;
- a step that decodes carries at most `prefill_chunk` prompt tokens, so a running stream's next token
  waits for one short step, never a long prefill (stall-free batching, as Sarathi-Serve's).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass

from kvserve.cache.kv_pool import KvPool, PoolExhausted
from kvserve.cache.prefix_cache import PrefixCache
from kvserve.llama.batch import Batch
from kvserve.llama.context import DecodeError, NoKvSlot
from kvserve.llama.detokenizer import Detokenizer
from kvserve.llama.sampler import Sampler, live_samplers, token_logprobs
from kvserve.scheduler.request import Choice, Delta, FinishReason, Request, RequestOutput, Usage
from kvserve.scheduler.snapshot import EngineSnapshot
from kvserve.scheduler.stop_strings import StopMatcher

_log = logging.getLogger("kvserve.scheduler")

# A waiting request passed over this many times by cache-aware admission goes first regardless.
STARVATION_LIMIT = 8
# Cache-aware admission ranks only the head of the queue, so a long queue costs nothing extra.
ADMISSION_WINDOW = 32


@dataclass(frozen=True)
class SchedulerConfig:
    max_running: int  # sequences decoding at once (--parallel)
    token_budget: int  # tokens per llama_decode (--batch-size)
    max_seq_len: int  # longest sequence one request may grow to
    queue_timeout: float = 0.0  # seconds a request may wait before its first admission; 0: forever
    prefill_chunk: int | None = None  # most prompt tokens in a step that also decodes; None: the whole budget


@dataclass
class StepTimes:
    """Where engine time goes: the bench reads these to report Python overhead."""

    steps: int = 0
    step_seconds: float = 0.0  # inside step()
    decode_seconds: float = 0.0  # inside llama_decode
    loop_seconds: float = 0.0  # the event loop's whole turn per step: hand-off, step, dispatch


@dataclass
class _Slot:
    request: Request
    choice: Choice
    n_tokens: int
    logits_index: int | None = None  # set when this chunk ends the sequence's known tokens


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class Scheduler:
    def __init__(self, pool: KvPool, cache: PrefixCache, config: SchedulerConfig) -> None:
        self.pool = pool
        self.cache = cache
        self.config = config
        self.model = pool.ctx.model
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.times = StepTimes()
        self._inbox: deque[Request] = deque()
        self._aborts: deque[tuple[str, str | None]] = deque()
        self._batch = Batch(pool.ctx.n_batch)
        self.preemptions = 0
        self.last_progress = time.monotonic()  # when a step last evaluated tokens or ended a request
        self.snapshot = EngineSnapshot(kv_cells=pool.n_cells, free_seq_ids=pool.free_ids)

    # -- called from any thread --------------------------------------------------------------------

    def submit(self, request: Request) -> None:
        self._inbox.append(request)

    def abort(self, request_id: str, error: str | None = None) -> None:
        """End a request at the next step: as aborted, or, given `error`, as failed with a 503."""
        self._aborts.append((request_id, error))

    def has_work(self) -> bool:
        return bool(self._inbox or self._aborts or self.waiting or self.running)

    @property
    def n_running(self) -> int:
        return len(self.running)

    @property
    def n_waiting(self) -> int:
        return len(self.waiting) + len(self._inbox)

    # -- the step -------------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        started = time.perf_counter()
        outputs: dict[str, RequestOutput] = {}
        try:
            self._take_inbox(outputs)
            self._admit(outputs)
            slots = self._plan(outputs)
            if slots:
                self._run(slots, outputs)
        except Exception:  # a bug must not hang every client: fail what is in flight, keep serving
            _log.exception("engine step failed; failing the requests in flight")
            self._fail({*self.running, *self.waiting}, "internal engine error", outputs)
        if outputs or not self.has_work():
            self.last_progress = time.monotonic()
        self.times.steps += 1
        self.times.step_seconds += time.perf_counter() - started
        self.snapshot = self._take_snapshot()
        return list(outputs.values())

    def _take_snapshot(self) -> EngineSnapshot:
        return EngineSnapshot(
            running=len(self.running),
            waiting=self.n_waiting,
            kv_cells=self.pool.n_cells,
            kv_used=self.pool.used_cells,
            free_seq_ids=self.pool.free_ids,
            cache=self.cache.stats(),
            preemptions=self.preemptions,
            live_samplers=live_samplers(),
        )

    def _take_inbox(self, outputs: dict[str, RequestOutput]) -> None:
        while self._inbox:
            self.waiting.append(self._inbox.popleft())
        while self._aborts:
            request_id, error = self._aborts.popleft()
            for request in [*self.running, *self.waiting]:
                if request.id == request_id:
                    reason = FinishReason.ERROR if error else FinishReason.ABORT
                    self._finish(request, reason, outputs, error=error, status=503)
        self._time_out_waiting(outputs)

    def _time_out_waiting(self, outputs: dict[str, RequestOutput]) -> None:
        """A request never admitted within the queue timeout fails with a 503; a preempted one was
        admitted, so it keeps its place."""
        limit = self.config.queue_timeout
        if not limit:
            return
        now = time.monotonic()
        for request in [r for r in self.waiting if r.admitted_at is None and now - r.arrival > limit]:
            message = f"the request waited {limit:g}s for a slot; the server is overloaded"
            self._finish(request, FinishReason.ERROR, outputs, error=message, status=503)

    # -- admission ------------------------------------------------------------------------------------

    def _admit(self, outputs: dict[str, RequestOutput]) -> None:
        if self._running_choices() >= self.config.max_running:
            return  # no slot: skip ranking the queue, which costs a cache lookup per waiting request
        admitted: list[Request] = []
        for request in self._admission_order():
            if self._running_choices() + self._active(request) > self.config.max_running:
                request.blocked_on = "a free slot"
                break
            cached = self.cache.match_len(request.prompt)
            if self._waits_for_a_running_prefill(request, cached):
                request.blocked_on = "a running prefill of the same prefix to donate it"
                continue
            if not self._fits(request, cached, outputs):
                request.blocked_on = f"KV cells for {len(request.prompt) - cached} prompt tokens"
                break
            if not self._start(request):
                request.blocked_on = "a free sequence id"
                break
            self.waiting.remove(request)
            self.running.append(request)
            admitted.append(request)
        if admitted:
            latest = max(r.arrival for r in admitted)
            for request in self.waiting:
                if request.arrival < latest:
                    request.passed_over += 1

    def _admission_order(self) -> list[Request]:
        """Longest cached prefix first among the head of the queue; a request passed over too often
        goes first regardless, so nothing starves."""
        window = list(self.waiting)[:ADMISSION_WINDOW]
        if not window:
            return window
        starved = [r for r in window if r.passed_over >= STARVATION_LIMIT]
        rest = sorted((r for r in window if r.passed_over < STARVATION_LIMIT),
                      key=lambda r: self.cache.match_len(r.prompt), reverse=True)  # stable: ties keep arrival order
        return starved + rest

    def _waits_for_a_running_prefill(self, request: Request, cached: int) -> bool:
        """A request whose prompt shares more than a page beyond what is cached with a prompt being
        prefilled right now waits for that prefill to donate, instead of computing the same prefix."""
        for other in self.running:
            first = other.choices[0]
            if first.session is not None and first.session.n_past < len(other.prompt):
                if self.cache.gains_from_waiting(_common_prefix(request.prompt, other.prompt), cached):
                    return True
        return False

    def _running_choices(self) -> int:
        return sum(self._active(r) for r in self.running)

    @staticmethod
    def _active(request: Request) -> int:
        return sum(c.finish_reason is None for c in request.choices) if request.choices else request.n

    def _fits(self, request: Request, cached: int, outputs: dict[str, RequestOutput]) -> bool:
        """Room for the uncached prompt on top of what running requests have still to prefill (so a
        new prompt cannot take the cells an admitted one needs); a prompt too big even for an empty
        context is failed."""
        if self.pool.make_room(self._unevaluated_tokens() + len(request.prompt) - cached + request.n):
            return True
        if not self.running:
            self._finish(request, FinishReason.ERROR, outputs, error="the prompt does not fit in the KV cache",
                         status=400)
        return False

    def _start(self, request: Request) -> bool:
        """Give each unfinished choice a session and attach what the cache holds. False: no ids now."""
        first_time = not request.choices
        if first_time:
            request.choices = [self._new_choice(request, i) for i in range(request.n)]
        active = [c for c in request.choices if c.finish_reason is None]
        try:
            for choice in active:
                choice.session = self.pool.new_session()
        except PoolExhausted:
            self._release(request, donate=False)
            return False
        request.admitted_at = request.admitted_at or time.monotonic()
        if first_time:
            for sibling in active[1:]:
                sibling.waits_for_fork = True
            active = active[:1]
        for choice in active:
            attached = self.cache.attach(choice.session, choice.tokens)
            request.cached_tokens = max(request.cached_tokens, min(attached, len(request.prompt)))
        if first_time:
            session = active[0].session
            request.checkpoints = {
                mark.position: mark.kind for mark in request.marks
                if self.cache.checkpoint_at(session, request.prompt, session.n_past, mark.position)
            }
        return True

    def _unevaluated_tokens(self) -> int:
        return sum(c.unevaluated for r in self.running for c in r.choices
                   if c.finish_reason is None and not c.waits_for_fork)

    def _new_choice(self, request: Request, index: int) -> Choice:
        return Choice(
            index=index,
            tokens=list(request.prompt),
            sampler=Sampler(self.model, request.params),
            detokenizer=Detokenizer(self.model, special=request.special_text),
            stop_matcher=StopMatcher(request.stop_strings),
        )

    # -- planning the batch ---------------------------------------------------------------------------

    def _plan(self, outputs: dict[str, RequestOutput]) -> list[_Slot]:
        """Decode tokens first, then prompt chunks in admission order, within budget and free cells
        (cold cache pages are evicted for either). A step in which nothing could move sheds the newest
        request, so running requests never wait on cells that only an idle cache or a later request holds."""
        decoding, prefilling = self._resident_slots()
        while decoding and not self.pool.make_room(len(decoding)):
            self._shed_load(outputs)
            decoding, prefilling = self._resident_slots()
        slots = decoding
        planned = len(decoding)
        budget = self.config.token_budget - planned
        if decoding and self.config.prefill_chunk is not None:
            budget = min(budget, self.config.prefill_chunk)  # a running stream never waits through a long prefill
        for slot in prefilling:
            wanted = min(slot.choice.unevaluated, budget, self._to_next_checkpoint(slot))
            self.pool.make_room(planned + wanted)
            slot.n_tokens = min(wanted, self.pool.free_cells - planned)
            if slot.n_tokens <= 0:
                break
            slots.append(slot)
            budget -= slot.n_tokens
            planned += slot.n_tokens
        if not slots and prefilling:
            self._shed_load(outputs)
        return slots

    @staticmethod
    def _to_next_checkpoint(slot: _Slot) -> int:
        """A recurrent state can only be saved where the sequence stands, so prefill stops there."""
        n_past = slot.choice.session.n_past
        ahead = [p for p in slot.request.checkpoints if p > n_past] if slot.choice.index == 0 else []
        return min(ahead) - n_past if ahead else slot.choice.unevaluated

    def _resident_slots(self) -> tuple[list[_Slot], list[_Slot]]:
        """Slots of one decode token each, and prefill slots whose size `_plan` decides."""
        decoding: list[_Slot] = []
        prefilling: list[_Slot] = []
        for request in self.running:
            for choice in request.choices:
                if choice.finish_reason is None and not choice.waits_for_fork:
                    (decoding if choice.unevaluated == 1 else prefilling).append(_Slot(request, choice, 1))
        return decoding, prefilling

    def _shed_load(self, outputs: dict[str, RequestOutput]) -> None:
        """Out of cells: the newest request gives its sequences back (donating what it evaluated) and
        waits at the head of the queue with its output so far; it resumes where it stopped. A request
        alone in the context has filled it, and ends with `length`."""
        if len(self.running) == 1:
            self._finish(self.running[0], FinishReason.LENGTH, outputs)
            return
        request = self.running.pop()
        self.preemptions += 1
        self._release(request, donate=True)
        for choice in request.choices:
            choice.waits_for_fork = False  # siblings that never forked restart from the prompt
        self.waiting.appendleft(request)

    # -- running the batch ----------------------------------------------------------------------------

    def _run(self, slots: list[_Slot], outputs: dict[str, RequestOutput]) -> None:
        batch = self._batch
        batch.clear()
        for slot in slots:
            session = slot.choice.session
            start = session.n_past
            end = start + slot.n_tokens
            for pos in range(start, end):
                last = pos == len(slot.choice.tokens) - 1
                index = batch.add(slot.choice.tokens[pos], pos, session.seq, last)
                if last:
                    slot.logits_index = index
        started = time.perf_counter()
        try:
            self.pool.ctx.decode(batch)
        except NoKvSlot:
            self._shed_load(outputs)  # llama.cpp saw less room than our count: shed load and retry
            return
        except DecodeError as exc:
            self._fail({s.request for s in slots}, f"decode failed ({exc}); the request was dropped", outputs)
            return
        finally:
            self.times.decode_seconds += time.perf_counter() - started
        self.last_progress = time.monotonic()
        for slot in slots:
            session = slot.choice.session
            session.tokens.extend(slot.choice.tokens[session.n_past : session.n_past + slot.n_tokens])
            self._checkpoint_if_at_mark(slot)
        for slot in slots:
            if slot.logits_index is not None:
                self._sample(slot.request, slot.choice, slot.logits_index, outputs)

    def _checkpoint_if_at_mark(self, slot: _Slot) -> None:
        session = slot.choice.session
        kind = slot.request.checkpoints.get(session.n_past) if slot.choice.index == 0 else None
        if kind is not None:
            self.cache.insert(session, session.tokens, preview=self._preview(slot.request), kind=kind)

    def _fail(self, requests: set[Request], message: str, outputs: dict[str, RequestOutput]) -> None:
        for request in requests:
            self._finish(request, FinishReason.ERROR, outputs, error=message)

    # -- sampling -------------------------------------------------------------------------------------

    def _sample(self, request: Request, choice: Choice, index: int, outputs: dict[str, RequestOutput]) -> None:
        if self.cache.donates_prompt and choice.session.n_past == len(request.prompt) and not choice.forked:
            # Donate the prompt as soon as it is evaluated: requests waiting on this prefix attach it now.
            self.cache.insert(choice.session, choice.session.tokens, preview=self._preview(request))
        waiting_siblings = [c for c in request.choices if c.waits_for_fork]
        for sibling in waiting_siblings:  # the prompt is done: siblings share its cells from here
            self.pool.fork(choice.session, sibling.session)
            sibling.waits_for_fork = False
            sibling.forked = True
        for each in (choice, *waiting_siblings):
            self._take_token(request, each, index, outputs)
        if request.finished:
            self._finish(request, None, outputs)

    def _take_token(self, request: Request, choice: Choice, index: int, outputs: dict[str, RequestOutput]) -> None:
        ctx = self.pool.ctx
        token = choice.sampler.sample(ctx, index)
        choice.tokens.append(token)
        choice.n_generated += 1
        delta = self._delta(outputs, request, choice)
        if self.model.is_eog(token) and not request.ignore_eos:
            self._close_choice(choice, FinishReason.STOP, delta)
            return
        if request.logprobs is not None:
            delta.logprobs.append(token_logprobs(ctx.logits(index), token, request.logprobs))
        delta.token_ids.append(token)
        delta.text += choice.stop_matcher.feed(choice.detokenizer.feed(token))
        if choice.stop_matcher.stopped:
            choice.end(FinishReason.STOP)
            delta.finish_reason = FinishReason.STOP
        elif choice.n_generated >= request.max_tokens or len(choice.tokens) >= self.config.max_seq_len:
            self._close_choice(choice, FinishReason.LENGTH, delta)

    @staticmethod
    def _close_choice(choice: Choice, reason: FinishReason, delta: Delta) -> None:
        """End a choice normally: text held back for a possible stop string or a split character is real."""
        delta.text += choice.stop_matcher.feed(choice.detokenizer.flush()) + choice.stop_matcher.flush()
        choice.end(reason)
        delta.finish_reason = reason

    @staticmethod
    def _delta(outputs: dict[str, RequestOutput], request: Request, choice: Choice) -> Delta:
        output = outputs.setdefault(request.id, RequestOutput(request.id, []))
        for delta in output.deltas:
            if delta.index == choice.index:
                return delta
        output.deltas.append(Delta(choice.index))
        return output.deltas[-1]

    # -- the end of a request -------------------------------------------------------------------------

    def _finish(self, request: Request, reason: FinishReason | None, outputs: dict[str, RequestOutput],
                error: str | None = None, status: int = 500) -> None:
        """Close every open choice with `reason`, give the sequences back, emit usage (or the error)."""
        for choice in request.choices:
            if choice.finish_reason is None:
                choice.end(reason)
                self._delta(outputs, request, choice).finish_reason = reason
        self._release(request, donate=reason is not FinishReason.ERROR)
        if request in self.running:
            self.running.remove(request)
        if request in self.waiting:
            self.waiting.remove(request)
        output = outputs.setdefault(request.id, RequestOutput(request.id, []))
        output.error, output.status = error, status
        output.usage = Usage(
            prompt_tokens=len(request.prompt),
            completion_tokens=sum(c.n_generated for c in request.choices),
            cached_tokens=request.cached_tokens,
            queue_seconds=(request.admitted_at or time.monotonic()) - request.arrival,
        )

    def _release(self, request: Request, donate: bool) -> None:
        """Free every session of the request; unforked ones first donate what they evaluated to the
        cache. Forked siblings go first: their prompt cells are accounted to choice 0."""
        resident = [c for c in request.choices if c.session is not None]
        resident.sort(key=lambda c: not c.forked)
        for choice in resident:
            session = choice.session
            if donate and not choice.forked:
                self.cache.insert(session, session.tokens, preview=self._preview(request))
            self.pool.end_session(session)
            choice.session = None
            choice.forked = False

    def describe(self) -> str:
        """The scheduler's state in one line, for a stall report: what runs, what waits and on what."""
        now = time.monotonic()
        slots_full = self._running_choices() >= self.config.max_running
        running = ", ".join(
            f"{r.id} ({sum(c.session.n_past for c in r.choices if c.session)}/{len(r.prompt)} prompt tokens in cache)"
            for r in self.running[:8]
        )
        waiting = ", ".join(
            f"{r.id} waits {now - r.arrival:.0f}s for {'a free slot' if slots_full else r.blocked_on}"
            for r in list(self.waiting)[:8]
        )
        return (f"running {len(self.running)} [{running}]; waiting {self.n_waiting} [{waiting}]; "
                f"cells free {self.pool.free_cells} of {self.pool.n_cells}; "
                f"held pages {self.cache.stats().held_pages}; "
                f"free sequence ids {self.pool.free_ids}")

    def release_all(self) -> None:
        """Give back every sequence without donating, and every sampler chain (shutdown)."""
        for request in [*self.running, *self.waiting]:
            self._release(request, donate=False)
            for choice in request.choices:
                choice.end(choice.finish_reason or FinishReason.ABORT)
        self.running.clear()
        self.waiting.clear()

    def _preview(self, request: Request) -> str:
        return self.model.detokenize(request.prompt[-24:])

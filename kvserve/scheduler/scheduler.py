"""Continuous batching: every step decodes one token of each running sequence and fills the rest of
the token budget with prompt chunks, in one `llama_decode`.

The scheduler runs on the engine thread, the only thread that touches the llama context. Other
threads hand it work through `submit` and `abort`, which only append to thread-safe deques.

`Scheduler` coordinates a step over its parts, each of which keeps the invariants its docstring
states: `Admission` (who starts), `BatchPlanner` (what one decode carries), `Sampling` (tokens into
text), `Ending` (the end of a request), and `Embedder` (embedding jobs, in a context of their own,
one batch after each step); they share the `Queues` and a `KvManager` (sessions and the
prefix cache).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass

from kvserve.cache.kv_pool import KvPool
from kvserve.cache.prefix_cache import PrefixCache
from kvserve.llama.batch import Batch, ubatch_sizes
from kvserve.llama.context import DecodeError, NoKvSlot
from kvserve.llama.lora import LoraAdapters, describe
from kvserve.llama.sampler import GrammarDeadEnd, live_samplers
from kvserve.scheduler.admission import Admission
from kvserve.scheduler.batch_plan import BatchPlanner, Slot
from kvserve.scheduler.config import SchedulerConfig
from kvserve.scheduler.draft_model import DraftModel
from kvserve.scheduler.embeddings import Embedder
from kvserve.scheduler.ending import Ending
from kvserve.scheduler.kv_manager import KvManager
from kvserve.scheduler.queues import Queues
from kvserve.scheduler.request import FinishReason, Request, RequestOutput
from kvserve.scheduler.sampling import NonFiniteLogits, Sampling
from kvserve.scheduler.snapshot import EngineSnapshot
from kvserve.scheduler.speculation import SpecConfig, SpecMode, Speculator
from kvserve.scheduler.drafters import TreeDrafter
from kvserve.scheduler.step_output import StepOutputs
from kvserve.scheduler.ubatch_cost import attended_keys

_log = logging.getLogger("kvserve.scheduler")

# How long one piece of the cache's idle work (reading pages from disk into host memory) runs: a
# request arriving meanwhile waits no longer than that.
IDLE_WAIT = 0.01
# In its first PATIENCE seconds, the engine starts a ubatch timing only once it has served nothing
# for QUIET: a started server's first requests come in a burst (clients retrying, a router sending
# its traffic back), and each timing starts with a warm-up decode. Later any gap between requests
# times a size, as before: a server busy from its start must still learn its prices.
QUIET = 1.0
PATIENCE = 10.0


@dataclass
class StepTimes:
    """Where engine time goes: the bench reads these to report Python overhead."""

    steps: int = 0
    step_seconds: float = 0.0  # inside step()
    decode_seconds: float = 0.0  # inside llama_decode
    decodes: int = 0  # llama_decode calls
    decode_tokens: int = 0  # tokens they carried (decode, draft and prompt tokens)
    loop_seconds: float = 0.0  # the event loop's whole turn per step: hand-off, step, dispatch
    adapter_switches: int = 0  # steps that set another LoRA adapter set on the context than the one before


class Scheduler:
    def __init__(self, pool: KvPool, cache: PrefixCache, config: SchedulerConfig,
                 embedder: Embedder | None = None, spec: SpecConfig | None = None,
                 lora: LoraAdapters | None = None, draft: DraftModel | None = None) -> None:
        self.pool = pool
        self.lora = lora  # the adapters requests may name (None: none loaded)
        self.embedder = embedder  # embedding jobs, one batch of them after each generation step
        self.cache = cache
        self.config = config
        self.queues = Queues()
        self.times = StepTimes()
        self.kv = KvManager(pool, cache, draft)
        self.draft = draft
        tree = getattr(cache, "tree", None)
        self.speculator = Speculator(spec or SpecConfig.of(SpecMode.OFF),
                                     TreeDrafter(tree) if tree is not None else None,
                                     self.kv.cuts_rows, draft, pool.ctx.n_ubatch)
        self.ending = Ending(self.kv, self.queues, self.speculator)
        self.admission = Admission(self.kv, self.ending, config, self.queues)
        self.planner = BatchPlanner(self.kv, self.ending, config, self.queues, self.speculator)
        self.sampling = Sampling(pool.ctx, config.max_seq_len)
        self._inbox: deque[Request] = deque()
        self._aborts: deque[tuple[str, str | None, str | None]] = deque()
        self._batch = Batch(pool.ctx.n_batch)
        self.last_progress = time.monotonic()  # when a step last evaluated tokens or ended a request
        self.started = self.last_progress
        self.stopping = False  # set as the engine stops (any thread): idle work gives up
        self.calls_submitted = self.calls_started = 0  # calls for the engine thread (`AsyncEngine.call`)
        self._idling = False  # `idle` runs (engine thread): it may hold a borrowed stream
        self.snapshot = self._take_snapshot()

    # -- called from any thread --------------------------------------------------------------------

    def submit(self, request: Request) -> None:
        """Queue `request`; ValueError where it names an adapter that is not loaded."""
        unknown = {name for name, _ in request.adapters} - set(self.lora.names if self.lora else ())
        if unknown:
            raise ValueError(f"no LoRA adapter loaded as {', '.join(sorted(unknown))}")
        self._inbox.append(request)

    def abort(self, request_id: str, error: str | None = None, code: str | None = None) -> None:
        """End a request at the next step: as aborted, or, given `error` (and its `code`), as failed with a 503."""
        self._aborts.append((request_id, error, code))

    @property
    def running(self) -> list[Request]:
        return self.queues.running

    @property
    def waiting(self) -> deque[Request]:
        return self.queues.waiting

    def set_threads(self, n: int) -> None:
        """Every context of this engine decodes with `n` threads from its next call (engine thread)."""
        self.pool.ctx.set_threads(n)
        if self.embedder is not None:
            self.embedder.set_threads(n)
        if self.draft is not None:
            self.draft.ctx.set_threads(n)

    def has_work(self) -> bool:
        return bool(self._inbox or self._aborts or self.waiting or self.running
                    or (self.embedder and self.embedder.has_work()))

    @property
    def n_running(self) -> int:
        return len(self.running)

    @property
    def n_waiting(self) -> int:
        return len(self.waiting) + len(self._inbox)

    @property
    def preemptions(self) -> int:
        return self.planner.preemptions

    # -- between requests -----------------------------------------------------------------------------

    def wants_idle(self) -> bool:
        """Whether `idle` has something to do: pages the cache reads from disk off the engine thread
        to take in, or a ubatch size `auto` still needs timed (any thread); or is doing it: its last
        size counts as timed before the stream it borrowed is given back."""
        return self._idling or self.kv.cache.pending() or self.speculator.cost.next_to_time() is not None

    def idle_delay(self) -> float:
        """Seconds before `idle` should run (its work being `wants_idle`): none for the cache's reads;
        for a ubatch timing in the first `PATIENCE` seconds, what is left of `QUIET` since the engine
        last served; past them none where a stream is empty, else still `QUIET`: the timing would
        borrow an idle conversation's stream, and a request arriving in a short gap would find its
        rows gone and restore them instead of continuing in place."""
        now = time.monotonic()
        if self.kv.cache.pending() or (now - self.started >= PATIENCE and self.pool.empty_streams):
            return 0.0
        return max(0.0, self.last_progress + QUIET - now)

    def idle(self) -> None:
        """With nothing to serve (engine thread): a slice of the cache's reading from disk into host
        memory; else time the ubatch sizes `auto` has no price for yet, smallest first, alone, while
        nothing waits, each given up within the decode a request finds it in: a request arriving
        meanwhile waits for one node of that decode's graph (0-47 ms on a 1.5B), not the decode
        (0.1-1.3 s, which short requests to a 1.5B waited 0.29-0.70 s for), and the size is timed
        again at a later idle. They are timed in one stream borrowed as a new session would take it,
        which gets back what the cache holds of the rows it had (`KvManager.borrowed_session`)."""
        self._idling = True
        try:
            self._idle()
        finally:
            self._idling = False

    def _idle(self) -> None:
        if self.kv.cache.pending():
            self.kv.cache.settle(timeout=IDLE_WAIT)
            return
        cost = self.speculator.cost
        # a request, a call queued behind this one (a cache view, a prefix match) or the engine stopping
        interrupted = lambda: self.stopping or self.has_work() or self.calls_submitted > self.calls_started  # noqa: E731
        if cost.next_to_time() is None or interrupted():
            return
        quiet = lambda: not interrupted() and not self.kv.cache.pending()  # noqa: E731
        try:
            with self.kv.borrowed_session(give_back=quiet) as session:
                while (n := cost.next_to_time()) is not None and quiet():
                    seconds: dict[int, float] | None = {}
                    try:
                        seconds = self.pool.ctx.time_ubatches([n], seq=session.seq, stop=interrupted)
                    except Exception:  # a size that cannot be timed is priced from its neighbours
                        _log.exception("timing a ubatch of %d tokens failed", n)
                    if seconds is None:
                        break
                    cost.add_timings([n], seconds)
        except Exception:  # no stream to borrow, or its rows not given back: serving goes on
            _log.exception("idle ubatch timing failed")
            if (n := cost.next_to_time()) is not None:
                cost.add_timings([n], {})  # one size less each time, never a loop

    # -- the step -------------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        started = time.perf_counter()
        outputs = StepOutputs()
        try:
            self._take_inbox(outputs)
            self.admission.admit(outputs)
            self.admission.time_out_waiting(outputs)  # after admitting: a free slot is taken, not timed out
            slots = self.planner.plan(outputs)
            if slots:
                self._run(slots, outputs)
        except Exception:  # a bug must not hang every client: fail what is in flight, keep serving
            _log.exception("engine step failed; failing the requests in flight")
            self.ending.fail({*self.running, *self.waiting}, "internal engine error", outputs)
        if self.embedder and self.embedder.step():
            self.last_progress = time.monotonic()
        if outputs or not self.has_work():
            self.last_progress = time.monotonic()
        self.times.steps += 1
        self.times.step_seconds += time.perf_counter() - started
        self.snapshot = self._take_snapshot()
        return outputs.as_list()

    def _take_snapshot(self) -> EngineSnapshot:
        return EngineSnapshot(
            running=len(self.running),
            waiting=self.n_waiting,
            kv_cells=self.pool.n_cells,
            kv_used=self.pool.used_cells,
            free_streams=self.pool.free_streams,
            live_sessions=self.pool.live_sessions,
            inplace_reuses=self.pool.inplace_reuses,
            inplace_tokens=self.pool.inplace_tokens,
            cache=self.kv.stats(),
            preemptions=self.preemptions,
            live_samplers=live_samplers(),
            speculation={name: (s.drafts, s.drafted, s.accepted) for name, s in self.speculator.stats.items()},
        )

    def _take_inbox(self, outputs: StepOutputs) -> None:
        """Queue what was submitted, end what was aborted."""
        while self._inbox:
            self.waiting.append(self._inbox.popleft())
        while self._aborts:
            request_id, error, code = self._aborts.popleft()
            for request in [*self.running, *self.waiting]:
                if request.id == request_id:
                    reason = FinishReason.ERROR if error else FinishReason.ABORT
                    self.ending.end(request, reason, outputs, error=error, status=503, code=code)

    def _run(self, slots: list[Slot], outputs: StepOutputs) -> bool:
        """Decode the planned batch, record what it evaluated, then sample where a sequence's known
        tokens end. False: it evaluated nothing."""
        self._batch.clear()
        if self.lora is not None and self.lora.apply(self.pool.ctx, self.planner.adapters):
            self.times.adapter_switches += 1
        # in sequence-id order: llama.cpp puts sequences into one ubatch only while their ids run
        # consecutively, and each ubatch more reads every weight again
        for slot in sorted(slots, key=lambda s: s.choice.session.seq):
            slot.add_to(self._batch)
        if not self._decode(slots, outputs):
            return False
        self.last_progress = time.monotonic()
        for slot in slots:
            if not slot.draft:  # a draft's rows are kept once verified (`_sample`)
                self.kv.commit(slot.choice, slot.n_tokens)
                self.kv.checkpoint_if_at_mark(slot.request, slot.choice)
                self.kv.donate_prefill_progress(slot.request, slot.choice, slot.n_tokens)
        for slot in slots:
            # a choice ended in this step by a sibling's failure (its request ended) samples nothing
            if slot.logits_index is not None and slot.choice.finish_reason is None:
                self._sample(slot, outputs)
        return True

    def _decode(self, slots: list[Slot], outputs: StepOutputs) -> bool:
        """One `llama_decode` of the batch. False: it evaluated nothing, and what it meant for the
        batch's requests is done."""
        started = time.perf_counter()
        try:
            self.pool.ctx.decode(self._batch)
            if all(s.n_tokens == 1 for s in slots):  # decodes and drafts only: what drafts are priced against
                ubatches = ubatch_sizes([(s.choice.session.seq, s.n_decoded) for s in slots], self.pool.ctx.n_ubatch)
                keys = sum(attended_keys(s.choice.session.n_past, s.n_decoded) for s in slots)
                drafted = [(s.choice.spec, bool(s.draft)) for s in slots if s.choice.spec is not None]
                self.speculator.timed(ubatches, time.perf_counter() - started, keys, drafted)
        except NoKvSlot:
            self.planner.shed_load(outputs)  # llama.cpp saw less room than our count: shed load and retry
            return False
        except DecodeError as exc:
            self.ending.fail({s.request for s in slots}, f"decode failed ({exc}); the request was dropped", outputs)
            return False
        finally:
            self.times.decode_seconds += time.perf_counter() - started
            self.times.decodes += 1
            self.times.decode_tokens += self._batch.n_tokens
        return True

    def _sample(self, slot: Slot, outputs: StepOutputs) -> None:
        """The slot's sequence has evaluated all it knows: donate a finished prompt, let waiting
        siblings fork from it, then every one of them takes its next token."""
        request, choice = slot.request, slot.choice
        sampled = choice
        try:
            if slot.draft:
                accepted = self.sampling.verify(request, choice, slot.logits_index, slot.draft, outputs)
                self.kv.commit(choice, slot.n_tokens + accepted, slot.n_decoded)
                self.speculator.record(choice.spec, slot.drafter, len(slot.draft), accepted)
            else:
                self.kv.donate_evaluated_prompt(request, choice)
                for sampled in (choice, *self.kv.fork_waiting_siblings(request, choice)):
                    self.sampling.take_token(request, sampled, slot.logits_index, outputs)
        except GrammarDeadEnd as exc:
            self.ending.end(request, FinishReason.ERROR, outputs, status=400, error=(
                f"{exc}, {sampled.n_generated} token(s) into the reply: the schema or tools ask for text "
                "this model's vocabulary cannot spell"))
            return
        except NonFiniteLogits as exc:
            self.ending.end(request, FinishReason.ERROR, outputs, **_non_finite(request, exc))
            return
        if request.state.finished:
            self.ending.end(request, None, outputs)

    # -- reports and shutdown -----------------------------------------------------------------------

    def describe(self) -> str:
        """The scheduler's state in one line, for a stall report: what runs, what waits and on what."""
        now = time.monotonic()
        slots_full = self.admission.free_slots() <= 0
        running = ", ".join(
            f"{r.id} ({sum(c.session.n_past for c in r.state.choices if c.session)}/{len(r.prompt)} prompt tokens in cache)"
            for r in self.running[:8]
        )
        waiting = ", ".join(
            f"{r.id} waits {now - r.arrival:.0f}s for {'a free slot' if slots_full else r.state.blocked_on}"
            for r in list(self.waiting)[:8]
        )
        return (f"running {len(self.running)} [{running}]; waiting {self.n_waiting} [{waiting}]; "
                f"KV cells used {self.pool.used_cells} of {self.pool.n_cells}; "
                f"held pages {self.cache.stats().held_pages}; "
                f"free streams {self.pool.free_streams} of {self.pool.n_streams}")

    def release_all(self) -> None:
        """Give back every sequence without donating, and every sampler chain (shutdown)."""
        for request in [*self.running, *self.waiting]:
            self.kv.release(request, donate=False)
            for choice in request.state.choices:
                choice.end(choice.finish_reason or FinishReason.ABORT)
        self.running.clear()
        self.waiting.clear()


def _non_finite(request: Request, exc: NonFiniteLogits) -> dict:
    """The error a request whose logits went non-finite ends with: under adapters, the client's
    scale (a 400 naming `lora`); without, the model's fault."""
    if request.adapters:
        return dict(status=400, error=(
            f"lora: {exc} under the LoRA adapters {describe(request.adapters)}: their scale is too large "
            "for this model (send a smaller `lora` scale, or pick the adapter by name at --lora-scale)"))
    return dict(status=500, error=f"{exc}: the model computed no usable output for this request")

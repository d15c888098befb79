"""Admission: which waiting requests start, in what order, and why the others wait.

Invariants:
- running choices never exceed `max_running`;
- a request starts only when `KvManager.room_for` says so (a stream per sequence); a prompt that
  does not fit one stream fails with a 400;
- cache-aware order ranks only the head of the queue (`ADMISSION_WINDOW`), so a long queue costs
  nothing extra, and a request passed over `STARVATION_LIMIT` times goes first regardless;
- only a request never admitted times out in the queue (503); a preempted one keeps its place;
- a request left waiting says why in `blocked_on`, which the stall report prints.
"""

from __future__ import annotations

import time
from dataclasses import replace

from kvserve.cache.kv_pool import common_prefix
from kvserve.llama.detokenizer import Detokenizer
from kvserve.llama.sampler import Sampler
from kvserve.scheduler.config import SchedulerConfig
from kvserve.scheduler.ending import Ending
from kvserve.scheduler.kv_manager import KvManager, Room
from kvserve.scheduler.queues import Queues
from kvserve.scheduler.request import Choice, FinishReason, Request
from kvserve.scheduler.step_output import StepOutputs
from kvserve.scheduler.stop_strings import StopMatcher
from kvserve.scheduler.thinking import ThinkingWatch

# A waiting request passed over this many times by cache-aware admission goes first regardless.
STARVATION_LIMIT = 8
# Cache-aware admission ranks only the head of the queue, so a long queue costs nothing extra.
ADMISSION_WINDOW = 32


class Admission:
    def __init__(self, kv: KvManager, ending: Ending, config: SchedulerConfig, queues: Queues) -> None:
        self.kv = kv
        self.ending = ending
        self.config = config
        self.queues = queues

    def free_slots(self) -> int:
        return self.config.max_running - sum(_open_choices(r) for r in self.queues.running)

    def time_out_waiting(self, outputs: StepOutputs) -> None:
        """A request never admitted within the queue timeout fails with a 503."""
        limit = self.config.queue_timeout
        if not limit:
            return
        now = time.monotonic()
        for request in [r for r in self.queues.waiting if r.state.admitted_at is None and now - r.arrival > limit]:
            message = (f"the request waited {now - request.arrival:.1f}s (--queue-timeout {limit:g}s) for "
                       f"{request.state.blocked_on or 'a slot'}; the server is overloaded")
            self.ending.end(request, FinishReason.ERROR, outputs, error=message, status=503, code="queue_timeout")

    def admit(self, outputs: StepOutputs) -> None:
        """Start waiting requests in admission order until one cannot start for lack of a slot or a
        stream; one that waits for a running prefill of its prefix is skipped."""
        if self.free_slots() <= 0:
            return  # no slot: skip ranking the queue, which costs a cache lookup per waiting request
        admitted: list[Request] = []
        for request in self._admission_order():
            if _open_choices(request) > self.free_slots():
                request.state.blocked_on = "a free slot"
                break
            cached = self.kv.cached_len(request.key)
            if self._waits_for_a_running_prefill(request, cached):
                request.state.blocked_on = "a running prefill of the same prefix to donate it"
                continue
            room = self.kv.room_for(request, _open_choices(request))
            if room is Room.NEVER:
                self.ending.end(request, FinishReason.ERROR, outputs, error="the prompt does not fit in the KV cache",
                                status=400)
                continue
            if room is Room.LATER or not self._start(request):
                request.state.blocked_on = "a free KV stream"
                break
            self.queues.waiting.remove(request)
            self.queues.running.append(request)
            admitted.append(request)
        self._count_passed_over(admitted)

    def _admission_order(self) -> list[Request]:
        """Longest cached prefix first among the head of the queue; a request passed over too often
        goes first regardless, so nothing starves."""
        window = list(self.queues.waiting)[:ADMISSION_WINDOW]
        if not window:
            return window
        starved = [r for r in window if r.state.passed_over >= STARVATION_LIMIT]
        rest = sorted((r for r in window if r.state.passed_over < STARVATION_LIMIT),
                      key=lambda r: self.kv.cached_len(r.key), reverse=True)  # stable: ties keep arrival order
        return starved + rest

    def _count_passed_over(self, admitted: list[Request]) -> None:
        """Every request still waiting that arrived before one admitted now was passed over."""
        if not admitted:
            return
        latest = max(r.arrival for r in admitted)
        for request in self.queues.waiting:
            if request.arrival < latest:
                request.state.passed_over += 1

    def _waits_for_a_running_prefill(self, request: Request, cached: int) -> bool:
        """A request whose prompt shares more than a page beyond what is cached with a prompt of its
        namespace being prefilled right now waits for that prefill to donate, instead of computing
        the same prefix."""
        for other in self.queues.running:
            first = other.state.choices[0]
            if other.namespace != request.namespace:
                continue  # its donation is of another namespace: nothing to wait for
            if first.session is not None and first.session.n_past < len(other.prompt):
                if self.kv.gains_from_waiting(common_prefix(request.prompt, other.prompt), cached):
                    return True
        return False

    def _start(self, request: Request) -> bool:
        """Give each open choice a session, placed where what it starts with is kept or cached. False:
        no streams now. On the first start only choice 0 prefills (its siblings fork from it once the
        prompt is evaluated) and the checkpoint marks are planned; a preempted request resumes every choice."""
        first_time = not request.state.choices
        if first_time:
            request.state.choices = [self._new_choice(request, i) for i in range(request.n)]
        open_choices = [c for c in request.state.choices if c.finish_reason is None]
        if not self.kv.start(request, open_choices, open_choices[:1] if first_time else open_choices):
            return False
        request.state.admitted_at = request.state.admitted_at or time.monotonic()
        if first_time:
            for sibling in open_choices[1:]:
                sibling.waits_for_fork = True
            self.kv.plan_checkpoints(request)
        return True

    def _new_choice(self, request: Request, index: int) -> Choice:
        model = self.kv.model
        params = request.params
        if params.seed is not None and index:  # a seed per choice: n samples, each reproducible
            params = replace(params, seed=(params.seed + index) & 0xFFFFFFFF)
        return Choice(
            index=index,
            tokens=list(request.prompt),
            sampler=Sampler(model, params, defer_lazy_grammar=request.thinking is not None),
            detokenizer=Detokenizer(model, special=request.special_text),
            stop_matcher=StopMatcher(request.stop_strings),
            thinking=ThinkingWatch(request.thinking) if request.thinking is not None else None,
        )


def _open_choices(request: Request) -> int:
    """Choices the request runs (or will run once started): each takes a slot."""
    return sum(c.finish_reason is None for c in request.state.choices) if request.state.choices else request.n


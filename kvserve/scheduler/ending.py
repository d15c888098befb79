"""Ending requests, every way they end: finished, cut at the context's length, aborted, failed.

Invariant: every request the scheduler took ends here exactly once, with one output carrying
`usage` (or `error`); its sessions are released (donated to the prefix cache first, unless it
failed) and it leaves the running list or the waiting queue.
"""

from __future__ import annotations

from kvserve.scheduler.kv_manager import KvManager
from kvserve.scheduler.speculation import Speculator
from kvserve.scheduler.queues import Queues
from kvserve.scheduler.request import FinishReason, Request
from kvserve.scheduler.step_output import StepOutputs


class Ending:
    def __init__(self, kv: KvManager, queues: Queues, speculator: Speculator | None = None) -> None:
        self.kv = kv
        self.queues = queues
        self.speculator = speculator  # told of each choice that ends well (its answer may be drafted again)

    def end(self, request: Request, reason: FinishReason | None, outputs: StepOutputs,
            error: str | None = None, status: int = 500, code: str | None = None) -> None:
        """Close every open choice with `reason`, give the sequences back, emit usage (or the error)."""
        failed = reason is FinishReason.ERROR
        for choice in request.state.choices:
            if choice.finish_reason is None:
                choice.end(reason)
                outputs.delta(request, choice).finish_reason = reason
            if self.speculator is not None and choice.spec is not None and not failed:
                self.speculator.finished(choice.spec)
        self.kv.release(request, donate=not failed)
        self.queues.remove(request)
        outputs.end(request, error, status, code)

    def fail(self, requests: set[Request], message: str, outputs: StepOutputs) -> None:
        for request in requests:
            self.end(request, FinishReason.ERROR, outputs, error=message)

"""What one step emits: an output for each request it touched, a delta for each choice that moved.

Invariants: one `RequestOutput` per request and one `Delta` per choice in a step; `usage` is set on
the output of the step that ends the request, and only there.
"""

from __future__ import annotations

import time

from kvserve.scheduler.request import Choice, Delta, Request, RequestOutput, Usage


class StepOutputs:
    def __init__(self) -> None:
        self._by_request: dict[str, RequestOutput] = {}

    def __bool__(self) -> bool:
        return bool(self._by_request)

    def as_list(self) -> list[RequestOutput]:
        return list(self._by_request.values())

    def delta(self, request: Request, choice: Choice) -> Delta:
        output = self._of(request)
        for delta in output.deltas:
            if delta.index == choice.index:
                return delta
        output.deltas.append(Delta(choice.index))
        return output.deltas[-1]

    def end(self, request: Request, error: str | None, status: int, code: str | None = None) -> None:
        """The request's last output: its usage, and the error (with its HTTP status and code) if it failed."""
        output = self._of(request)
        output.error, output.status, output.code = error, status, code
        specs = [c.spec for c in request.state.choices if c.spec is not None]
        output.usage = Usage(
            prompt_tokens=len(request.prompt),
            completion_tokens=sum(c.n_generated for c in request.state.choices),
            cached_tokens=request.state.cached_tokens,
            queue_seconds=(request.state.admitted_at or time.monotonic()) - request.arrival,
            reasoning_tokens=sum(c.thinking.tokens for c in request.state.choices if c.thinking is not None),
            accepted_prediction_tokens=sum(s.prediction_accepted for s in specs),
            rejected_prediction_tokens=sum(s.prediction_rejected for s in specs),
        )

    def _of(self, request: Request) -> RequestOutput:
        output = self._by_request.get(request.id)
        if output is None:
            output = self._by_request[request.id] = RequestOutput(request.id, [])
        return output

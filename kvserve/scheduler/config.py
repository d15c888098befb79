"""The scheduler's limits, which each of its parts reads."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SchedulerConfig:
    max_running: int  # sequences decoding at once (--parallel)
    token_budget: int  # tokens per llama_decode (--batch-size)
    max_seq_len: int  # longest sequence one request may grow to
    queue_timeout: float = 0.0  # seconds a request may wait before its first admission; 0: forever
    prefill_chunk: int | None = None  # most prompt tokens in a step that also decodes; None: the whole budget

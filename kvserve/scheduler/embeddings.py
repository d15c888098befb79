"""Embedding jobs: pooled, L2-normalized vectors, decoded on the engine thread between generation steps.

They run in a context of their own on the served model (embeddings on, its own pooling type, a
small unified KV cache), not in the generation context: with embeddings on, llama.cpp outputs, and
so computes logits for, every token of a batch, and pools a sequence within one ubatch; and in the
generation context every embedding token would attend over the cells its cache holds. Flash
attention is off here: its tiled path for batches rounds so differently that a short text embedded
beside others came out at cosine 0.9995 to itself alone, against 0.99999 without it.

Invariants:
- only the engine thread calls `step`, which makes at most one `llama_decode` of at most
  `batch_tokens` tokens and `MAX_SEQUENCES_PER_BATCH` inputs, so a long list of inputs takes several
  steps with generation steps in between;
- the context holds nothing between steps (its memory is cleared after every decode);
- jobs are served first in, first out; one never started within the queue timeout fails with a
  503, as a generation request does; a job whose future was cancelled (its client left) is dropped;
- every input of a job is no longer than `batch_tokens` (the HTTP layer refuses longer ones).
"""

from __future__ import annotations

import dataclasses

import logging
import time
from collections import deque
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field
from typing import Any, Callable

import llama_cpp
import numpy as np

from kvserve.llama.batch import Batch
from kvserve.llama.context import Context, ContextParams
from kvserve.llama.model import Model

_log = logging.getLogger("kvserve.embeddings")

POOLING = {"mean": llama_cpp.LLAMA_POOLING_TYPE_MEAN, "cls": llama_cpp.LLAMA_POOLING_TYPE_CLS,
           "last": llama_cpp.LLAMA_POOLING_TYPE_LAST}
MAX_SEQUENCES_PER_BATCH = 64


def model_pooling(model: Model) -> str:
    """The pooling the model declares, as llama.cpp reads it (`<arch>.pooling_type`); mean for one
    that declares none or a kind that yields no single vector (none, rank), as causal LMs do."""
    declared = model.metadata(f"{model.metadata('general.architecture')}.pooling_type")
    by_value = {str(value): name for name, value in POOLING.items()}
    return by_value.get(declared or "", "mean")


class EmbeddingFailed(RuntimeError):
    def __init__(self, message: str, status: int, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.code = code


@dataclass(eq=False)
class EmbeddingJob:
    """The token ids of each input; `future` gets one normalized vector per input, in order, or an
    `EmbeddingFailed`. Set only by the engine thread; cancelled by the waiting side when it leaves.
    Inputs with the same tokens are embedded once, so they get the very same vector."""

    id: str
    inputs: list[list[int]]
    arrival: float = field(default_factory=time.monotonic)
    future: Future = field(default_factory=Future)

    def __post_init__(self) -> None:
        self.distinct = list(dict.fromkeys(tuple(tokens) for tokens in self.inputs))
        self.vectors: list[np.ndarray] = []  # of the first len(vectors) distinct inputs

    @property
    def started(self) -> bool:
        return bool(self.vectors)

    def add(self, vector: np.ndarray) -> None:
        self.vectors.append(vector)
        if len(self.vectors) == len(self.distinct):
            by_tokens = dict(zip(self.distinct, self.vectors))
            _settle(self.future.set_result, [by_tokens[tuple(tokens)] for tokens in self.inputs])


@dataclass(frozen=True)
class EmbedderConfig:
    pooling: str  # a key of POOLING
    batch_tokens: int  # tokens per decode, and the longest input
    n_threads: int
    queue_timeout: float = 0.0  # 0: forever


class Embedder:
    def __init__(self, model: Model, config: EmbedderConfig) -> None:
        self.config = config
        self._model = model
        self._ctx: Context | None = None  # made at the first embedding: a server that embeds nothing pays nothing
        self.dimensions = llama_cpp.llama_model_n_embd_out(model.ptr)
        self._batch = Batch(config.batch_tokens)
        self._jobs: deque[EmbeddingJob] = deque()  # appended by any thread, popped by the engine thread

    @property
    def ctx(self) -> Context:
        """The embedding context (engine thread only), made on first use."""
        if self._ctx is None:
            n_seq = min(MAX_SEQUENCES_PER_BATCH, self.config.batch_tokens)
            tokens = self.config.batch_tokens
            self._ctx = Context(self._model, ContextParams(
                n_ctx_seq=tokens, unified=True, n_batch=tokens, n_ubatch=tokens, n_seq_max=n_seq,
                n_threads=self.config.n_threads, flash_attn="off", embeddings=True,
                pooling=POOLING[self.config.pooling]))
        return self._ctx

    def set_threads(self, n: int) -> None:
        """Embed with `n` threads from the next batch on (the context, made later, starts so too)."""
        self.config = dataclasses.replace(self.config, n_threads=n)
        if self._ctx is not None:
            self._ctx.set_threads(n)

    @property
    def memory_bytes(self) -> int:
        """What its context allocated (0 before the first embedding made it)."""
        return self._ctx.buffer_bytes if self._ctx is not None else 0

    # -- any thread ---------------------------------------------------------------------------------

    def submit(self, job: EmbeddingJob) -> None:
        self._jobs.append(job)

    def has_work(self) -> bool:
        return bool(self._jobs)

    # -- the engine thread ---------------------------------------------------------------------------

    def step(self) -> bool:
        """Embed the next batch of inputs; True when it embedded or ended anything. A failure fails
        the jobs it touched (500) and leaves the rest to the next step."""
        ended = self._drop_ended()
        planned: list[EmbeddingJob] = []
        try:
            planned = self._plan()
            if not planned:
                return ended
            self.ctx.decode(self._batch)
            vectors = [_normalized(self.ctx.seq_embedding(seq)) for seq in range(len(planned))]
        except Exception as exc:  # a bad batch must not take the engine down
            _log.exception("embedding batch failed")
            for job in planned or list(self._jobs)[:1]:
                _fail(job, f"embedding failed ({exc})", 500)
            return True
        finally:
            if self._ctx is not None:  # never made for a step that had nothing to embed
                self._ctx.clear()
        for job, vector in zip(planned, vectors):
            job.add(vector)
        return True

    def fail_all(self, message: str, code: str | None = None) -> int:
        """End every job with a 503 (shutdown); returns how many."""
        jobs = list(self._jobs)
        self._jobs.clear()
        for job in jobs:
            _fail(job, message, 503, code)
        return len(jobs)

    def close(self) -> None:
        self.fail_all("the server is shutting down", "shutting_down")
        self._batch.close()
        if self._ctx is not None:
            self._ctx.close()

    def _drop_ended(self) -> bool:
        """Forget jobs done or cancelled; fail those that waited past the queue timeout unstarted."""
        limit, now, ended = self.config.queue_timeout, time.monotonic(), False
        for job in list(self._jobs):
            if not job.future.done() and limit and not job.started and now - job.arrival > limit:
                _fail(job, f"the request waited {limit:g}s for the engine; the server is overloaded", 503, "queue_timeout")
            if job.future.done():
                self._jobs.remove(job)
                ended = True
        return ended

    def _plan(self) -> list[EmbeddingJob]:
        """Fill the batch with the next inputs in job order, one sequence each; the job of each."""
        self._batch.clear()
        planned: list[EmbeddingJob] = []
        for job in list(self._jobs):  # other threads submit meanwhile
            for tokens in job.distinct[len(job.vectors) + planned.count(job):]:
                if len(planned) == self.ctx.n_seq_max or self._batch.n_tokens + len(tokens) > self._batch.capacity:
                    return planned
                for pos, token in enumerate(tokens):
                    self._batch.add(token, pos, len(planned), True)
                planned.append(job)
        return planned


def _normalized(vector: np.ndarray) -> np.ndarray:
    norm = float(np.linalg.norm(vector))
    return vector / norm if norm > 0 else vector


def _fail(job: EmbeddingJob, message: str, status: int, code: str | None = None) -> None:
    _settle(job.future.set_exception, EmbeddingFailed(message, status, code))


def _settle(setter: Callable[[Any], None], value: Any) -> None:
    """Set a job's outcome unless its waiter cancelled it meanwhile (from another thread)."""
    try:
        setter(value)
    except InvalidStateError:
        pass

"""What the scheduler serves: requests, their choices (one sequence each) and what a step emits."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvserve.cache.chat_marks import Mark, MarkKind
from kvserve.cache.kv_pool import Session
from kvserve.cache.prefix_key import PrefixKey
from kvserve.llama.detokenizer import Detokenizer
from kvserve.llama.lora import BASE, AdapterSet
from kvserve.llama.sampler import Sampler, SamplingParams, TokenLogprobs
from kvserve.scheduler.stop_strings import StopMatcher
from kvserve.scheduler.thinking import ThinkingLimit, ThinkingWatch

if TYPE_CHECKING:
    from kvserve.scheduler.speculation import SpecState


class FinishReason(str, enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    ERROR = "error"
    ABORT = "abort"


@dataclass(eq=False)
class RequestState:
    """What the engine thread owns of a request: written there only, as it admits, runs and ends it."""

    choices: list["Choice"] = field(default_factory=list)
    cached_tokens: int = 0
    admitted_at: float | None = None
    passed_over: int = 0  # times cache-aware admission chose another request first
    checkpoints: dict[int, MarkKind] = field(default_factory=dict)  # the marks worth a state, by position
    blocked_on: str = "its turn in the queue"  # why admission last passed it over (for stall reports)

    @property
    def finished(self) -> bool:
        return bool(self.choices) and all(c.finish_reason is not None for c in self.choices)


@dataclass(frozen=True, eq=False)
class Request:
    """A prompt and how to continue it, as the server built it: frozen, and its lists are never
    changed, so any thread may read it. What serving it changes lives in `state`, the engine's."""

    id: str
    prompt: list[int]
    params: SamplingParams
    max_tokens: int
    n: int = 1
    stop_strings: list[str] = field(default_factory=list)
    logprobs: int | None = None  # how many alternatives per token; None: no logprobs at all
    ignore_eos: bool = False  # generate max_tokens regardless (benchmarks)
    marks: list[Mark] = field(default_factory=list)  # where a chat prompt's prefill may stop for a checkpoint
    special_text: bool = False  # the text spells out special tokens (a tool-call marker may be one)
    namespace: str = ""  # whose cached rows it may use and adds to ("": the shared default; see server/namespace.py)
    thinking: ThinkingLimit | None = None  # a reply that thinks first: watched, and closed at its budget
    prediction: list[int] = field(default_factory=list)  # OpenAI's Predicted Outputs, tokenized: a draft
    adapters: AdapterSet = BASE  # the LoRA adapters its steps run under (canonical; part of its namespace)
    arrival: float = field(default_factory=time.monotonic)
    state: RequestState = field(default_factory=RequestState, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.adapters and "lora:" not in self.namespace:
            raise ValueError("a request under LoRA adapters needs a namespace that names them (request_namespace)")

    @property
    def key(self) -> PrefixKey:
        """What the prefix cache knows the prompt by."""
        return PrefixKey(self.namespace, self.prompt)


@dataclass(eq=False)
class Choice:
    """One completion of a request: a sequence whose `tokens` run past what its session evaluated.

    `tokens` is prompt + generated; `session.tokens` is what sits in the KV cache. The difference
    is what the next steps feed: a prompt tail while prefilling, the one sampled token while decoding.

    The choice owns its `sampler` (a native llama.cpp chain) from creation until `end`, which every
    way a choice can stop goes through; a preempted choice keeps it, so penalties and grammar state
    carry over when it resumes.
    """

    index: int
    tokens: list[int]
    sampler: Sampler
    detokenizer: Detokenizer
    stop_matcher: StopMatcher
    session: Session | None = None
    thinking: ThinkingWatch | None = None
    waits_for_fork: bool = False  # a sibling of choice 0 that will share its prompt
    forked: bool = False  # it shares choice 0's prompt cells, so it never donates them
    n_generated: int = 0
    finish_reason: FinishReason | None = None
    spec: SpecState | None = None  # the speculator's view of this choice, once it drafted for it

    @property
    def unevaluated(self) -> int:
        return len(self.tokens) - (self.session.n_past if self.session else 0)

    @property
    def active(self) -> bool:
        """It takes part in the next step: not finished, and not waiting to fork from choice 0."""
        return self.finish_reason is None and not self.waits_for_fork

    def end(self, reason: FinishReason | None) -> None:
        """Mark the choice finished and free its sampler chain (it samples nothing more)."""
        self.finish_reason = reason
        self.sampler.close()


@dataclass
class Delta:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    stop_sequence: str | None = None  # with finish STOP: the stop string that ended the text, if one did


@dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    queue_seconds: float
    reasoning_tokens: int = 0  # of completion_tokens, those generated while thinking
    accepted_prediction_tokens: int = 0  # of the request's `prediction`, verified into the output
    rejected_prediction_tokens: int = 0  # of the request's `prediction`, drafted and rejected


@dataclass
class RequestOutput:
    """What one step produced for one request; `usage` is set on its last output."""

    request_id: str
    deltas: list[Delta]
    at: float = field(default_factory=time.monotonic)
    usage: Usage | None = None
    error: str | None = None
    status: int = 500  # the HTTP status an error maps to, for a response that has not started
    code: str | None = None  # the error's code for a client's program (OpenAI's `error.code`), if it has one

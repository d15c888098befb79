"""Per-request sampler chains (llama.cpp's own samplers) and log-probabilities."""

from __future__ import annotations

import ctypes
import random
import threading
from dataclasses import dataclass, field

import llama_cpp
import numpy as np

from kvserve.llama.context import Context
from kvserve.llama.model import Model


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repeat_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    grammar: str | None = None  # GBNF, root rule "root"
    # A lazy grammar: free until a pattern (ECMAScript regex over the generated text; the grammar
    # starts at its first group) or a token fires. Empty: the grammar holds from the first token.
    grammar_trigger_patterns: tuple[str, ...] = ()
    grammar_trigger_tokens: tuple[int, ...] = ()

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


class GrammarError(ValueError):
    """llama.cpp rejected a grammar."""


# Penalties look back this far over generated tokens (llama.cpp's default window).
_PENALTY_WINDOW = 64


class _LiveCount:
    """How many chains are allocated and not yet freed, across threads (the request path builds one
    to check a grammar; the engine thread builds the rest)."""

    def __init__(self) -> None:
        self._n = 0
        self._lock = threading.Lock()

    def add(self, delta: int) -> None:
        with self._lock:
            self._n += delta

    @property
    def value(self) -> int:
        return self._n


_live = _LiveCount()


def live_samplers() -> int:
    """Sampler chains allocated in llama.cpp and not yet freed: zero whenever no request is open."""
    return _live.value


class Sampler:
    """One stateful llama.cpp sampler chain (penalties and grammar remember the tokens they saw).

    It owns native memory (about `n_vocab` x 12 bytes of candidates, more with grammar and penalty
    stages) that only `close` frees; there is deliberately no `__del__`, so a path that forgets to
    close shows up in `live_samplers()` instead of being hidden by the garbage collector. Whoever
    constructs one closes it exactly once; `close` is idempotent so a second call is harmless.
    """

    def __init__(self, model: Model, params: SamplingParams) -> None:
        chain_params = llama_cpp.llama_sampler_chain_default_params()
        chain_params.no_perf = True
        self._chain = llama_cpp.llama_sampler_chain_init(chain_params)
        _live.add(1)
        try:
            for stage in _stages(model, params):
                llama_cpp.llama_sampler_chain_add(self._chain, stage)
        except GrammarError:
            self.close()
            raise

    def sample(self, ctx: Context, index: int) -> int:
        """Pick the next token from the logits of batch entry `index` and remember it."""
        return llama_cpp.llama_sampler_sample(self._chain, ctx.ptr, index)

    def accept(self, token: int) -> None:
        """Remember a token chosen without sampling (one the server forced), as `sample` remembers its own."""
        llama_cpp.llama_sampler_accept(self._chain, token)

    def close(self) -> None:
        """Free the chain and every stage it took ownership of."""
        if self._chain is not None:
            llama_cpp.llama_sampler_free(self._chain)
            self._chain = None
            _live.add(-1)


def _stages(model: Model, p: SamplingParams) -> list[llama_cpp.llama_sampler_p]:
    n_vocab = model.info.n_vocab
    stages = []
    if p.grammar is not None:
        stages.append(_grammar(model, p))
    if p.logit_bias:
        biases = (llama_cpp.llama_logit_bias * len(p.logit_bias))(
            *(llama_cpp.llama_logit_bias(token, bias) for token, bias in p.logit_bias.items())
        )
        stages.append(llama_cpp.llama_sampler_init_logit_bias(n_vocab, len(p.logit_bias), biases))
    if p.presence_penalty or p.frequency_penalty or p.repeat_penalty != 1.0:
        stages.append(
            llama_cpp.llama_sampler_init_penalties(
                n_vocab,
                _PENALTY_WINDOW, p.repeat_penalty, p.frequency_penalty, p.presence_penalty
            )
        )
    if p.greedy:
        stages.append(llama_cpp.llama_sampler_init_greedy())
        return stages
    if p.top_k > 0:
        stages.append(llama_cpp.llama_sampler_init_top_k(p.top_k))
    if p.top_p < 1.0:
        stages.append(llama_cpp.llama_sampler_init_top_p(p.top_p, 1))
    if p.min_p > 0.0:
        stages.append(llama_cpp.llama_sampler_init_min_p(p.min_p, 1))
    stages.append(llama_cpp.llama_sampler_init_temp(p.temperature))
    seed = p.seed if p.seed is not None else random.getrandbits(32)
    stages.append(llama_cpp.llama_sampler_init_dist(seed & 0xFFFFFFFF))
    return stages


def _grammar(model: Model, p: SamplingParams) -> llama_cpp.llama_sampler_p:
    if p.grammar_trigger_patterns or p.grammar_trigger_tokens:
        patterns = (ctypes.c_char_p * len(p.grammar_trigger_patterns))(*(t.encode() for t in p.grammar_trigger_patterns))
        tokens = (llama_cpp.llama_token * len(p.grammar_trigger_tokens))(*p.grammar_trigger_tokens)
        grammar = llama_cpp.llama_sampler_init_grammar_lazy_patterns(
            model.vocab, p.grammar.encode(), b"root", patterns, len(p.grammar_trigger_patterns),
            tokens, len(p.grammar_trigger_tokens))
    else:
        grammar = llama_cpp.llama_sampler_init_grammar(model.vocab, p.grammar.encode(), b"root")
    if not grammar:
        raise GrammarError("llama.cpp could not parse the grammar")
    return grammar


@dataclass(frozen=True)
class TokenLogprobs:
    token: int
    logprob: float
    top: list[tuple[int, float]]  # best first


def token_logprobs(logits: np.ndarray, token: int, n_top: int) -> TokenLogprobs:
    """Log-softmax of the model's raw logits: the chosen token's and the `n_top` best."""
    shifted = logits.astype(np.float64) - float(logits.max())
    logprobs = shifted - np.log(np.exp(shifted).sum())
    top: list[tuple[int, float]] = []
    if n_top > 0:
        best = np.argpartition(-logprobs, n_top)[:n_top]
        best = best[np.argsort(-logprobs[best])]
        top = [(int(t), float(logprobs[t])) for t in best]
    return TokenLogprobs(token=token, logprob=float(logprobs[token]), top=top)

"""Per-request sampler chains (llama.cpp's own samplers) and log-probabilities."""

from __future__ import annotations

import ctypes
import random
import threading
from dataclasses import dataclass, field, replace
from typing import Callable

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
        """Below vLLM's 1e-5 a temperature is greedy: logits divided by 1e-38 overflow to inf, and the
        draw then always took the vocabulary's last token."""
        return self.temperature < 1e-5

    @property
    def penalized(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repeat_penalty != 1.0)

    @property
    def unshaped(self) -> bool:
        """Nothing changes the logits before the pick: no grammar, bias or penalty."""
        return self.grammar is None and not self.logit_bias and not self.penalized

    @property
    def truncated(self) -> bool:
        """A draw from fewer tokens than the whole vocabulary (top_k, top_p or min_p)."""
        return self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0


class GrammarError(ValueError):
    """llama.cpp rejected a grammar."""


class GrammarDeadEnd(GrammarError):
    """The grammar admits no token the model can write next (a schema that asks for a character no
    token spells, such as a NUL): llama.cpp would abort the process on the token it then picks."""


# llama_token_data's layout, to fill a candidates buffer from a row of logits at once
_TOKEN_DATA = np.dtype([("id", np.int32), ("logit", np.float32), ("p", np.float32)])

# Penalties look back this far over generated tokens (llama.cpp's default window).
_PENALTY_WINDOW = 64

# Tokens whose weights a draw sums at once (`_draw`)
_BLOCK = 1024


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
    """One stateful llama.cpp sampler chain (penalties and grammar remember the tokens they saw); a
    chain that is greedy alone or a temperature alone picks from the row itself, as it would.

    It owns native memory (about `n_vocab` x 12 bytes of candidates, more with grammar and penalty
    stages) that only `close` frees; there is deliberately no `__del__`, so a path that forgets to
    close shows up in `live_samplers()` instead of being hidden by the garbage collector. Whoever
    constructs one closes it exactly once; `close` is idempotent so a second call is harmless.
    """

    def __init__(self, model: Model, params: SamplingParams, defer_lazy_grammar: bool = False) -> None:
        """`defer_lazy_grammar`: a lazy grammar waits out of the chain until `gate` arms it."""
        if params.seed is None:
            params = replace(params, seed=random.getrandbits(32))
        self._model, self._params = model, params
        self._deferred = defer_lazy_grammar and params.grammar is not None and bool(
            params.grammar_trigger_patterns or params.grammar_trigger_tokens)
        self._armed = params.grammar is not None and not self._deferred  # the chain's first stage is the grammar
        self.grammar_tokens = 0  # tokens a deferred grammar was given: what its trigger search scanned
        self._buffer: ctypes.Array | None = None  # candidates, once a grammar is sampled with
        # Greedy and nothing else: the first highest logit, as llama.cpp's greedy stage picks it (and
        # it remembers nothing), read straight from the row; its candidates buffer cost 3-10x as much.
        self._argmax = params.greedy and params.unshaped
        # A temperature and nothing else (what OpenAI's clients send): the softmax and the draw over the
        # whole row at once, where llama.cpp's dist stage takes a scalar expf a token (0.3 ms a draw on a
        # 49k vocabulary, 1.0 ms on 152k). One draw a token from the request's seed: as reproducible as
        # the chain's, though not the chain's own draws for that seed.
        self._draw = (random.Random(params.seed) if not params.greedy and params.unshaped and not params.truncated
                      else None)
        self._chain = _new_chain()
        try:
            for stage in _stages(model, replace(params, grammar=None) if self._deferred else params):
                llama_cpp.llama_sampler_chain_add(self._chain, stage)
        except GrammarError:
            self.close()
            raise

    def sample(self, ctx: Context, index: int) -> int:
        """Pick the next token from the logits of batch entry `index` and remember it. GrammarDeadEnd
        where a grammar in the chain rejects every token."""
        self._count_grammar_token()
        if self._argmax:
            return int(ctx.logits(index).argmax())
        if self._draw is not None:
            return _draw(ctx.logits(index), self._params.temperature, self._draw.random())
        if not self._armed:
            return llama_cpp.llama_sampler_sample(self._chain, ctx.ptr, index)
        # llama_sampler_sample's own steps, with a look at the pick before the grammar is given it
        candidates = self._candidates(ctx.logits(index))
        llama_cpp.llama_sampler_apply(self._chain, ctypes.byref(candidates))
        picked = candidates.data[candidates.selected] if 0 <= candidates.selected < candidates.size else None
        if picked is None or picked.logit == float("-inf"):
            raise GrammarDeadEnd("the grammar admits no token this model can write next")
        llama_cpp.llama_sampler_accept(self._chain, picked.id)
        return picked.id

    def accept(self, token: int) -> None:
        """Remember a token chosen without sampling (one the server forced), as `sample` remembers its
        own. GrammarDeadEnd where a grammar in the chain rejects it."""
        if not self.allows([token])[0]:
            raise GrammarDeadEnd(f"the grammar does not admit token {token}")
        self._count_grammar_token()
        llama_cpp.llama_sampler_accept(self._chain, token)

    def _candidates(self, logits: np.ndarray) -> llama_cpp.llama_token_data_array:
        """Every token with its logit, unsorted, in a buffer this chain keeps (as llama.cpp's chain does)."""
        if self._buffer is None:
            self._buffer = (llama_cpp.llama_token_data * len(logits))()
        view = np.ctypeslib.as_array(self._buffer).view(_TOKEN_DATA)
        view["id"] = np.arange(len(logits), dtype=np.int32)
        view["logit"] = logits
        view["p"] = 0.0
        return llama_cpp.llama_token_data_array(self._buffer, len(logits), -1, False)

    def gate(self, on: bool, replay: Callable[[], list[int]]) -> None:
        """A deferred lazy grammar in the chain (`on`) or out of it. Armed, it is a fresh one that
        first sees the tokens `replay` gives (the text its triggers need from before this point);
        the other stages keep their state. llama.cpp's lazy grammar matches its patterns against all
        the text it saw at every token, so text it is kept from (the thinking) costs nothing."""
        if not self._deferred or on == self._armed or self._chain is None:
            return
        if on:
            grammar = _grammar(self._model, self._params)
            tokens = replay()
            for token in tokens:
                llama_cpp.llama_sampler_accept(grammar, token)
            self.grammar_tokens += len(tokens)
            chain = _new_chain()
            llama_cpp.llama_sampler_chain_add(chain, grammar)
            while llama_cpp.llama_sampler_chain_n(self._chain) > 0:
                llama_cpp.llama_sampler_chain_add(chain, llama_cpp.llama_sampler_chain_remove(self._chain, 0))
            llama_cpp.llama_sampler_free(self._chain)
            _live.add(-1)
            self._chain = chain
        else:
            llama_cpp.llama_sampler_free(llama_cpp.llama_sampler_chain_remove(self._chain, 0))
        self._armed = on

    def allows(self, tokens: list[int]) -> list[bool]:
        """Which of `tokens` the grammar would let through now (all of them, with no grammar in the
        chain or a lazy one still waiting for its trigger)."""
        if not self._armed or self._chain is None:
            return [True] * len(tokens)
        data = (llama_cpp.llama_token_data * len(tokens))(*(llama_cpp.llama_token_data(t, 0.0, 0.0) for t in tokens))
        candidates = llama_cpp.llama_token_data_array(data, len(tokens), -1, False)
        llama_cpp.llama_sampler_apply(llama_cpp.llama_sampler_chain_get(self._chain, 0), ctypes.byref(candidates))
        return [data[i].logit != float("-inf") for i in range(len(tokens))]

    def _count_grammar_token(self) -> None:
        if self._deferred and self._armed:
            self.grammar_tokens += 1

    def close(self) -> None:
        """Free the chain and every stage it took ownership of."""
        if self._chain is not None:
            llama_cpp.llama_sampler_free(self._chain)
            self._chain = None
            _live.add(-1)


def _draw(row: np.ndarray, temperature: float, uniform: float) -> int:
    """A token drawn from softmax(`row` / `temperature`) with `uniform` in [0, 1): the first whose
    cumulative weight passes `uniform` of the total. The weights are summed a block at a time and
    accumulated within the one block the draw falls in (a cumulative sum of the whole row cost four
    times the rest). A row that is not finite gives its first token that is not, which the caller
    refuses as it refuses such a pick from llama.cpp."""
    n = len(row)
    weights = np.zeros(-(-n // _BLOCK) * _BLOCK, dtype=np.float32)  # the tail past the row weighs nothing
    np.subtract(row, row.max(), out=weights[:n])
    np.divide(weights[:n], np.float32(temperature), out=weights[:n])
    np.exp(weights[:n], out=weights[:n])
    blocks = np.cumsum(weights.reshape(-1, _BLOCK).sum(axis=1, dtype=np.float64))
    if not np.isfinite(blocks[-1]):
        return int(np.flatnonzero(~np.isfinite(row))[0])
    target = uniform * blocks[-1]
    block = min(int(np.searchsorted(blocks, target, side="right")), len(blocks) - 1)
    first = block * _BLOCK
    within = np.cumsum(weights[first:first + _BLOCK], dtype=np.float64)
    within += blocks[block - 1] if block else 0.0
    picked = first + int(np.searchsorted(within, target, side="right"))
    if picked < min(first + _BLOCK, n):
        return picked
    return int(np.flatnonzero(weights[:first + _BLOCK])[-1])  # summing in another order rounded past the block


def _new_chain() -> llama_cpp.llama_sampler_p:
    chain_params = llama_cpp.llama_sampler_chain_default_params()
    chain_params.no_perf = True
    _live.add(1)
    return llama_cpp.llama_sampler_chain_init(chain_params)


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
    if p.penalized:
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
    stages.append(llama_cpp.llama_sampler_init_dist((p.seed or 0) & 0xFFFFFFFF))  # Sampler gives one
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

"""Drafters: guesses of a sequence's next tokens, which the target verifies in its ordinary step.

Every drafter answers `propose(sequence, k)` with at most `k` tokens that it guesses follow the
sequence's tokens (prompt and output so far); an empty list is no guess. A drafter never touches a
llama context: it reads tokens, so a wrong guess costs only the rows the step verifies in vain.

- `NgramDrafter` ("prompt lookup decoding"): the tokens that followed the latest earlier occurrence
  of the sequence's last n tokens (n from `max_n` down to `min_n`), in its own prompt and output;
- `PredictionDrafter`: OpenAI's Predicted Outputs: the client's `prediction` text from its start,
  picked up again by n-gram after the output departs from it.

Both follow what they found as a copy (`_Copy`) until the output departs from it: an edit's answer
copies its input with a few tokens changed, so a departure after a run of agreeing tokens is taken
for a substitution (a renamed identifier), confirmed by the next token, and drafted wherever the
source token comes again; the copy goes on past it instead of waiting for n-grams to match again.
- `TreeDrafter`: what followed this very context in earlier requests of the same cache namespace,
  as the prefix cache's radix tree of KV pages stores it (an agent re-sending a step, a regenerated
  answer); another tenant's or salt's text is never drafted, as it is never attached.
- `RecentDrafter`: n-grams of recent answers in the same cache namespace, followed as a copy: the
  same question asked in another context, a template filled in again.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Protocol

from kvserve.cache.page_tree import PageTree
from kvserve.cache.prefix_key import PrefixKey


@dataclass(eq=False)
class Sequence:
    """What a drafter reads of one choice: its tokens (prompt then output) and the request's
    predicted output, tokenized. Drafters keep their per-sequence state here (`_Copier`)."""

    tokens: list[int]
    prompt_len: int
    prediction: list[int] = field(default_factory=list)
    namespace: str = ""  # whose earlier requests the prefix tree may draft from
    seq: int = -1  # the stream it runs in this step (a draft model drafts in its stream of that id)
    copiers: dict[str, "_Copier"] = field(default_factory=dict)


class DrafterKind(Protocol):
    """What the speculator knows of a drafter (a draft model's too) beside its guesses: the next
    drafter is a class with these, and nothing else names it."""

    name: str  # in metrics, /server_info and each sequence's evidence
    prior: float  # its tokens' acceptance before any was verified (optimistic enough to be tried)
    # it guesses from text alone: `auto` drafts it for a sequence only once it watched its proposals
    # come true there (a prediction is the client's word, a tree draft this very context's)
    watch_first: bool


class Drafter(DrafterKind, Protocol):
    def propose(self, sequence: Sequence, k: int) -> list[int]: ...


class _NgramIndex:
    """For each n-gram of a growing token list, the position just after its latest occurrence that
    some token follows; kept up to date incrementally (each token is indexed once)."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n
        self.after: dict[tuple[int, ...], int] = {}
        self.indexed = 0  # grams ending before this position are in `after`

    def update(self, tokens: list[int]) -> None:
        for end in range(max(self.indexed, self.min_n), len(tokens)):  # a gram ending at `end` has a follower
            for n in range(self.min_n, min(self.max_n, end) + 1):
                self.after[tuple(tokens[end - n : end])] = end
        self.indexed = max(self.indexed, len(tokens))

    def lookup(self, suffix: list[int]) -> tuple[int, int] | None:
        """Where the continuation of the longest indexed tail of `suffix` starts, and that tail's
        length, if any."""
        for n in range(min(self.max_n, len(suffix)), self.min_n - 1, -1):
            at = self.after.get(tuple(suffix[len(suffix) - n :]))
            if at is not None:
                return at, n
        return None


# Ends each entry of a `RecentDrafter` pool: no token, so no gram with it matches an output.
END = -1

# A copy that has agreed this many tokens in a row takes a token that departs from it for a
# substitution (a renamed identifier) and goes on after it, rather than losing its place.
MIN_RUN = 4


@dataclass(eq=False)
class _Copy:
    """An output that copies a source: `tokens[out:]` is expected to be `source[src:]`, each token
    through the sequence's confirmed substitutions. A token that departs after `MIN_RUN` agreeing
    ones is taken for a substitution of the source's token (`pending`), confirmed when the next one
    agrees; any other departure loses the copy.

    Invariant: `out` is where the tokens checked so far end; a copy of the sequence's own tokens has
    `src < out`."""

    source: list[int]
    src: int
    out: int
    run: int
    pending: tuple[int, int] | None = None  # the source's token and the output's, unconfirmed


@dataclass(eq=False)
class _Copier:
    """One drafter's state for one sequence: an n-gram index of what may be copied, the copy the
    output follows, and the substitutions it confirmed (source token -> output token)."""

    index: _NgramIndex
    copy: _Copy | None = None
    subs: dict[int, int] = field(default_factory=dict)

    def follow(self, tokens: list[int]) -> bool:
        """Check the copy against the tokens that came since; False once it is lost."""
        copy, subs = self.copy, self.subs
        while copy is not None and copy.out < len(tokens):
            if copy.src >= len(copy.source) or copy.source[copy.src] == END:  # the source's end, or an entry's
                copy = None
                break
            source, got = copy.source[copy.src], tokens[copy.out]
            if got == subs.get(source, source):
                if copy.pending is not None:
                    self._confirm(*copy.pending)
                    copy.pending = None
                copy.run += 1
            elif copy.pending is None and copy.run >= MIN_RUN:
                copy.pending, copy.run = (source, got), 0
            else:
                copy = None
                break
            copy.src += 1
            copy.out += 1
        self.copy = copy
        return copy is not None

    def _confirm(self, source: int, output: int) -> None:
        if source == output:
            self.subs.pop(source, None)
        else:
            self.subs[source] = output

    def find(self, source: list[int], tail: list[int], out: int) -> bool:
        """Start a copy where `tail` (the output's last tokens), or its tokens with the confirmed
        substitutions undone, occurred last in `source`."""
        found = self.index.lookup(tail)
        if found is None and self.subs:
            undo = {output: source_token for source_token, output in self.subs.items()}
            found = self.index.lookup([undo.get(t, t) for t in tail])
        if found is None:
            return False
        self.copy = _Copy(source, found[0], out, found[1])
        return True

    def draft(self, k: int) -> list[int]:
        copy, subs = self.copy, self.subs
        assert copy is not None
        draft = copy.source[copy.src : copy.src + k]
        if END in draft:  # a pool's entries end in END: no draft runs past one
            draft = draft[: draft.index(END)]
        return [subs.get(t, t) for t in draft]


class NgramDrafter:
    """Prompt lookup over the sequence's own tokens, followed as a copy (`_Copy`)."""

    name = "ngram"
    prior = 0.5
    watch_first = True

    def __init__(self, min_n: int = 2, max_n: int = 4) -> None:
        self.min_n, self.max_n = min_n, max_n

    def propose(self, sequence: Sequence, k: int) -> list[int]:
        tokens = sequence.tokens
        copier = sequence.copiers.get(self.name)
        if copier is None:
            copier = sequence.copiers[self.name] = _Copier(_NgramIndex(self.min_n, self.max_n))
        copier.index.update(tokens)
        if k <= 0 or not (copier.follow(tokens) or copier.find(tokens, tokens[-self.max_n :], len(tokens))):
            return []
        return copier.draft(k)


class PredictionDrafter:
    """The client's predicted output, followed as a copy (`_Copy`) from its start, and picked up
    again by n-gram after the output departs from it."""

    name = "prediction"
    prior = 0.8
    watch_first = False

    def __init__(self, min_n: int = 1, max_n: int = 6) -> None:
        self.min_n, self.max_n = min_n, max_n

    def propose(self, sequence: Sequence, k: int) -> list[int]:
        predicted = sequence.prediction
        if not predicted or k <= 0:
            return []
        tokens, n_out = sequence.tokens, len(sequence.tokens) - sequence.prompt_len
        copier = sequence.copiers.get(self.name)
        if copier is None:
            copier = sequence.copiers[self.name] = _Copier(_NgramIndex(self.min_n, self.max_n))
            copier.index.update([*predicted, END])  # every gram of the prediction, its last one too
            copier.copy = _Copy(predicted, 0, sequence.prompt_len, MIN_RUN)  # the output starts as predicted
        tail = tokens[len(tokens) - min(n_out, self.max_n) :]  # the output's tail, uncopied
        if not (copier.follow(tokens) or (tail and copier.find(predicted, tail, len(tokens)))):
            return []
        return copier.draft(k)


class TreeDrafter:
    """The continuation the prefix cache's page tree stores after this sequence's tokens: whole pages
    of earlier requests, following the most reused child where requests went different ways."""

    name = "tree"
    prior = 0.7
    watch_first = False

    def __init__(self, tree: PageTree) -> None:
        self.tree = tree

    def propose(self, sequence: Sequence, k: int) -> list[int]:
        return self.tree.continuation(PrefixKey(sequence.namespace, sequence.tokens), k) if k > 0 else []


class RecentDrafter:
    """N-grams of recent answers, each namespace's apart, followed as a copy (`_Copy`): where an
    output's last tokens occurred in an earlier answer, what came after them there.

    Invariants: a sequence drafts only from its own namespace's pool (another tenant's or salt's
    text is never drafted); a pool holds at most `max_tokens` tokens (the older half dropped when
    full), and at most `max_namespaces` pools are kept (the least recently added to dropped)."""

    name = "recent"
    prior = 0.5
    watch_first = True

    def __init__(self, min_n: int = 3, max_n: int = 4, max_tokens: int = 8192, max_namespaces: int = 16) -> None:
        self.min_n, self.max_n = min_n, max_n
        self.max_tokens, self.max_namespaces = max_tokens, max_namespaces
        self.pools: OrderedDict[str, _NgramPool] = OrderedDict()

    def add(self, namespace: str, tokens: list[int], prompt_len: int) -> None:
        """A finished sequence's answer, after the prompt's last tokens that lead into it."""
        if len(tokens) <= prompt_len:
            return
        answer = tokens[max(0, prompt_len - self.max_n) :]
        pool = self.pools.pop(namespace, None) or _NgramPool(self.min_n, self.max_n)
        self.pools[namespace] = pool
        pool.add(answer[-self.max_tokens // 2 :], self.max_tokens)
        while len(self.pools) > self.max_namespaces:
            self.pools.popitem(last=False)

    def propose(self, sequence: Sequence, k: int) -> list[int]:
        pool = self.pools.get(sequence.namespace)
        if pool is None or k <= 0:
            return []
        copier = sequence.copiers.get(self.name)
        if copier is None or copier.index is not pool.index:  # new, or the pool dropped its older half
            copier = sequence.copiers[self.name] = _Copier(pool.index)
        tokens = sequence.tokens
        if not (copier.follow(tokens) or copier.find(pool.tokens, tokens[-self.max_n :], len(tokens))):
            return []
        return copier.draft(k)


@dataclass(eq=False)
class _NgramPool:
    """Answers one after another, each ended by `END`, and the index of their n-grams."""

    min_n: int
    max_n: int
    tokens: list[int] = field(default_factory=list)
    index: _NgramIndex = field(init=False)

    def __post_init__(self) -> None:
        self.index = _NgramIndex(self.min_n, self.max_n)

    def add(self, answer: list[int], max_tokens: int) -> None:
        if len(self.tokens) + len(answer) + 1 > max_tokens:
            self.tokens = self.tokens[len(self.tokens) // 2 :]
            self.tokens = self.tokens[self.tokens.index(END) + 1 :] if END in self.tokens else []
            self.index = _NgramIndex(self.min_n, self.max_n)
        self.tokens.extend([*answer, END])
        self.index.update(self.tokens)

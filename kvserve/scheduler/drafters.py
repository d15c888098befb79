"""Drafters: guesses of a sequence's next tokens, which the target verifies in its ordinary step.

Every drafter answers `propose(sequence, k)` with at most `k` tokens that it guesses follow the
sequence's tokens (prompt and output so far); an empty list is no guess. A drafter never touches a
llama context: it reads tokens, so a wrong guess costs only the rows the step verifies in vain.

- `NgramDrafter` ("prompt lookup decoding"): the tokens that followed the latest earlier occurrence
  of the sequence's last n tokens (n from `max_n` down to `min_n`), in its own prompt and output;
- `PredictionDrafter`: OpenAI's Predicted Outputs: the client's `prediction` text, followed where the
  output copies it and picked up again by n-gram after the output departs from it;
- `TreeDrafter`: what followed this very context in earlier requests of the same cache namespace,
  as the prefix cache's radix tree of KV pages stores it (an agent re-sending a step, a regenerated
  answer); another tenant's or salt's text is never drafted, as it is never attached.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from kvserve.cache.page_tree import PageTree
from kvserve.cache.prefix_key import PrefixKey


@dataclass(eq=False)
class Sequence:
    """What a drafter reads of one choice: its tokens (prompt then output) and the request's
    predicted output, tokenized. Drafters keep their per-sequence indexes here."""

    tokens: list[int]
    prompt_len: int
    prediction: list[int] = field(default_factory=list)
    namespace: str = ""  # whose earlier requests the prefix tree may draft from
    seq: int = -1  # the stream it runs in this step (a draft model drafts in its stream of that id)
    indexes: dict[str, "_NgramIndex"] = field(default_factory=dict)


class Drafter(Protocol):
    name: str

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

    def lookup(self, suffix: list[int]) -> int | None:
        """Where the continuation of the longest indexed tail of `suffix` starts, if any."""
        for n in range(min(self.max_n, len(suffix)), self.min_n - 1, -1):
            at = self.after.get(tuple(suffix[len(suffix) - n :]))
            if at is not None:
                return at
        return None


class NgramDrafter:
    """Prompt lookup over the sequence's own tokens."""

    name = "ngram"

    def __init__(self, min_n: int = 2, max_n: int = 4) -> None:
        self.min_n, self.max_n = min_n, max_n

    def propose(self, sequence: Sequence, k: int) -> list[int]:
        tokens = sequence.tokens
        index = sequence.indexes.get(self.name)
        if index is None:
            index = sequence.indexes[self.name] = _NgramIndex(self.min_n, self.max_n)
        index.update(tokens)
        at = index.lookup(tokens[-self.max_n :])
        return [] if at is None or k <= 0 else tokens[at : at + k]


class PredictionDrafter:
    """The client's predicted output: its start while the output is empty, then the tokens after
    the latest place in it that ends like the output does."""

    name = "prediction"

    def __init__(self, min_n: int = 1, max_n: int = 6) -> None:
        self.min_n, self.max_n = min_n, max_n

    def propose(self, sequence: Sequence, k: int) -> list[int]:
        predicted = sequence.prediction
        if not predicted or k <= 0:
            return []
        tokens, n_out = sequence.tokens, len(sequence.tokens) - sequence.prompt_len
        if not n_out:
            return predicted[:k]
        index = sequence.indexes.get(self.name)
        if index is None:
            index = sequence.indexes[self.name] = _NgramIndex(self.min_n, self.max_n)
            index.update(predicted + [-1])  # every gram of the prediction, its last one too
        at = index.lookup(tokens[len(tokens) - min(n_out, self.max_n) :])  # the output's tail, uncopied
        return [] if at is None else predicted[at : at + k]


class TreeDrafter:
    """The continuation the prefix cache's page tree stores after this sequence's tokens: whole pages
    of earlier requests, following the most reused child where requests went different ways."""

    name = "tree"

    def __init__(self, tree: PageTree) -> None:
        self.tree = tree

    def propose(self, sequence: Sequence, k: int) -> list[int]:
        return self.tree.continuation(PrefixKey(sequence.namespace, sequence.tokens), k) if k > 0 else []

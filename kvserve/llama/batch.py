"""A reusable `llama_batch` (one sequence id per token, filled afresh every engine step), and how
`llama_decode` splits a batch into ubatches."""

from __future__ import annotations

from typing import Iterable

import llama_cpp


class Batch:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._raw = llama_cpp.llama_batch_init(capacity, 0, 1)
        self.n_tokens = 0

    @property
    def raw(self) -> llama_cpp.llama_batch:
        self._raw.n_tokens = self.n_tokens
        return self._raw

    def clear(self) -> None:
        self.n_tokens = 0

    def add(self, token: int, pos: int, seq: int, wants_logits: bool) -> int:
        """Append one token; returns its batch index (the index its logits are read by)."""
        i = self.n_tokens
        if i >= self.capacity:
            raise ValueError("batch is full")
        raw = self._raw
        raw.token[i] = token
        raw.pos[i] = pos
        raw.n_seq_id[i] = 1
        raw.seq_id[i][0] = seq
        raw.logits[i] = wants_logits
        self.n_tokens = i + 1
        return i

    def close(self) -> None:
        if self.capacity:
            llama_cpp.llama_batch_free(self._raw)
            self.capacity = 0


def ubatch_sizes(counts: Iterable[tuple[int, int]], n_ubatch: int) -> list[int]:
    """The tokens of each ubatch that `llama_decode` splits a batch into, on a context with a stream
    per sequence (`kv_unified` off), for a batch of `counts` (sequence id, its tokens), each
    sequence's tokens together and the sequences in id order; each ubatch reads every weight again.

    llama.cpp's `split_equal` (sequential): a ubatch takes a run of sequences whose ids follow one
    another, from the first with tokens left, and the same number of tokens from each: as many as
    the one with fewest left has, at most `n_ubatch` in all (at least one each). So sequences of
    1 token and one of 1 + k decode in two ubatches, and a gap in the ids starts another."""
    left = sorted([seq, n] for seq, n in counts if n > 0)
    sizes = []
    while left:
        run = 1
        while run < len(left) and left[run][0] == left[run - 1][0] + 1:
            run += 1
        take = min(min(n for _, n in left[:run]), max(1, n_ubatch // run))
        sizes.append(take * run)
        for item in left[:run]:
            item[1] -= take
        left = [item for item in left if item[1] > 0]
    return sizes

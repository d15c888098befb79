"""A reusable `llama_batch`: one sequence id per token, filled afresh every engine step."""

from __future__ import annotations

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

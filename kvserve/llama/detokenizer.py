"""Incremental detokenization that never splits a UTF-8 character across chunks."""

from __future__ import annotations

import codecs

from kvserve.llama.model import Model


class Detokenizer:
    """Feeds token bytes through an incremental UTF-8 decoder: an incomplete character waits for its rest."""

    def __init__(self, model: Model, *, special: bool = False) -> None:
        self._model = model
        self._special = special  # spell out special tokens instead of dropping them
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, token: int) -> str:
        return self._decoder.decode(self._model.piece(token, special=self._special))

    def flush(self) -> str:
        """What is left at the end of the stream (a dangling partial character becomes U+FFFD)."""
        return self._decoder.decode(b"", final=True)

"""A loaded GGUF model: weights, vocabulary, metadata and tokenization."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from pathlib import Path

import llama_cpp

from kvserve.llama.backend import ensure_backend


class ModelLoadError(RuntimeError):
    """The GGUF file could not be loaded."""


@dataclass(frozen=True)
class ModelInfo:
    path: str
    n_ctx_train: int
    n_vocab: int
    is_recurrent: bool
    is_hybrid: bool

    @property
    def carries_state(self) -> bool:
        """True when KV pages alone cannot restore a prefix (Mamba, LFM2, hybrids)."""
        return self.is_recurrent or self.is_hybrid


class Model:
    """Owns a `llama_model`. Tokenization is thread-safe in llama.cpp, so any thread may call it."""

    def __init__(self, path: str | Path) -> None:
        path = Path(path)
        if not path.is_file():
            raise ModelLoadError(f"model file not found: {path}")
        ensure_backend()
        params = llama_cpp.llama_model_default_params()
        self._ptr = llama_cpp.llama_model_load_from_file(str(path).encode(), params)
        if not self._ptr:
            raise ModelLoadError(f"llama.cpp could not load {path}")
        self._vocab = llama_cpp.llama_model_get_vocab(self._ptr)
        self.info = ModelInfo(
            path=str(path),
            n_ctx_train=llama_cpp.llama_model_n_ctx_train(self._ptr),
            n_vocab=llama_cpp.llama_vocab_n_tokens(self._vocab),
            is_recurrent=bool(llama_cpp.llama_model_is_recurrent(self._ptr)),
            is_hybrid=bool(llama_cpp.llama_model_is_hybrid(self._ptr)),
        )
        self.bos = llama_cpp.llama_vocab_bos(self._vocab)
        self.eos = llama_cpp.llama_vocab_eos(self._vocab)
        self.adds_bos = bool(llama_cpp.llama_vocab_get_add_bos(self._vocab))

    @property
    def ptr(self) -> llama_cpp.llama_model_p:
        return self._ptr

    @property
    def vocab(self) -> llama_cpp.llama_vocab_p:
        return self._vocab

    def close(self) -> None:
        if self._ptr:
            llama_cpp.llama_model_free(self._ptr)
            self._ptr = None

    def tokenize(self, text: str, *, add_special: bool, parse_special: bool = True) -> list[int]:
        """Tokens of `text`; `add_special` adds BOS where the model wants it."""
        data = text.encode("utf-8")
        capacity = len(data) + 8
        buf = (llama_cpp.llama_token * capacity)()
        n = llama_cpp.llama_tokenize(self._vocab, data, len(data), buf, capacity, add_special, parse_special)
        if n < 0:  # the buffer was too small: -n is the size needed
            capacity = -n
            buf = (llama_cpp.llama_token * capacity)()
            n = llama_cpp.llama_tokenize(self._vocab, data, len(data), buf, capacity, add_special, parse_special)
        return list(buf[:n])

    def piece(self, token: int, *, special: bool = False) -> bytes:
        """The raw bytes of one token; may be part of a UTF-8 character."""
        buf = ctypes.create_string_buffer(64)
        n = llama_cpp.llama_token_to_piece(self._vocab, token, buf, len(buf), 0, special)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = llama_cpp.llama_token_to_piece(self._vocab, token, buf, len(buf), 0, special)
        return buf.raw[:n]

    def detokenize(self, tokens: list[int], *, special: bool = False) -> str:
        """The text of `tokens`; `special` spells out control tokens (<|im_start|>) instead of dropping them."""
        return b"".join(self.piece(t, special=special) for t in tokens).decode("utf-8", errors="replace")

    def is_eog(self, token: int) -> bool:
        return bool(llama_cpp.llama_vocab_is_eog(self._vocab, token))

    def token_text(self, token: int) -> str:
        """The vocabulary entry itself (special tokens spelled out), for logprobs."""
        return self.piece(token, special=True).decode("utf-8", errors="replace")

    def metadata(self, key: str) -> str | None:
        """A GGUF metadata value as text; None where the file lacks `key`."""
        buf = ctypes.create_string_buffer(256)
        n = llama_cpp.llama_model_meta_val_str(self._ptr, key.encode(), buf, len(buf))
        return buf.value.decode("utf-8", errors="replace") if n >= 0 else None

    def chat_template(self) -> str | None:
        raw = llama_cpp.llama_model_chat_template(self._ptr, None)
        return raw.decode("utf-8") if raw else None

"""A loaded GGUF model: weights, vocabulary, metadata and tokenization."""

from __future__ import annotations

import ctypes
import hashlib
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import llama_cpp
import xxhash

from kvserve.llama.backend import ensure_backend
from kvserve.llama.special_cuts import SpecialCuts

_SPECIAL = (llama_cpp.LLAMA_TOKEN_ATTR_CONTROL | llama_cpp.LLAMA_TOKEN_ATTR_USER_DEFINED
            | llama_cpp.LLAMA_TOKEN_ATTR_UNKNOWN)  # the tokens llama.cpp splits texts on
# Vocabularies whose `add_special` means exactly BOS first (if wanted) and EOS last (if wanted),
# and whose fragments tokenize independently (read and tested: SentencePiece, BPE).
_BOS_EOS_TYPES = (llama_cpp.LLAMA_VOCAB_TYPE_SPM, llama_cpp.LLAMA_VOCAB_TYPE_BPE)


_DIGEST_CHUNK = 8 << 20
_DIGESTS: dict[tuple[str, int, int, int], str] = {}  # by the file's path, inode, size and mtime


def file_digest(path: str | Path) -> str:
    """XXH3-128 of a file's bytes, with its size: read once per process for each version of the file
    (path, inode, size and mtime), about 0.1 s a GB from the page cache."""
    resolved = Path(path).resolve()
    st = resolved.stat()
    version = (str(resolved), st.st_ino, st.st_size, st.st_mtime_ns)
    if version not in _DIGESTS:
        digest = xxhash.xxh3_128()
        view = memoryview(bytearray(_DIGEST_CHUNK))
        with open(resolved, "rb", buffering=0) as file:
            while n := file.readinto(view):
                digest.update(view[:n])
        _DIGESTS[version] = f"{st.st_size}:{digest.hexdigest()}"
    return _DIGESTS[version]


class ModelLoadError(RuntimeError):
    """The GGUF file could not be loaded."""


@dataclass(frozen=True)
class ModelInfo:
    path: str
    n_ctx_train: int
    n_vocab: int
    is_recurrent: bool
    is_hybrid: bool
    n_swa: int = 0  # the sliding window of its SWA layers, in positions (0: none)
    embedding_only: bool = False  # an embedder, not a generator: see `_embedding_only`
    size_bytes: int = 0  # the weights, as llama.cpp counts them

    @property
    def carries_state(self) -> bool:
        """True when KV pages alone cannot restore a prefix (Mamba, LFM2, hybrids)."""
        return self.is_recurrent or self.is_hybrid

    @property
    def keeps_at_marks(self) -> bool:
        """True when a prefix is cached only where the prefill stops (a recurrent state, or a sliding
        window's rows, which a sequence keeps only for its last positions): chat prompts carry marks."""
        return self.carries_state or self.n_swa > 0


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
            n_swa=int(llama_cpp.llama_model_n_swa(self._ptr)),
            embedding_only=_embedding_only(self._ptr),
            size_bytes=int(llama_cpp.llama_model_size(self._ptr)),
        )
        self.bos = llama_cpp.llama_vocab_bos(self._vocab)
        self.eos = llama_cpp.llama_vocab_eos(self._vocab)
        self.adds_bos = bool(llama_cpp.llama_vocab_get_add_bos(self._vocab))
        self.adds_eos = bool(llama_cpp.llama_vocab_get_add_eos(self._vocab))

    @cached_property
    def fingerprint(self) -> str:
        """A digest of the file as llama.cpp loaded it: all its bytes (`file_digest`) and llama.cpp's
        description of the model. The same file gives the same one in every process; two files that
        differ in any byte (a model edited in its middle layers only) give two."""
        digest = hashlib.sha256()
        digest.update(f"{file_digest(self.info.path)}\0{self.info.size_bytes}\0{self.info.n_vocab}\0".encode())
        desc = ctypes.create_string_buffer(256)
        llama_cpp.llama_model_desc(self._ptr, desc, len(desc))
        digest.update(desc.value)
        return digest.hexdigest()

    @cached_property
    def _cuts(self) -> SpecialCuts | None:
        """Where texts may be cut for tokenizing (see special_cuts), read from the vocabulary on first
        use; None where it has no special tokens or a type whose `add_special` is not plain BOS/EOS."""
        if llama_cpp.llama_vocab_type(self._vocab) not in _BOS_EOS_TYPES:
            return None
        specials = []
        for token in range(self.info.n_vocab):
            attr = llama_cpp.llama_vocab_get_attr(self._vocab, token)
            if attr & _SPECIAL:
                lstrip, rstrip = attr & llama_cpp.LLAMA_TOKEN_ATTR_LSTRIP, attr & llama_cpp.LLAMA_TOKEN_ATTR_RSTRIP
                specials.append((llama_cpp.llama_vocab_get_text(self._vocab, token), bool(lstrip), bool(rstrip)))
        return SpecialCuts.of(specials)

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
        """Tokens of `text`, identical to one `llama_tokenize` call; `add_special` adds BOS where the
        model wants it. With `parse_special`, a text holding many special spellings is tokenized in
        pieces cut where llama.cpp's result cannot change (special_cuts): its own splitting is
        quadratic in their count. Raises TooManySpecialTokens for a text no cut can divide."""
        data = text.encode("utf-8")
        if not parse_special or self._cuts is None:
            return self._tokenize(data, add_special, parse_special)
        pieces = list(self._cuts.pieces(data))
        if len(pieces) <= 1:
            return self._tokenize(data, add_special, True)
        tokens = [self.bos] if add_special and self.adds_bos else []
        seen: dict[bytes, list[int]] = {}
        for piece in pieces:
            if piece not in seen:
                seen[piece] = self._tokenize(piece, False, True)
            tokens += seen[piece]
        return tokens + [self.eos] if add_special and self.adds_eos else tokens

    def _tokenize(self, data: bytes, add_special: bool, parse_special: bool) -> list[int]:
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

    def is_one_token(self, text: str) -> bool:
        """The vocabulary spells `text` as one token."""
        return len(self.tokenize(text, add_special=False, parse_special=True)) == 1

    def is_eog(self, token: int) -> bool:
        return bool(llama_cpp.llama_vocab_is_eog(self._vocab, token))

    def token_text(self, token: int) -> str:
        """The vocabulary entry itself (special tokens spelled out), for logprobs."""
        return self.piece(token, special=True).decode("utf-8", errors="replace")

    def metadata(self, key: str) -> str | None:
        """A GGUF metadata value as text; None where the file lacks `key`."""
        return _metadata(self._ptr, key)

    def vocab_mismatch(self, other: "Model", samples: int = 512) -> str | None:
        """How `other`'s vocabulary differs from this one's, or None where they agree on the size,
        BOS, EOS and the text of every special token (of either) and of `samples` tokens spread over the range
        (a draft model's guesses are token ids of the target's vocabulary)."""
        n = self.info.n_vocab
        if other.info.n_vocab != n:
            return f"{other.info.n_vocab} tokens, the model has {n}"
        if (other.bos, other.eos) != (self.bos, self.eos):
            return f"BOS/EOS {other.bos}/{other.eos}, the model's are {self.bos}/{self.eos}"
        specials = {t for t in range(n) for vocab in (self._vocab, other._vocab)
                    if llama_cpp.llama_vocab_get_attr(vocab, t) & _SPECIAL}
        for token in sorted(specials | set(range(0, n, max(1, n // samples))) | {n - 1}):
            if other.token_text(token) != self.token_text(token):
                return f"token {token} is {other.token_text(token)!r}, the model's is {self.token_text(token)!r}"
        return None

    def chat_template(self) -> str | None:
        raw = llama_cpp.llama_model_chat_template(self._ptr, None)
        return raw.decode("utf-8") if raw else None


def _metadata(ptr: llama_cpp.llama_model_p, key: str) -> str | None:
    buf = ctypes.create_string_buffer(256)
    n = llama_cpp.llama_model_meta_val_str(ptr, key.encode(), buf, len(buf))
    return buf.value.decode("utf-8", errors="replace") if n >= 0 else None


def _embedding_only(ptr: llama_cpp.llama_model_p) -> bool:
    """An encoder without a decoder, a model whose attention is not causal (BERT, nomic-bert: its
    GGUF says `<arch>.attention.causal = false`), or a reranker (pooling type rank): it embeds or
    scores, it does not generate."""
    if llama_cpp.llama_model_has_encoder(ptr) and not llama_cpp.llama_model_has_decoder(ptr):
        return True
    arch = _metadata(ptr, "general.architecture") or ""
    return (_metadata(ptr, f"{arch}.attention.causal") == "false"
            or _metadata(ptr, f"{arch}.pooling_type") == str(llama_cpp.LLAMA_POOLING_TYPE_RANK))


def peek_kind(path: str | Path) -> str | None:
    """`chat` or `embedding`, read from a GGUF with its vocabulary only (a fraction of a second, no
    weights); None where llama.cpp cannot read the file."""
    ensure_backend()
    params = llama_cpp.llama_model_default_params()
    params.vocab_only = True
    ptr = llama_cpp.llama_model_load_from_file(str(path).encode(), params)
    if not ptr:
        return None
    try:
        return "embedding" if _embedding_only(ptr) else "chat"
    finally:
        llama_cpp.llama_model_free(ptr)

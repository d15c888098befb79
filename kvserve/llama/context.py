"""One llama.cpp context with a unified KV cache. Not thread-safe: one thread makes every call."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Literal

import llama_cpp
import numpy as np

from kvserve.llama.backend import log_lines
from kvserve.llama.batch import Batch
from kvserve.llama.model import Model

# llama.cpp's hard limit on sequence ids in one context (LLAMA_MAX_SEQ).
MAX_SEQUENCES = 256


class DecodeError(RuntimeError):
    """llama_decode rejected a batch; the KV cache is unchanged."""

    def __init__(self, code: int) -> None:
        super().__init__(f"llama_decode returned {code}")
        self.code = code


class NoKvSlot(DecodeError):
    """llama_decode found no room for the batch (code 1): free cells and retry."""


FlashAttn = Literal["on", "off", "auto"]
# From this many tokens in a ubatch, the CPU flash-attention kernel works in tiles of this many
# query rows by 64 cells (GGML_FA_TILE_Q in ggml-cpu/common.h) and skips a tile only where every row
# is masked; below it, each row skips masked cells on its own. So a batch of 64+ tokens that mixes
# sequences makes each shared tile attend, at full cost, over every cell of all its sequences.
FLASH_ATTENTION_TILE_ROWS = 64
_FLASH_ATTN_TYPES = {"on": llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED, "off": llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED,
                     "auto": llama_cpp.LLAMA_FLASH_ATTN_TYPE_AUTO}


@dataclass(frozen=True)
class ContextParams:
    n_ctx: int
    n_batch: int
    n_seq_max: int
    n_threads: int
    n_ubatch: int = 512
    flash_attn: FlashAttn = "auto"
    # one KV stream for all sequences; False (a stream per sequence, what llama-server runs) only
    # for bench/attention.py's comparison: the page cache needs cells that sequences share
    unified: bool = True
    # an embedding context: every token is output and pooled per sequence by `pooling` (a
    # LLAMA_POOLING_TYPE_*); a sequence must then fit in one ubatch, since llama.cpp pools per ubatch
    embeddings: bool = False
    pooling: int = llama_cpp.LLAMA_POOLING_TYPE_UNSPECIFIED


class Context:
    """Owns a `llama_context` and its memory. Sequence ids are `0 .. n_seq_max-1`."""

    def __init__(self, model: Model, params: ContextParams) -> None:
        if not 1 <= params.n_seq_max <= MAX_SEQUENCES:
            raise ValueError(f"n_seq_max must be in 1..{MAX_SEQUENCES}")
        if params.n_batch < params.n_seq_max:
            raise ValueError("n_batch must be >= n_seq_max (llama.cpp aborts otherwise)")
        cparams = llama_cpp.llama_context_default_params()
        cparams.n_ctx = params.n_ctx
        cparams.n_batch = params.n_batch
        cparams.n_ubatch = min(params.n_ubatch, params.n_batch)
        cparams.n_seq_max = params.n_seq_max
        cparams.n_threads = params.n_threads
        cparams.n_threads_batch = params.n_threads
        cparams.kv_unified = params.unified  # shared cells are what makes zero-copy prefix attach possible
        # In a unified cache every token's attention spans all used cells, masked per sequence. The
        # CPU flash-attention kernel skips masked cells (and whole masked tiles), though it still reads
        # each cell's mask; plain attention computes them all, so flash attention is what makes one
        # shared cache affordable (bench/attention.py: 1.2-1.3x a stream per sequence). Its price: it
        # rounds differently by batch shape (tiled for many queries, one-query path for decodes).
        cparams.flash_attn_type = _FLASH_ATTN_TYPES[params.flash_attn]
        cparams.no_perf = True
        cparams.embeddings = params.embeddings
        cparams.pooling_type = params.pooling
        self.model = model
        self.params = params
        with log_lines() as said:
            self._ptr = llama_cpp.llama_init_from_model(model.ptr, cparams)
        if not self._ptr:
            raise RuntimeError("llama.cpp could not create a context")
        # Under `auto` llama.cpp decides by device and says so only in its log.
        self.flash_attn = params.flash_attn == "on" or (
            params.flash_attn == "auto" and any("Flash Attention enabled" in line for line in said))
        self.attention_tile_rows = FLASH_ATTENTION_TILE_ROWS if self.flash_attn else None
        self._mem = llama_cpp.llama_get_memory(self._ptr)
        self.n_ctx = llama_cpp.llama_n_ctx(self._ptr)
        self.n_batch = llama_cpp.llama_n_batch(self._ptr)
        self.n_seq_max = llama_cpp.llama_n_seq_max(self._ptr)
        self._n_vocab = model.info.n_vocab

    @property
    def ptr(self) -> llama_cpp.llama_context_p:
        return self._ptr

    def close(self) -> None:
        if self._ptr:
            llama_cpp.llama_free(self._ptr)
            self._ptr = None

    # -- decoding -------------------------------------------------------------------------------

    def decode(self, batch: Batch) -> None:
        """Run one batch. Raises NoKvSlot (retryable) or DecodeError; the cache is unchanged then."""
        if batch.n_tokens > self.n_batch:
            raise ValueError(f"batch of {batch.n_tokens} tokens exceeds n_batch {self.n_batch}")
        code = llama_cpp.llama_decode(self._ptr, batch.raw)
        if code == 1:
            raise NoKvSlot(code)
        if code != 0:
            raise DecodeError(code)

    def logits(self, index: int) -> np.ndarray:
        """A view of the logits of batch entry `index` (valid until the next decode)."""
        ptr = llama_cpp.llama_get_logits_ith(self._ptr, index)
        return np.ctypeslib.as_array(ptr, shape=(self._n_vocab,))

    def seq_embedding(self, seq: int) -> np.ndarray:
        """A copy of the pooled embedding of `seq` from the last decode (an embedding context's)."""
        ptr = llama_cpp.llama_get_embeddings_seq(self._ptr, seq)
        if not ptr:
            raise RuntimeError(f"llama.cpp has no pooled embedding for sequence {seq}")
        return np.ctypeslib.as_array(ptr, shape=(llama_cpp.llama_model_n_embd_out(self.model.ptr),)).copy()

    # -- memory: sequences in the unified KV cache -------------------------------------------------

    def seq_rm(self, seq: int, p0: int = -1, p1: int = -1) -> bool:
        """Forget positions [p0, p1) of `seq`; False when a recurrent state would be cut."""
        return bool(llama_cpp.llama_memory_seq_rm(self._mem, seq, p0, p1))

    def seq_cp(self, src: int, dst: int, p0: int = -1, p1: int = -1) -> None:
        """Let `dst` share the cells of `src` in [p0, p1): no data is copied."""
        llama_cpp.llama_memory_seq_cp(self._mem, src, dst, p0, p1)

    def clear(self) -> None:
        """Forget every sequence."""
        llama_cpp.llama_memory_clear(self._mem, True)

    def seq_pos_max(self, seq: int) -> int:
        """The largest position `seq` has, or -1 when it is empty."""
        return llama_cpp.llama_memory_seq_pos_max(self._mem, seq)

    def seq_pos_min(self, seq: int) -> int:
        return llama_cpp.llama_memory_seq_pos_min(self._mem, seq)

    # -- state: the recurrent part of a sequence --------------------------------------------------

    def state_flags(self) -> int:
        """Hybrids save only their recurrent part (their KV stays in pages); recurrent models save all."""
        if self.model.info.is_hybrid:
            return llama_cpp.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY
        return 0

    def state_size(self, seq: int) -> int:
        return llama_cpp.llama_state_seq_get_size_ext(self._ptr, seq, self.state_flags())

    def save_state(self, seq: int) -> bytes:
        return self.read_seq_state(seq, self.state_flags()).tobytes()

    def load_state(self, seq: int, blob: bytes) -> None:
        self.write_seq_state(seq, blob, self.state_flags())

    # -- state: a sequence's memory as llama.cpp serializes it (kvserve.llama.seq_state reads it) -----

    def read_seq_state(self, seq: int, flags: int = 0) -> np.ndarray:
        """`seq`'s state blob (`flags`: llama_state_seq_flags), in a buffer of its own."""
        size = llama_cpp.llama_state_seq_get_size_ext(self._ptr, seq, flags)
        buf = np.empty(size, dtype=np.uint8)
        written = llama_cpp.llama_state_seq_get_data_ext(self._ptr, _u8_pointer(buf), size, seq, flags)
        if written != size:
            raise RuntimeError(f"llama.cpp wrote {written} of {size} state bytes for seq {seq}")
        return buf

    def write_seq_state(self, seq: int, blob: np.ndarray | bytes, flags: int = 0) -> None:
        """Replace `seq`'s memory with `blob`. Raises when llama.cpp refuses it (`seq` is empty then)."""
        buf = np.frombuffer(blob, dtype=np.uint8)
        read = llama_cpp.llama_state_seq_set_data_ext(self._ptr, _u8_pointer(buf), buf.size, seq, flags)
        if read != buf.size:
            raise RuntimeError(f"llama.cpp restored {read} of {buf.size} state bytes for seq {seq}")


def _u8_pointer(buf: np.ndarray) -> "ctypes._Pointer[ctypes.c_uint8]":
    return buf.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8))

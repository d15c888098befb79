"""One llama.cpp context with a KV stream per sequence. Not thread-safe: one thread makes every call.

Sequence id i lives in stream i, of `n_ctx_seq` cells: a token's attention reads only its own
sequence's cells, and llama.cpp splits a batch over the streams itself. Rows move between streams
only as whole streams (`seq_cp`) or as per-sequence state (`save_state` / `load_state`).
"""

from __future__ import annotations

import contextlib
import ctypes
import re
import time
from dataclasses import dataclass
from typing import Callable, Iterator, Literal

import llama_cpp
import numpy as np

from kvserve.llama.backend import log_lines, quiet
from kvserve.llama.batch import Batch
from kvserve.llama.kv_types import KV_TYPES, KvType
from kvserve.llama.model import Model

# llama.cpp's hard limit on sequence ids in one context (LLAMA_MAX_SEQ).
MAX_SEQUENCES = 256
# llama_decode's code for a decode its abort callback stopped (its ubatch's rows removed again)
ABORTED = 2
_NO_ABORT = ctypes.cast(None, llama_cpp.ggml_abort_callback)


class DecodeError(RuntimeError):
    """llama_decode rejected a batch; the KV cache is unchanged."""

    def __init__(self, code: int) -> None:
        super().__init__(f"llama_decode returned {code}")
        self.code = code


class NoKvSlot(DecodeError):
    """llama_decode found no room for the batch (code 1): free cells and retry."""


FlashAttn = Literal["on", "off", "auto"]
# how llama.cpp reports each KV (attention) and RS (recurrent state) buffer it allocates
_BUFFER_SIZE = re.compile(r"(?:KV|RS) buffer size =\s*([\d.]+) MiB")
_ANY_BUFFER_SIZE = re.compile(r"(?:KV|RS|compute|output) buffer size =\s*([\d.]+) MiB")
_FLASH_ATTN_TYPES = {"on": llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED, "off": llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED,
                     "auto": llama_cpp.LLAMA_FLASH_ATTN_TYPE_AUTO}


@dataclass(frozen=True)
class ContextParams:
    n_ctx_seq: int  # cells of each sequence's stream: the longest a sequence may grow
    n_batch: int
    n_seq_max: int  # sequences, one stream each
    n_threads: int
    n_ubatch: int = 512
    flash_attn: FlashAttn = "auto"
    # one stream shared by every sequence: only for bench/attention.py's comparison, and contexts
    # whose sequences live only for one batch (embeddings, the flash-attention probe)
    unified: bool = False
    # an embedding context: every token is output and pooled per sequence by `pooling` (a
    # LLAMA_POOLING_TYPE_*); a sequence must then fit in one ubatch, since llama.cpp pools per ubatch
    embeddings: bool = False
    pooling: int = llama_cpp.LLAMA_POOLING_TYPE_UNSPECIFIED
    type_k: KvType = "f16"  # how each K row is stored (and serialized into state blobs)
    type_v: KvType = "f16"  # quantized V needs flash attention: llama.cpp refuses the context otherwise
    # a sliding-window cache as large as the full one (llama.cpp's default): a cell out of its
    # sequence's window is overwritten only when the stream has no free cell first; False keeps
    # n_swa + n_ubatch cells, as llama-server does
    swa_full: bool = True

    @property
    def n_ctx(self) -> int:
        """llama.cpp's n_ctx: every stream's cells together."""
        return self.n_ctx_seq * (1 if self.unified else self.n_seq_max)


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
        cparams.kv_unified = params.unified
        # Flash attention rounds differently by batch shape (tiled for many queries, one-query path
        # for decodes); `off` does not, but the quantized matmuls still round by ubatch shape.
        cparams.flash_attn_type = _FLASH_ATTN_TYPES[params.flash_attn]
        cparams.no_perf = True
        cparams.embeddings = params.embeddings
        cparams.pooling_type = params.pooling
        cparams.type_k = KV_TYPES[params.type_k]
        cparams.type_v = KV_TYPES[params.type_v]
        cparams.swa_full = params.swa_full
        self.model = model
        self.params = params
        with log_lines() as said:
            self._ptr = llama_cpp.llama_init_from_model(model.ptr, cparams)
        if not self._ptr:
            raise RuntimeError("llama.cpp could not create a context")
        # Under `auto` llama.cpp decides (by device, or for a quantized V cache) and says so only in its log.
        self.flash_attn = params.flash_attn == "on" or (
            params.flash_attn == "auto" and any(_FLASH_ON.search(line) for line in said))
        # the memory of every stream, as llama.cpp allocated it (it reports it only in its log)
        self.kv_bytes = _mib_said(_BUFFER_SIZE, said)
        # and all it allocated: the KV (or recurrent state) cells, the compute and output buffers
        self.buffer_bytes = _mib_said(_ANY_BUFFER_SIZE, said)
        self._mem = llama_cpp.llama_get_memory(self._ptr)
        self.n_ctx = llama_cpp.llama_n_ctx(self._ptr)
        self.n_batch = llama_cpp.llama_n_batch(self._ptr)
        self.n_ubatch = llama_cpp.llama_n_ubatch(self._ptr)
        self.n_seq_max = llama_cpp.llama_n_seq_max(self._ptr)
        self.unified = params.unified
        self.n_ctx_seq = llama_cpp.llama_n_ctx_seq(self._ptr)  # padded to 256 by llama.cpp
        # a sliding-window cache keeps only the last window of a sequence: its rows cannot be cut back
        self.n_swa = llama_cpp.llama_model_n_swa(model.ptr)
        self._n_vocab = model.info.n_vocab

    @property
    def state_version(self) -> str:
        """Which format `read_seq_state` writes: llama.cpp's state version and the pinned library's."""
        return f"{llama_cpp.LLAMA_STATE_SEQ_VERSION}/{llama_cpp.__version__}"

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

    def time_ubatches(self, sizes: list[int], seq: int = 0, token: int = 0, again: int = 8, *,
                      stop: Callable[[], bool]) -> dict[int, float] | None:
        """Seconds one decode of `n` tokens (each with logits) in stream `seq` takes, for each n in
        `sizes` (after a warm-up decode), in stream `seq`, left empty; nothing where it holds rows.
        Sizes up to `again` are timed a second time after all the others, and the faster kept: one
        timing of a one-token decode right after loading came out 1.7x a served step's. `stop` is
        asked before each decode and while it runs (after each node of its graph): where it says so,
        the timing ends there and None comes back. A request that arrives meanwhile so waits for one
        node, not for a decode: a 64-token ubatch of a 1.5B took 1.28 s on 2 cores, and gave way
        29 ms after it was told to."""
        if self.seq_pos_max(seq) >= 0:
            return {}
        sizes = [n for n in sizes if 1 <= n <= min(self.n_ubatch, self.n_ctx_seq)]
        batch = Batch(max(sizes, default=1))
        seconds: dict[int, float] = {}
        try:
            with self._aborted_when(stop):
                for n in [1, *sizes, *(n for n in sizes if n <= again)]:
                    if stop():
                        return None
                    batch.clear()
                    for pos in range(n):
                        batch.add(token, pos, seq, True)
                    started = time.perf_counter()
                    try:
                        self.decode(batch)
                    except DecodeError as error:
                        if error.code == ABORTED:
                            return None
                        raise
                    took = time.perf_counter() - started
                    self.seq_rm(seq)
                    seconds[n] = min(took, seconds.get(n, took))
        finally:
            batch.close()
            self.seq_rm(seq)
        return {n: seconds[n] for n in sizes}

    @contextlib.contextmanager
    def _aborted_when(self, stop: Callable[[], bool]) -> Iterator[None]:
        """Decodes in the block end early where `stop` says so (DecodeError ABORTED); llama.cpp's
        report of each is logged at DEBUG. `stop` runs on this thread, a few hundred times a decode."""
        callback = llama_cpp.ggml_abort_callback(lambda _data: bool(stop()))
        llama_cpp.llama_set_abort_callback(self._ptr, callback, None)
        try:
            with quiet():
                yield
        finally:
            llama_cpp.llama_set_abort_callback(self._ptr, _NO_ABORT, None)

    def logits(self, index: int) -> np.ndarray:
        """A view of the logits of batch entry `index` (valid until the next decode)."""
        ptr = llama_cpp.llama_get_logits_ith(self._ptr, index)
        return np.ctypeslib.as_array(ptr, shape=(self._n_vocab,))

    def logit(self, index: int, token: int) -> float:
        """The logit of `token` in batch entry `index`: one float read, no array built."""
        return llama_cpp.llama_get_logits_ith(self._ptr, index)[token]

    def seq_embedding(self, seq: int) -> np.ndarray:
        """A copy of the pooled embedding of `seq` from the last decode (an embedding context's)."""
        ptr = llama_cpp.llama_get_embeddings_seq(self._ptr, seq)
        if not ptr:
            raise RuntimeError(f"llama.cpp has no pooled embedding for sequence {seq}")
        return np.ctypeslib.as_array(ptr, shape=(llama_cpp.llama_model_n_embd_out(self.model.ptr),)).copy()

    # -- memory: a stream per sequence ----------------------------------------------------------------

    def seq_rm(self, seq: int, p0: int = -1, p1: int = -1) -> bool:
        """Forget positions [p0, p1) of `seq`; False when a recurrent state would be cut."""
        return bool(llama_cpp.llama_memory_seq_rm(self._mem, seq, p0, p1))

    def set_threads(self, n: int) -> None:
        """Decode with `n` threads from the next call on (the engine thread's own pool of workers)."""
        llama_cpp.llama_set_n_threads(self._ptr, n, n)

    def clear(self) -> None:
        """Forget every sequence."""
        llama_cpp.llama_memory_clear(self._mem, True)

    def seq_pos_max(self, seq: int) -> int:
        """The largest position `seq` has, or -1 when it is empty."""
        return llama_cpp.llama_memory_seq_pos_max(self._mem, seq)

    def seq_pos_min(self, seq: int) -> int:
        return llama_cpp.llama_memory_seq_pos_min(self._mem, seq)

    # -- state: a sequence's memory as llama.cpp serializes it (kvserve.llama.seq_state reads it) -----

    def state_size(self, seq: int, flags: int = 0) -> int:
        return llama_cpp.llama_state_seq_get_size_ext(self._ptr, seq, flags)

    def read_seq_state(self, seq: int, flags: int = 0, buffer: Callable[[int], np.ndarray] | None = None) -> np.ndarray:
        """`seq`'s state blob (`flags`: llama_state_seq_flags; 0: its KV rows and any recurrent
        state), in a buffer of its own, or in `buffer(size)`'s."""
        size = self.state_size(seq, flags)
        buf = buffer(size) if buffer is not None else np.empty(size, dtype=np.uint8)
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

    def load_seq_file(self, seq: int, path: str, capacity: int) -> list[int] | None:
        """Replace `seq`'s memory with a sequence file's (`llama_state_seq_load_file`: read a layer at a
        time, straight into the cache): the tokens the file names, at most `capacity`, or None where
        llama.cpp refuses the file (`seq` is empty then)."""
        tokens = (llama_cpp.llama_token * capacity)()
        count = ctypes.c_size_t(0)
        read = llama_cpp.llama_state_seq_load_file(self._ptr, path.encode(), seq, tokens, capacity, ctypes.byref(count))
        if not read:
            self.seq_rm(seq)
            return None
        return tokens[: count.value]


# llama.cpp's log lines for flash attention turned on under `auto`
_FLASH_ON = re.compile(r"Flash Attention enabled|enabling flash_attn|flash_attn\s*=\s*enabled")


def _u8_pointer(buf: np.ndarray) -> "ctypes._Pointer[ctypes.c_uint8]":
    return buf.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8))


def _mib_said(pattern: re.Pattern[str], lines: list[str]) -> int:
    """The bytes of every buffer size `pattern` finds in llama.cpp's log `lines` (in MiB there)."""
    return int(sum(float(m.group(1)) for line in lines if (m := pattern.search(line))) * 2**20)

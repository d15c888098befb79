"""LoRA adapters: loaded once per model by name, applied to a whole context as an adapter set.

llama.cpp applies adapters to every sequence a `llama_decode` carries (`llama_set_adapters_lora`
sets them on the context), so one step runs under one adapter set and the scheduler groups
sequences by it.

Invariants:
- an adapter set is canonical: (name, scale) pairs sorted by name, no zero scale (llama.cpp drops
  zero-scale adapters, so scale 0 is the base model), no name twice; equal sets compare equal;
- the context's adapters change only through `LoraAdapters.apply`, which knows what is set and
  skips a call that would change nothing;
- a set's rows are named by its names and scales and by its files' bytes (`files`): a name that
  points at another file after a restart names other rows.
"""

from __future__ import annotations

import ctypes
import math
import re
from pathlib import Path
from typing import Iterable, Mapping

import llama_cpp

from kvserve.llama.backend import log_lines
from kvserve.llama.context import Context
from kvserve.llama.model import Model, file_digest

AdapterSet = tuple[tuple[str, float], ...]
# the lines of llama.cpp's log that say why an adapter did not load (it also dumps the file's metadata)
_FAILURE = re.compile(r"invalid|error|failed|mismatch|expect|incorrect|not found", re.IGNORECASE)
BASE: AdapterSet = ()


class AdapterLoadError(RuntimeError):
    """llama.cpp could not load an adapter file (or it does not fit the model)."""


def adapter_set(pairs: Iterable[tuple[str, float]]) -> AdapterSet:
    """The canonical set of (name, scale) pairs; a name given twice keeps its last scale."""
    scales: dict[str, float] = {}
    for name, scale in pairs:
        if not math.isfinite(scale):
            raise ValueError(f"adapter {name!r}: the scale must be finite")
        scales[name] = float(scale)
    return tuple(sorted((name, scale) for name, scale in scales.items() if scale != 0.0))


def describe(adapters: AdapterSet) -> str:
    """The set as one stable string ("" for the base model): what the cache namespace is built from."""
    return ",".join(f"{name}*{scale!r}" for name, scale in adapters)


class LoraAdapters:
    """The adapters of one model, by name, in the order given (a name's index is its llama-server id)."""

    def __init__(self, model: Model, paths: Mapping[str, Path]) -> None:
        self.model = model
        self._ptrs: dict[str, object] = {}
        self._digests: dict[str, str] = {}  # each adapter's file (`file_digest`), by name
        self._applied: dict[int, AdapterSet] = {}  # per context (by id): what is set now
        try:
            for name, path in paths.items():
                with log_lines() as said:
                    ptr = llama_cpp.llama_adapter_lora_init(model.ptr, str(path).encode())
                if not ptr:
                    why = "; ".join(line.split(": ", 1)[-1].strip() for line in said if _FAILURE.search(line))
                    raise AdapterLoadError(f"llama.cpp could not load the adapter {name!r} from {path}"
                                           + (f" ({why})" if why else ""))
                self._ptrs[name] = ptr
                self._digests[name] = file_digest(path)
        except AdapterLoadError:
            self.close()
            raise

    @property
    def names(self) -> list[str]:
        return list(self._ptrs)

    def files(self, adapters: AdapterSet) -> str:
        """The digests of the files behind `adapters`, in their order: with `describe`, what a cache
        namespace is built from, so a name given another file after a restart shares no rows."""
        return ",".join(self._digests[name] for name, _ in adapters)

    def apply(self, ctx: Context, adapters: AdapterSet) -> bool:
        """Set `adapters` on `ctx` for its next decodes; False when they were set already."""
        key = id(ctx)
        if self._applied.get(key, BASE) == adapters:
            return False
        n = len(adapters)
        ptrs = (llama_cpp.llama_adapter_lora_p_ctypes * n)(*(self._ptrs[name] for name, _ in adapters))
        scales = (ctypes.c_float * n)(*(scale for _, scale in adapters))
        llama_cpp.llama_set_adapters_lora(ctx.ptr, ptrs if n else None, n, scales if n else None)
        self._applied[key] = adapters
        return True

    def close(self) -> None:
        """Free every adapter (before the model; llama.cpp would free them with it anyway)."""
        for ptr in self._ptrs.values():
            llama_cpp.llama_adapter_lora_free(ptr)
        self._ptrs.clear()

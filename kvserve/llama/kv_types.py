"""The KV cache types llama.cpp accepts (`--cache-type-k/-v`), without importing llama.cpp."""

from __future__ import annotations

from typing import Literal

# common/arg.cpp's `kv_cache_types` at the pinned llama.cpp, by ggml's names
KvType = Literal["f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "iq4_nl", "q5_0", "q5_1"]
# their `ggml_type` values (ggml.h)
KV_TYPES: dict[str, int] = {"f32": 0, "f16": 1, "bf16": 30, "q8_0": 8, "q4_0": 2, "q4_1": 3, "iq4_nl": 20,
                            "q5_0": 6, "q5_1": 7}


def is_quantized(kv_type: KvType) -> bool:
    """A block-quantized type: as V, llama.cpp stores it only untransposed, so it needs flash attention."""
    return kv_type not in ("f32", "f16", "bf16")

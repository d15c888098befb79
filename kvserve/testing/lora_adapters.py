"""Random LoRA adapters for tests and benchmarks, in llama.cpp's LoRA GGUF format (needs `gguf`).

An adapter adds `scale * alpha / rank * B @ A` to chosen weight matrices of a base model: here the
attention projections (q, k, v, output) of every block, with A and B seeded noise. llama.cpp checks
only the architecture and each pair's shape against the base model, so one written from the base
GGUF's own tensor shapes loads on it, and a different seed gives a different adapter.

Format (llama-adapter.cpp at the pinned llama.cpp): `general.type` "adapter", `adapter.type` "lora",
`adapter.lora.alpha`, and per adapted weight W (ggml shape {n_in, n_out}) the tensors
"<W>.lora_a" of shape {n_in, rank} and "<W>.lora_b" of shape {rank, n_out}.

Public API: write_lora_adapter(base, path, seed) and the per-directory cache lora_adapter(base, directory, seed).
"""

from __future__ import annotations

import os
from pathlib import Path

import gguf
import numpy as np

from kvserve.llama.model import Model

TARGETS = ("attn_q", "attn_k", "attn_v", "attn_output")
RANK = 8
# Std of A and of B. The product moves each projection by about RANK * STD**2 * sqrt(n_in) per unit of
# input: enough for greedy outputs to change, not so much that the model only babbles.
STD = 0.06


def _weight_shapes(base: Path) -> tuple[str, dict[str, tuple[int, int]]]:
    """The base model's architecture and the ggml shapes {n_in, n_out} of its adapted weights, by
    tensor name (from its metadata, as llama.cpp reads it: gguf's reader is slow on a vocabulary)."""
    model = Model(base)
    try:
        arch = model.metadata("general.architecture")
        hp = {key: model.metadata(f"{arch}.{key}") for key in (
            "block_count", "embedding_length", "attention.head_count", "attention.head_count_kv",
            "attention.key_length", "attention.value_length")}
    finally:
        model.close()
    n_embd, n_head = int(hp["embedding_length"]), int(hp["attention.head_count"])
    n_head_kv = int(hp["attention.head_count_kv"] or n_head)
    k_len = int(hp["attention.key_length"] or n_embd // n_head)
    v_len = int(hp["attention.value_length"] or k_len)
    per_block = {"attn_q": (n_embd, n_head * k_len), "attn_k": (n_embd, n_head_kv * k_len),
                 "attn_v": (n_embd, n_head_kv * v_len), "attn_output": (n_head * v_len, n_embd)}
    return arch, {f"blk.{i}.{target}.weight": per_block[target]
                  for i in range(int(hp["block_count"])) for target in TARGETS}


def write_lora_adapter(base: Path, path: Path, seed: int, alpha: float = float(RANK)) -> Path:
    """Write a random rank-RANK adapter for `base` to `path` (alpha = rank: llama.cpp's scale is the
    request's scale as given)."""
    arch, shapes = _weight_shapes(base)
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(path, arch)
    w.add_string("general.type", "adapter")
    w.add_string("adapter.type", "lora")
    w.add_float32("adapter.lora.alpha", alpha)
    for name, (n_in, n_out) in sorted(shapes.items()):
        # numpy's shape is ggml's {ne0, ne1} reversed
        w.add_tensor(f"{name}.lora_a", (rng.standard_normal((RANK, n_in)) * STD).astype(np.float32))
        w.add_tensor(f"{name}.lora_b", (rng.standard_normal((n_out, RANK)) * STD).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def lora_adapter(base: Path, directory: Path, seed: int) -> Path:
    """Path of the adapter of `seed` for `base` in `directory`, written on first use."""
    name = f"lora-{base.stem}-{seed}"
    path = directory / f"{name}.gguf"
    if not path.exists():
        partial = directory / f".{name}.{os.getpid()}.gguf"
        write_lora_adapter(base, partial, seed)
        partial.replace(path)
    return path

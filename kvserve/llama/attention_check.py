"""Whether llama.cpp's flash-attention kernel is right for the model being served: a start-up check.

llama.cpp's CPU kernel (ggml-cpu `ggml_compute_forward_flash_attn_ext_f16`) has two paths. A ubatch
of 64+ query rows goes through the tiled path, which accumulates softmax(QK)·V in f32 and matches
exact attention to f32 rounding. Fewer rows (decode steps, short prompt tails, the tail a cached
prefix leaves to compute) go through the one-query path, which accumulates the weighted sum of V in
an f16 vector whenever V is f16 (always: llama.cpp casts an f32 cache to f16 for this kernel). That
accumulator grows to sum(exp(s - max)) · |v|; where attention is flat over many cells and V is large
(Gemma 3: sums in the hundreds, |v| up to 70, accumulators in the thousands, where an f16 step is 1
to 2) each added term loses most of its bits, and the output of one layer moves by up to 13%.

The check evaluates one probe twice on a small context of its own: whole (every row tiled), and on
a second sequence as a prefix and then a `TAIL`-token tail (whose rows take the one-query path). It
takes the largest KL divergence between the two next-token distributions over the tail's positions.
The probe is pseudo-random tokens, whose attention is flat: what makes the f16 accumulator lose most.
Beyond `TOLERANCE` flash attention is wrong for this model and `auto` turns it off. Measured at 512
tokens: Gemma 3 270M 0.034 (its top logprobs move by 0.35-0.6), SmolLM2-135M 0.007, tiny random
models under 0.001. The probe's cache has the served KV types (`--cache-type-k/-v`): with quantized
K and V every row takes the one-query path, which then sums V in f32. The verdict belongs to the
model file, the llama.cpp build and those types, so it is kept per process and in `~/.cache/kvserve/attention-checks.json` (or under `$KVSERVE_MODEL_CACHE`).
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import llama_cpp
import numpy as np

from kvserve.llama.batch import Batch
from kvserve.llama.context import Context, ContextParams, FlashAttn
from kvserve.llama.kv_types import KvType
from kvserve.llama.model import Model

_log = logging.getLogger("kvserve.attention")

PROBE_TOKENS = 512  # enough cells for flat attention to build up a large sum; two prefills of it
# From this many query rows in a ubatch, the CPU kernel works in tiles (with f32 sums)
FLASH_ATTENTION_TILE_ROWS = 64
TAIL = 8  # well under FLASH_ATTENTION_TILE_ROWS: the tail's rows take the one-query path
TOLERANCE = 0.015  # nats of KL divergence: about twice SmolLM2's, under half Gemma 3's
KvTypes = tuple[KvType, KvType]  # the KV cache's (K, V) types: the kernel's paths depend on them


@dataclass(frozen=True)
class FlashAttnChoice:
    """What the server runs: `enabled` and why; `probe_kl` is the check's measure, when it ran."""

    enabled: bool
    reason: str
    probe_kl: float | None = None

    def as_dict(self) -> dict:
        return {"enabled": self.enabled, "reason": self.reason, "probe_kl": self.probe_kl}


def choose_flash_attn(model: Model, asked: FlashAttn, n_threads: int, kv_types: KvTypes = ("f16", "f16")) -> FlashAttnChoice:
    """`off` is off and `on` is on (with a warning where the check fails); under `auto`, on only where
    llama.cpp picks it for the device and the probe, over a KV cache of `kv_types` (K, V), agrees
    with itself within TOLERANCE."""
    if asked == "off":
        return FlashAttnChoice(False, "--flash-attn off")
    kl = checked_probe_kl(model, asked, n_threads, kv_types)
    if kl is None:
        return FlashAttnChoice(False, "llama.cpp chose plain attention for this device")
    if kl <= TOLERANCE:
        return FlashAttnChoice(True, f"--flash-attn {asked}: the self-check passed (KL {kl:.4f} <= {TOLERANCE})", kl)
    why = (f"its few-row path disagrees with its tiled path on this model (KL {kl:.4f} > {TOLERANCE}; "
           "llama.cpp's CPU kernel accumulates V in f16 for fewer than 64 rows)")
    if asked == "on":
        _log.warning("--flash-attn on although %s: answers depend on how a prompt is split", why)
        return FlashAttnChoice(True, f"--flash-attn on, although {why}", kl)
    _log.warning("flash attention off: %s", why)
    return FlashAttnChoice(False, f"self-check failed: {why}", kl)


_memo: dict[str, float | None] = {}


def checked_probe_kl(model: Model, flash_attn: FlashAttn, n_threads: int,
                     kv_types: KvTypes = ("f16", "f16")) -> float | None:
    """`probe_kl`, remembered per model file, llama.cpp build and KV types (in this process and on disk)."""
    stat = Path(model.info.path).stat()
    key = f"{Path(model.info.path).resolve()}|{stat.st_size}|{stat.st_mtime_ns}|{llama_cpp.__version__}|{flash_attn}"
    if kv_types != ("f16", "f16"):
        key += "|" + "/".join(kv_types)
    if key not in _memo:
        store = _store_path()
        try:
            known = json.loads(store.read_text())
        except (OSError, ValueError):
            known = {}
        if key not in known:
            known[key] = probe_kl(model, flash_attn, n_threads, kv_types)
            try:
                store.parent.mkdir(parents=True, exist_ok=True)
                partial = store.with_name(f"{store.name}.{os.getpid()}.partial")
                partial.write_text(json.dumps(known, indent=1))
                partial.replace(store)
            except OSError as e:
                _log.info("could not keep the flash-attention check in %s: %s", store, e)
        _memo[key] = known[key]
    return _memo[key]


def _store_path() -> Path:
    root = os.environ.get("KVSERVE_MODEL_CACHE") or Path.home() / ".cache" / "kvserve"
    return Path(root) / "attention-checks.json"


def probe_kl(model: Model, flash_attn: FlashAttn, n_threads: int, kv_types: KvTypes = ("f16", "f16")) -> float | None:
    """Max KL(whole || prefix + tail) over the tail's positions, with flash attention; None when
    llama.cpp did not enable it (`auto` on a device without it). The split evaluation runs on a
    second sequence, so models that carry state (which cannot drop a tail) are probed alike."""
    tokens = probe_tokens(model.info.n_vocab)
    ctx = Context(model, ContextParams(n_ctx_seq=PROBE_TOKENS, n_batch=PROBE_TOKENS, n_seq_max=2,
                                       n_threads=n_threads, flash_attn=flash_attn,
                                       type_k=kv_types[0], type_v=kv_types[1]))
    try:
        if not ctx.flash_attn:
            return None
        whole = _decode(ctx, tokens, 0, 0)
        _decode(ctx, tokens[:-TAIL], 0, 1)
        split = _decode(ctx, tokens[-TAIL:], len(tokens) - TAIL, 1)
    finally:
        ctx.close()
    return float((np.exp(whole) * (whole - split)).sum(axis=1).max())


def probe_tokens(n_vocab: int) -> list[int]:
    """PROBE_TOKENS fixed pseudo-random ids from the middle of the vocabulary (away from the special
    tokens vocabularies keep at their ends)."""
    rng = np.random.default_rng(0)
    return [int(t) for t in rng.integers(n_vocab // 20, n_vocab // 2, PROBE_TOKENS)]


def _decode(ctx: Context, tokens: list[int], pos0: int, seq: int) -> np.ndarray:
    """Decode `tokens` at `pos0..` on `seq`; the logprobs of the last TAIL of them, one row each."""
    assert TAIL < FLASH_ATTENTION_TILE_ROWS
    batch = Batch(len(tokens))
    try:
        rows = [batch.add(t, pos0 + i, seq, i >= len(tokens) - TAIL) for i, t in enumerate(tokens)][-TAIL:]
        ctx.decode(batch)
        logits = np.stack([ctx.logits(i).astype(np.float64) for i in rows])
    finally:
        batch.close()
    logits -= logits.max(axis=1, keepdims=True)
    return logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))

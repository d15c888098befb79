"""python -m bench kv-types: what `--cache-type-k/-v` buys and costs, in raw llama.cpp calls.

For each KV type (K and V alike) one sequence is prefilled with CONTEXT tokens of a fixed text
(Python's own LICENSE.txt, repeated as needed), with flash attention on:
- KV bytes per token: K and V rows of one token over every layer, as llama.cpp serializes them (the
  stream's allocation per cell is reported beside it);
- host bytes per token: a prefix-cache page's bytes over its rows (rows plus cell metadata);
- decode step time at CONTEXT: one token decoded after the CONTEXT tokens and removed again, the
  median of ROUNDS x STEPS steps, the types interleaved round by round so machine load falls on all;
- drift against f16: the logprob each type gives each reference token of the text (teacher forced),
  minus f16's; mean and max of |Δ| over every position, and how often the argmax differs;
- the flash-attention self-check's KL over that cache type (kvserve.llama.attention_check).

python -m bench kv-types  -> bench/results/kv_types.{json,md}
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from bench.report import describe_machine, machine
from bench.stats import markdown_table
from kvserve.config import embedded_model_path
from kvserve.llama.attention_check import checked_probe_kl
from kvserve.llama.batch import Batch
from kvserve.llama.context import Context, ContextParams
from kvserve.llama.model import Model
from kvserve.llama.seq_state import SeqState

RESULTS = Path(__file__).parent / "results"
TYPES = ["f16", "q8_0", "q4_0"]
CONTEXT = 4096
CHUNK = 512  # prefill ubatch
PAGE_ROWS = 16
ROUNDS = 5
STEPS = 8


def fixed_text_tokens(model: Model, n: int) -> list[int]:
    text = (Path(sys.base_prefix) / "lib" / f"python{sys.version_info[0]}.{sys.version_info[1]}" / "LICENSE.txt").read_text()
    tokens = model.tokenize(text, add_special=True)
    body = model.tokenize(text, add_special=False)
    while len(tokens) < n:
        tokens += body
    return tokens[:n]


class Filled:
    """One sequence holding the text in a cache of `kv_type`, and the logprob of each next reference token."""

    def __init__(self, model: Model, kv_type: str, tokens: list[int], threads: int) -> None:
        self.ctx = Context(model, ContextParams(n_ctx_seq=len(tokens) + 256, n_batch=CHUNK, n_seq_max=1, n_threads=threads,
                                                flash_attn="on", type_k=kv_type, type_v=kv_type))
        self.batch = Batch(CHUNK)
        self.n = len(tokens)
        logprobs, argmax = [], []
        for start in range(0, self.n, CHUNK):
            part = tokens[start : start + CHUNK]
            self.batch.clear()
            for i, token in enumerate(part):
                self.batch.add(token, start + i, 0, True)
            self.ctx.decode(self.batch)
            for i in range(len(part)):
                if start + i + 1 < self.n:
                    row = self.ctx.logits(i).astype(np.float64)
                    top = row.max()
                    logprobs.append(row[tokens[start + i + 1]] - top - np.log(np.exp(row - top).sum()))
                    argmax.append(int(row.argmax()))
        self.logprobs, self.argmax = np.array(logprobs), np.array(argmax)
        state = SeqState(self.ctx)
        page = state.donate(0, PAGE_ROWS, n_pages=1)[0]
        self.row_bytes = state.row_bytes
        self.host_bytes_per_token = page.nbytes / PAGE_ROWS
        self.allocated_per_cell = self.ctx.kv_bytes / self.ctx.n_ctx

    def decode_seconds(self) -> list[float]:
        """STEPS decode steps of one token at position n, each removed again."""
        out = []
        for _ in range(STEPS):
            self.batch.clear()
            self.batch.add(100, self.n, 0, True)
            started = time.perf_counter()
            self.ctx.decode(self.batch)
            out.append(time.perf_counter() - started)
            self.ctx.seq_rm(0, self.n)
        return out

    def close(self) -> None:
        self.batch.close()
        self.ctx.close()


def main(model_path: Path | None = None, threads: int = 2, out: Path = RESULTS) -> str:
    model = Model(model_path or embedded_model_path())
    tokens = fixed_text_tokens(model, CONTEXT)
    filled = {t: Filled(model, t, tokens, threads) for t in TYPES}
    steps: dict[str, list[float]] = {t: [] for t in TYPES}
    for _ in range(ROUNDS):
        for t in TYPES:
            steps[t] += filled[t].decode_seconds()
    base = filled["f16"]
    rows = {}
    for t, f in filled.items():
        delta = np.abs(f.logprobs - base.logprobs)
        rows[t] = {"kv_bytes_per_token": f.row_bytes, "allocated_bytes_per_cell": f.allocated_per_cell,
                   "host_bytes_per_token": f.host_bytes_per_token,
                   "decode_ms_at_context": statistics.median(steps[t]) * 1000,
                   "mean_abs_dlogprob": float(delta.mean()), "max_abs_dlogprob": float(delta.max()),
                   "argmax_changed": float((f.argmax != base.argmax).mean()),
                   "probe_kl": checked_probe_kl(model, "on", threads, (t, t))}
        f.close()
    model.close()
    result = {"machine": machine(), "settings": {"context": CONTEXT, "threads": threads, "rounds": ROUNDS,
                                                 "steps": STEPS, "page_rows": PAGE_ROWS}, "types": rows}
    out.mkdir(exist_ok=True)
    (out / "kv_types.json").write_text(json.dumps(result, indent=2) + "\n")
    f16 = rows["f16"]
    table = markdown_table(
        ["K and V type", "KV bytes/token", "host bytes/token", "tokens per f16 budget", f"decode step ms at {CONTEXT}",
         "mean abs Δlogprob", "max abs Δlogprob", "argmax changed", "self-check KL"],
        [[t, r["kv_bytes_per_token"], r["host_bytes_per_token"],
          f16["host_bytes_per_token"] / r["host_bytes_per_token"], r["decode_ms_at_context"],
          r["mean_abs_dlogprob"], r["max_abs_dlogprob"], r["argmax_changed"], r["probe_kl"]] for t, r in rows.items()])
    markdown = (f"{describe_machine(result['machine'])}; {model_path.name if model_path else 'SmolLM2-135M'}, flash "
                f"attention on, {threads} threads; {CONTEXT} tokens of Python's LICENSE.txt; decode: median of "
                f"{ROUNDS * STEPS} steps; Δlogprob against f16 over the {CONTEXT - 1} reference tokens.\n\n{table}")
    (out / "kv_types.md").write_text(markdown + "\n")
    return markdown

"""python -m bench host-tier: what the host-memory tier costs per token, against prefilling it.

In a context with a stream per sequence (flash attention as the device picks), a prompt of each
length is prefilled in PREFILL_CHUNK-token calls; then, best of REPEATS:
- donate: the sequence's rows read out of llama.cpp and cut into PAGE_ROWS-token pages;
- attach: the pages joined and loaded into an empty sequence (positions checked);
- llama.cpp's own whole-sequence get and set, for reference;
and the host bytes the pages hold per token against the KV row size (every layer's K and V row).
Each is timed in wall-clock and in process CPU time: on a shared machine the CPU time is the steadier
(prefill's counts all its threads). Issue 20's targets: attach <= 2% of prefilling, host bytes per
token <= 1.1x the row size.

python -m bench host-tier  -> bench/results/host_tier.{json,md}
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Callable

from bench.report import describe_machine, machine
from bench.stats import markdown_table
from kvserve.config import embedded_model_path
from kvserve.llama.batch import Batch
from kvserve.llama.context import Context, ContextParams
from kvserve.llama.model import Model
from kvserve.llama.seq_state import SeqState

RESULTS = Path(__file__).parent / "results"
LENGTHS = (512, 2048)
PAGE_ROWS = 16
PREFILL_CHUNK = 512
REPEATS = 5


def _best(call: Callable[[], object], repeats: int = REPEATS) -> tuple[float, float]:
    """The best wall-clock and the best CPU seconds of `repeats` calls."""
    wall = cpu = float("inf")
    for _ in range(repeats):
        started, cpu_started = time.perf_counter(), time.process_time()
        call()
        wall = min(wall, time.perf_counter() - started)
        cpu = min(cpu, time.process_time() - cpu_started)
    return wall, cpu


def _prefill(ctx: Context, batch: Batch, tokens: list[int]) -> None:
    ctx.seq_rm(0)
    for i in range(0, len(tokens), PREFILL_CHUNK):
        batch.clear()
        for j, token in enumerate(tokens[i : i + PREFILL_CHUNK]):
            batch.add(token, i + j, 0, i + j == len(tokens) - 1)
        ctx.decode(batch)


def measure(model: Model, n: int, threads: int) -> dict[str, float]:
    ctx = Context(model, ContextParams(n_ctx_seq=max(LENGTHS), n_batch=PREFILL_CHUNK, n_seq_max=2, n_threads=threads))
    batch = Batch(PREFILL_CHUNK)
    state = SeqState(ctx)
    text = "The harbour master logged every ship, its cargo and its crew. " * (n // 8)
    tokens = model.tokenize(text, add_special=True)[:n]
    prefill = _best(lambda: _prefill(ctx, batch, tokens), repeats=2)
    state.read(0)  # learns the layout once
    donate = _best(lambda: state.donate(0, PAGE_ROWS))
    pages = state.donate(0, PAGE_ROWS)
    attach = _best(lambda: state.attach(1, pages, n))
    blob = ctx.read_seq_state(0)
    get = _best(lambda: ctx.read_seq_state(0))
    put = _best(lambda: ctx.write_seq_state(1, blob))
    timed = {"prefill": prefill, "donate": donate, "attach": attach, "llama_get": get, "llama_set": put}
    result: dict = {"tokens": n, "flash_attn": ctx.flash_attn,
                    "host_bytes_per_token": sum(p.nbytes for p in pages) / n, "row_bytes": state.row_bytes}
    for name, (wall, cpu) in timed.items():
        result[f"{name}_us"], result[f"{name}_cpu_us"] = wall * 1e6 / n, cpu * 1e6 / n
    batch.close()
    ctx.close()
    return result


def _both(row: dict, name: str) -> str:
    return f"{row[name + '_us']:.1f} ({row[name + '_cpu_us']:.1f})"


def main(model_path: Path | None = None, threads: int = 2, out: Path = RESULTS) -> str:
    model = Model(model_path or embedded_model_path())
    rows = [measure(model, n, threads) for n in LENGTHS]
    model.close()
    result = {"machine": machine(), "model": model_path.name if model_path else "SmolLM2-135M",
              "load_average": os.getloadavg()[0],
              "settings": {"page_rows": PAGE_ROWS, "threads": threads}, "rows": rows}
    out.mkdir(exist_ok=True)
    (out / "host_tier.json").write_text(json.dumps(result, indent=2) + "\n")
    text = markdown(result)
    (out / "host_tier.md").write_text(text + "\n")
    return text


def markdown(result: dict) -> str:
    rows = result["rows"]
    table = markdown_table(
        ["tokens", "prefill", "donate", "attach", "llama get", "llama set", "attach / prefill", "host bytes/tok",
         "KV row bytes", "ratio"],
        [[r["tokens"], *(_both(r, k) for k in ("prefill", "donate", "attach", "llama_get", "llama_set")),
          f"{r['attach_us'] / r['prefill_us']:.2%} ({r['attach_cpu_us'] / r['prefill_cpu_us']:.2%})",
          r["host_bytes_per_token"], r["row_bytes"], f"{r['host_bytes_per_token'] / r['row_bytes']:.4f}"]
         for r in rows])
    return (f"{describe_machine(result['machine'])}; {result.get('model', 'SmolLM2-135M')}, a stream per sequence, "
            f"flash attention {'on' if rows[0]['flash_attn'] else 'off'}, pages of {result['settings']['page_rows']} "
            f"tokens, {result['settings']['threads']} threads, best of {REPEATS} (prefill: of 2). Times in µs per "
            f"token, wall-clock (CPU time){_load(result)}.\n\n{table}")


def _load(result: dict) -> str:
    """Other processes' share of the machine shows in wall-clock times, hardly in CPU times."""
    load = result.get("load_average")
    return "" if load is None else f"; load average {load:.1f} when it ended"

"""The serving benchmark: kvserve at concurrency 1, 4, 8 and 16 against raw batched llama_decode.

Each level sends `concurrency` streamed chat requests at once (distinct prompts of equal length,
64 tokens each, ignore_eos) and repeats it `rounds` times. Decode throughput is concurrency divided
by the median inter-token latency, the rate at which a full batch advances; the reference is raw
`llama_decode` of the same batch shape in a separate process of the same run.

python -m bench serving
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path

import httpx

from bench.client import stream_chat
from bench.stats import markdown_table, summarize
from kvserve.testing import ServerProcess, read_metrics

RESULTS = Path(__file__).parent / "results"


async def level(url: str, concurrency: int, rounds: int, max_tokens: int) -> dict:
    results, wall = [], 0.0
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=64)) as client:
        for r in range(rounds):
            messages = [[{"role": "user", "content": f"Round {r}, user {i}: write a long story about the number {i}."}]
                        for i in range(concurrency)]
            started = time.perf_counter()
            results += await asyncio.gather(*(stream_chat(client, url, m, max_tokens, {"ignore_eos": True})
                                              for m in messages))
            wall += time.perf_counter() - started
    stats = {"concurrency": concurrency, **summarize(results, wall)}
    stats["decode_tok_s"] = concurrency / stats["itl_p50"]
    return stats


def raw_reference(levels: list[int], threads: int) -> dict[int, float]:
    out = subprocess.run([sys.executable, "-m", "bench.raw_decode", "--threads", str(threads), "--sequences",
                          *map(str, levels)], capture_output=True, text=True, check=True)
    return {int(k): v for k, v in json.loads(out.stdout.strip().splitlines()[-1]).items()}


def main(levels: tuple[int, ...] = (1, 4, 8, 16), rounds: int = 2, max_tokens: int = 64, threads: int = 2) -> str:
    raw = raw_reference(list(levels), threads)  # first, alone on the machine
    rows = []
    with ServerProcess.kvserve(RESULTS / "serving-kvserve.log", parallel=16, threads=threads) as server:
        server.wait_healthy()
        url = server.url
        asyncio.run(level(url, 2, 1, 8))  # warm up
        for concurrency in levels:
            before = read_metrics(url)
            stats = asyncio.run(level(url, concurrency, rounds, max_tokens))
            after = read_metrics(url)
            loop = after.value("kvserve_engine_loop_seconds_total") - before.value("kvserve_engine_loop_seconds_total")
            decode = (after.value("kvserve_engine_decode_seconds_total")
                      - before.value("kvserve_engine_decode_seconds_total"))
            stats["python_overhead"] = 1 - decode / loop
            rows.append(stats)
    for row in rows:
        row["raw_decode_tok_s"] = raw[row["concurrency"]]
        row["vs_raw"] = row["decode_tok_s"] / row["raw_decode_tok_s"]
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "serving.json").write_text(json.dumps(rows, indent=2))
    table = markdown_table(
        ["concurrency", "output tok/s", "decode tok/s", "raw llama_decode tok/s", "decode vs raw", "TTFT p50 s",
         "TTFT p95 s", "ITL p50 ms", "outside llama_decode", "errors"],
        [[r["concurrency"], r["output_tok_s"], r["decode_tok_s"], r["raw_decode_tok_s"], f"{r['vs_raw']:.0%}",
          r["ttft_p50"], r["ttft_p95"], r["itl_p50"] * 1000, f"{r['python_overhead']:.1%}", r["errors"]]
         for r in rows],
    )
    (RESULTS / "serving.md").write_text(table + "\n")
    return table


if __name__ == "__main__":
    print(main())

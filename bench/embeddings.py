"""python -m bench embeddings: /v1/embeddings per second, kvserve against llama-server.

Two workloads on each server, freshly started with the same model, threads and pooling (mean, what
kvserve picks for SmolLM2, which declares none; llama-server refuses until told `--pooling mean`):
- single: `USERS` clients at once, each sending one text per request, `TEXTS` texts in all;
- batch: one request of `TEXTS` texts.
Both send the same distinct texts, and each row gives the lowest cosine of its vectors to an
independent reference: llama-cpp-python's `Llama(embedding=True)`, in process, one text at a time.
At this pin llama-server's vectors drift when it pools several requests' texts in one decode (its
slots have a stream each): measured down to 0.78 at 8 users, 0.9999+ one at a time.

python -m bench embeddings [--quick] [--servers kvserve llama-server]
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path
from typing import Callable

import httpx
import llama_cpp
import numpy as np

from bench import llama_server, report
from bench.stats import markdown_table
from kvserve.config import embedded_model_path
from kvserve.testing import ServerProcess, free_port, kvserve_command

RESULTS = Path(__file__).parent / "results"
TEXTS = 256
USERS = 8
TOPICS = ["rivers", "compilers", "bread", "glaciers", "tax law", "violins", "orbits", "tomatoes"]


def texts(n: int = TEXTS) -> list[str]:
    """`n` distinct sentences of 20-40 tokens, the same on every run."""
    return [f"Note {i}: a short passage about {TOPICS[i % len(TOPICS)]}, written for retrieval test number {i * 7919 % 1000}, "
            f"with {i % 5 + 1} extra clause{'s' if i % 5 else ''}" + ", and one more detail" * (i % 5) + "."
            for i in range(n)]


Command = Callable[[int], list[str]]  # port -> argv


def servers(model: Path, threads: int, binary: Path) -> dict[str, Command]:
    """port -> argv for each server: 8 x 512 cells (kvserve: 8 streams of 512; llama-server: -c 4096
    over 8 slots), mean pooling, 512-token batches."""
    return {
        "kvserve": lambda port: kvserve_command(port=port, model=str(model), threads=threads, parallel=USERS,
                                                ctx_size=512, pooling="mean", embedding_batch=512),
        "llama-server": lambda port: [
            str(binary), "--host", "127.0.0.1", "--port", str(port), "--model", str(model),
            "--threads", str(threads), "--threads-batch", str(threads), "--parallel", str(USERS),
            "--ctx-size", str(USERS * 512), "--embeddings", "--pooling", "mean", "--batch-size", "512",
            "--ubatch-size", "512"],
    }


async def embed(client: httpx.AsyncClient, url: str, inputs: list[str]) -> list[np.ndarray]:
    response = await client.post(f"{url}/v1/embeddings", json={"model": "bench", "input": inputs,
                                                               "encoding_format": "float"}, timeout=600)
    response.raise_for_status()
    data = sorted(response.json()["data"], key=lambda d: d["index"])
    if len(data) != len(inputs):
        raise RuntimeError(f"{url} answered {len(data)} embeddings for {len(inputs)} inputs")
    return [np.asarray(d["embedding"], dtype=np.float64) for d in data]


async def single(url: str, inputs: list[str], users: int) -> tuple[float, list[np.ndarray]]:
    """Seconds for `users` clients to embed `inputs` one per request; the vectors in input order."""
    out: list[np.ndarray | None] = [None] * len(inputs)
    queue = list(enumerate(inputs))

    async def user(client: httpx.AsyncClient) -> None:
        while queue:
            i, text = queue.pop(0)
            out[i] = (await embed(client, url, [text]))[0]

    async with httpx.AsyncClient(trust_env=False) as client:
        started = time.perf_counter()
        await asyncio.gather(*(user(client) for _ in range(users)))
        return time.perf_counter() - started, out


async def batch(url: str, inputs: list[str]) -> tuple[float, list[np.ndarray]]:
    async with httpx.AsyncClient(trust_env=False) as client:
        started = time.perf_counter()
        vectors = await embed(client, url, inputs)
        return time.perf_counter() - started, vectors


def lowest_cosine(ours: list[np.ndarray], theirs: list[np.ndarray]) -> float:
    return min(float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b))) for a, b in zip(ours, theirs))


def reference_vectors(model: Path, inputs: list[str], threads: int) -> list[np.ndarray]:
    """Each text alone through llama-cpp-python's own embedding path, mean-pooled and normalized."""
    llama = llama_cpp.Llama(model_path=str(model), embedding=True, pooling_type=llama_cpp.LLAMA_POOLING_TYPE_MEAN,
                            n_ctx=512, n_batch=512, n_threads=threads, verbose=False)
    try:
        return [np.asarray(llama.embed(text, normalize=True)) for text in inputs]
    finally:
        llama.close()


def measure(name: str, command: Command, inputs: list[str], reference: list[np.ndarray]) -> list[dict]:
    """Both workloads on one fresh server, each row with its lowest cosine to `reference`."""
    port = free_port()
    rows = []
    with ServerProcess(command(port), port, RESULTS / f"embeddings-{name}.log") as process:
        process.wait_healthy("/health")
        asyncio.run(batch(process.url, inputs[:8]))  # warm-up
        for workload, run in (("single", lambda: single(process.url, inputs, USERS)),
                              ("batch", lambda: batch(process.url, inputs))):
            seconds, vectors = asyncio.run(run())
            row = {"server": name, "workload": workload, "texts": len(inputs), "seconds": seconds,
                   "embeddings_s": len(inputs) / seconds, "lowest_cosine": lowest_cosine(vectors, reference)}
            print(f"{workload:>7} {name:>13}: {row['embeddings_s']:.2f} embeddings/s "
                  f"(lowest cosine to llama-cpp-python alone: {row['lowest_cosine']:.6f})", flush=True)
            rows.append(row)
    return rows


def markdown(result: dict) -> str:
    rows = [[r["server"], r["workload"], r["texts"], r["embeddings_s"], f"{r['lowest_cosine']:.6f}"]
            for r in result["rows"]]
    table = markdown_table(["server", "workload", "texts", "embeddings/s", "lowest cosine to llama-cpp-python alone"],
                           rows)
    return f"{report.describe_machine(result['machine'])}\n\n{table}"


def main(quick: bool = False, chosen: list[str] | None = None) -> str:
    threads = os.cpu_count() or 1
    model = embedded_model_path()
    inputs = texts(32 if quick else TEXTS)
    reference = reference_vectors(model, inputs, threads)
    chosen = chosen or ["kvserve", "llama-server"]
    binary = llama_server.require() if "llama-server" in chosen else Path("llama-server")
    rows = [row for name, command in servers(model, threads, binary).items() if name in chosen
            for row in measure(name, command, inputs, reference)]
    result = {"machine": report.machine(),
              "settings": {"model": model.name, "threads": threads, "users": USERS, "texts": len(inputs),
                           "pooling": "mean"},
              "rows": rows}
    name = "embeddings" if not quick and len(chosen) == 2 else "embeddings-partial"
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps(result, indent=2) + "\n")
    text = markdown(result)
    (RESULTS / f"{name}.md").write_text(text + "\n")
    return text

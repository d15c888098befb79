"""python -m bench soak: thousands of requests against one kvserve, about 30% abandoned at random
points, streamed and whole, with the server's resident memory sampled as it runs.

A server must hold flat memory however long it serves: the report gives memory at start, after the
warm-up (once the KV cache and the prefix cache have been filled), and at the end, and a chart.
`tests/test_memory.py` runs the same workload, shorter, as a CI check.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from bench.report import pyplot
from kvserve.testing import ServerProcess, read_metrics

RESULTS = Path(__file__).parent / "results"
CANCEL_SHARE = 0.3
PREFIXES = ["You are a helpful assistant. " * 6, "Answer in French, briefly. " * 5, "Summarize this: " * 4]


def _body(rng: random.Random, i: int) -> tuple[str, dict]:
    text = f"{rng.choice(PREFIXES)}question {i}: {rng.random()}"
    common = {"max_tokens": rng.randint(1, 24), "temperature": rng.choice([0, 0.8]), "stream": rng.random() < 0.5}
    if rng.random() < 0.5:
        return "/v1/chat/completions", {**common, "messages": [{"role": "user", "content": text}]}
    return "/v1/completions", {**common, "prompt": text}


async def one_request(client: httpx.AsyncClient, rng: random.Random, i: int) -> str:
    """'ok', 'cancelled', or what went wrong: the failing status as text, 'stream error', 'stream cut'."""
    path, body = _body(rng, i)
    cancel = rng.random() < CANCEL_SHARE
    if not body["stream"]:
        work = client.post(path, json=body)
        if cancel:
            try:
                response = await asyncio.wait_for(work, timeout=rng.uniform(0.001, 0.2))
            except asyncio.TimeoutError:
                return "cancelled"
        else:
            response = await work
        return "ok" if response.status_code == 200 and response.json()["usage"] else str(response.status_code)
    stop_after = rng.randint(0, 3) if cancel else None
    async with client.stream("POST", path, json=body) as response:
        if response.status_code != 200:
            return str(response.status_code)
        seen = 0
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line.removeprefix("data: ")
            if data == "[DONE]":
                return "ok"
            if "error" in json.loads(data):
                return "stream error"
            seen += 1
            if stop_after is not None and seen > stop_after:
                return "cancelled"  # leaving the block closes the connection mid-stream
    return "stream cut"


async def soak(url: str, n_requests: int, concurrency: int, seed: int, first: int = 0,
               timeout: float = 120) -> Counter[str]:
    """Run requests `first` .. `first + n_requests - 1`, `concurrency` at a time; count the outcomes.
    A request that takes longer than `timeout` counts as 'hung'."""
    rng = random.Random(seed)
    gate = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=None,  # `timeout` below bounds each request whole
                                 limits=httpx.Limits(max_connections=concurrency * 2)) as client:
        async def bounded(i: int) -> str:
            async with gate:
                try:
                    return await asyncio.wait_for(one_request(client, rng, i), timeout=timeout)
                except asyncio.TimeoutError:
                    return "hung"
        return Counter(await asyncio.gather(*(bounded(i) for i in range(first, first + n_requests))))


def resident_mib(url: str) -> float:
    return read_metrics(url).value("process_resident_memory_bytes") / 2**20


@dataclass
class SoakRun:
    requests: int = 0
    outcomes: Counter[str] = field(default_factory=Counter)
    memory: list[tuple[int, float]] = field(default_factory=list)  # (requests done, resident MiB)

    def batch(self, url: str, n: int, concurrency: int, timeout: float = 120) -> None:
        self.outcomes += asyncio.run(soak(url, n, concurrency, seed=self.requests, first=self.requests,
                                          timeout=timeout))
        self.requests += n
        self.memory.append((self.requests, resident_mib(url)))


def main(n_requests: int = 5_000, warmup: int = 500, chunk: int = 250, concurrency: int = 32,
         timeout: float = 600) -> str:
    """The long soak on the default model. bench/results/soak.{json,png} are rewritten after every
    chunk, so a run stopped early still leaves its curve."""
    settings = {"parallel": 8, "ctx_size": 4096}
    started = time.monotonic()
    with ServerProcess.kvserve(RESULTS / "soak-kvserve.log", **settings) as server:
        server.wait_healthy()
        run = SoakRun(memory=[(0, resident_mib(server.url))])
        while run.requests < n_requests:
            run.batch(server.url, chunk, concurrency, timeout)
            live = read_metrics(server.url).value("kvserve_live_sampler_chains")
            summary = _write(run, settings, warmup, live, time.monotonic() - started)
            print(f"soak: {summary}", flush=True)
    return summary


def _write(run: SoakRun, settings: dict, warmup: int, live: float, seconds: float) -> str:
    after_warmup = next((mib for done, mib in run.memory if done >= warmup), None)
    result = {"requests": run.requests, "settings": settings, "outcomes": dict(run.outcomes), "seconds": seconds,
              "memory_mib": run.memory, "start_mib": run.memory[0][1], "after_warmup_mib": after_warmup,
              "end_mib": run.memory[-1][1], "live_sampler_chains": live}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "soak.json").write_text(json.dumps(result, indent=1))
    _chart(run, warmup, RESULTS / "soak.png")
    return (f"{run.requests} requests in {seconds:.0f}s, outcomes {dict(run.outcomes)}; resident memory "
            f"{result['start_mib']:.0f} MiB at start, {after_warmup or float('nan'):.0f} MiB after {warmup} requests, "
            f"{result['end_mib']:.0f} MiB now; {live:.0f} live sampler chains")


def _chart(run: SoakRun, warmup: int, path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.plot([d for d, _ in run.memory], [m for _, m in run.memory], marker=".")
    ax.axvline(warmup, color="grey", linestyle=":", label="end of warm-up")
    ax.set_xlabel("requests served")
    ax.set_ylabel("resident memory (MiB)")
    ax.set_ylim(bottom=0)
    ax.set_title("kvserve soak: resident memory while serving")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)

"""A streaming OpenAI client that times what a user feels: time to first token and between tokens."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

import httpx

from kvserve.testing import read_metrics


_TIMING: httpx.Client | None = None


def timing_client() -> httpx.Client:
    """One client for every timed request of a synchronous bench: building one (its TLS context, even
    for http) took 16-33 ms on this box, which an `httpx.post` per request put inside every time
    measured (twice inside llama-server's slot restore and prompt)."""
    global _TIMING
    if _TIMING is None:
        # a fresh connection for each request: servers come and go, and llama-server drops idle ones
        _TIMING = httpx.Client(trust_env=False, limits=httpx.Limits(max_keepalive_connections=0))
    return _TIMING


@dataclass
class Result:
    ttft: float = 0.0
    # seconds between tokens: a chunk of n tokens that came g after the one before is n gaps of g / n,
    # as SGLang's bench_serving counts a verified draft's chunk (a server that streams one token a
    # chunk is unchanged by it); a first chunk's further tokens came with it, 0 s each
    itls: list[float] = field(default_factory=list)
    gaps: list[float] = field(default_factory=list)  # seconds between content chunks, whatever each carried
    output_tokens: int = 0  # usage.completion_tokens, else the content chunks (one token each)
    prompt_tokens: int = 0
    cached_tokens: int | None = None  # None: the server does not report it (llama-cpp-python's)
    seconds: float = 0.0
    text: str = ""
    error: str | None = None


async def stream_chat(client: httpx.AsyncClient, url: str, messages: list[dict], max_tokens: int,
                      extra: dict | None = None) -> Result:
    # continuous_usage_stats (vLLM's; others ignore it): each chunk says how many tokens came so far
    body = {"model": "bench", "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}, **(extra or {})}
    result = Result()
    chunks, reported_tokens, counted = 0, None, 0
    start = last = time.perf_counter()
    try:
        async with client.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=600) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                usage = chunk.get("usage")
                if usage:
                    reported_tokens = usage["completion_tokens"]
                    result.prompt_tokens = usage["prompt_tokens"]
                    details = usage.get("prompt_tokens_details") or {}
                    result.cached_tokens = details.get("cached_tokens")
                for choice in chunk.get("choices", []):
                    text = (choice.get("delta") or {}).get("content")
                    if not text:
                        continue
                    now = time.perf_counter()
                    tokens = reported_tokens - counted if usage else 1  # 0: one output's text split in chunks
                    counted += tokens
                    if not result.text:
                        result.ttft = now - start
                        result.itls += [0.0] * (tokens - 1)
                    elif tokens:
                        result.gaps.append(now - last)
                        result.itls += [(now - last) / tokens] * tokens
                    if tokens or not result.text:
                        last = now
                    result.text += text
                    chunks += 1
    except httpx.HTTPError as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    result.seconds = time.perf_counter() - start
    # llama-cpp-python's server sends no usage when streaming; it streams one token per chunk
    result.output_tokens = chunks if reported_tokens is None else reported_tokens
    return result


async def gather_limited(jobs: list, concurrency: int) -> list:
    """Run coroutine factories with at most `concurrency` in flight, in order of the list."""
    semaphore = asyncio.Semaphore(concurrency)

    async def one(job):
        async with semaphore:
            return await job()

    return await asyncio.gather(*(one(job) for job in jobs))


@dataclass(frozen=True)
class EngineWork:
    """What a kvserve's metrics count of its work since it started: tokens drafted (all drafters) and
    of those accepted, engine steps, and seconds in `llama_decode`. `after - before` is a stretch's."""

    drafted: int
    accepted: int
    steps: int
    decode_seconds: float

    def __sub__(self, earlier: EngineWork) -> EngineWork:
        return EngineWork(self.drafted - earlier.drafted, self.accepted - earlier.accepted,
                          self.steps - earlier.steps, self.decode_seconds - earlier.decode_seconds)


def engine_work(url: str) -> EngineWork:
    """A kvserve's `EngineWork` from one read of its metrics (`kvserve_spec_draft_tokens_total`,
    `kvserve_spec_accepted_tokens_total`, `kvserve_engine_steps_total`,
    `kvserve_engine_decode_seconds_total`)."""
    metrics = read_metrics(url)
    return EngineWork(round(metrics.total("kvserve_spec_draft_tokens_total")),
                      round(metrics.total("kvserve_spec_accepted_tokens_total")),
                      round(metrics.total("kvserve_engine_steps_total")),
                      metrics.total("kvserve_engine_decode_seconds_total"))

"""Two kvserve replicas behind a real cache-aware router, all on loopback: requests that share a long
prefix reach the replica holding it, so the cache pays off across the fleet; a replica that dies
costs retries, not answers. The replicas serve a tiny random-weight model (SmolLM2's tokenizer and
template), so prompts are real and prefill is cheap."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from kvserve.testing.fleet import Fleet, fleet, missing_router, served

QUESTIONS_PER_PREFIX = 6
CONCURRENCY = 8
MODEL = "fleet"  # smg routes on the body's model: every replica serves it under one name
REPLICA_SETTINGS = {"model_alias": MODEL, "threads": 1, "parallel": 8, "ctx_size": 4096}


def system_prompt(desk: str) -> str:
    """~700 tokens that share nothing with the other desk's from the first word on."""
    rules = [f"{desk} rule {i}: file form {desk[:3]}-{i * 7 % 31} before the {i % 5 + 1}th bell of day {i}."
             for i in range(40)]
    return f"{desk.capitalize()} desk handbook. Answer with one rule number.\n" + "\n".join(rules)


PREFIXES = {desk: system_prompt(desk) for desk in ("orchard", "harbour")}


def chat(desk: str, question: str) -> dict:
    return {"model": MODEL, "temperature": 0, "max_tokens": 4, "stream": True,
            "stream_options": {"include_usage": True},
            "messages": [{"role": "system", "content": PREFIXES[desk]}, {"role": "user", "content": question}]}


class Refused(Exception):
    """The router answered, but not with a whole stream."""


def ask(url: str, body: dict) -> dict:
    """Stream one chat through the router; its usage, once the stream ended with [DONE]."""
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=120) as response:
        if response.status_code != 200:
            raise Refused(f"HTTP {response.status_code}: {response.read()[:200]!r}")
        data = [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")]
    if not data or data[-1] != "[DONE]":
        raise Refused(f"the stream did not end with [DONE]: {data[-2:]}")
    usages = [chunk["usage"] for chunk in map(json.loads, data[:-1]) if chunk.get("usage")]
    if len(usages) != 1:
        raise Refused(f"{len(usages)} usage chunks")
    return usages[0]


def eventually(url: str, body: dict, timeout: float = 90) -> dict:
    """The usage of the first attempt that succeeds; failures before it are what an outage costs."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return ask(url, body)
        except (Refused, httpx.HTTPError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def shared_tokens(replica: str, desk: str) -> int:
    """Prompt tokens two questions at one desk have in common, from the replica's own rendering."""
    a, b = (httpx.post(f"{replica}/v1/chat/completions/render", json=chat(desk, q)).json()["token_ids"]
            for q in ("Which rule covers apples?", "Where do boats dock?"))
    return next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)


def holders(f: Fleet, desk: str) -> list[int]:
    """The replicas whose prefix cache holds the desk's system prompt."""
    body = {**chat(desk, "A question nobody asked yet"), "stream": False}
    cached = [httpx.post(f"{r.url}/v1/prefix/match", json=body).json()["cached_tokens"] for r in f.replicas]
    return [i for i, n in enumerate(cached) if n > 0]


@pytest.mark.parametrize("router", ["smg", "vllm-router"])
def test_prefixes_stick_to_a_replica_and_a_dead_replica_costs_only_retries(router: str, tiny, tmp_path: Path) -> None:
    if reason := missing_router(router):
        pytest.skip(reason)
    with fleet(tiny("llama"), tmp_path, router, "cache_aware", REPLICA_SETTINGS) as f:
        shared = {desk: shared_tokens(f.replicas[0].url, desk) for desk in PREFIXES}
        assert min(shared.values()) > 400

        with ThreadPoolExecutor(CONCURRENCY) as pool:
            # Each prefix's first request, the miss that fills one replica's cache; together, as users
            # arrive, so that the router sees one replica busy when it places the second.
            list(pool.map(lambda desk: ask(f.url, chat(desk, "Which rule comes first?")), PREFIXES))
            jobs = [(desk, f"Question {i}: which rule covers form {i}?")
                    for i in range(QUESTIONS_PER_PREFIX) for desk in PREFIXES]
            usages = list(pool.map(lambda job: ask(f.url, chat(*job)), jobs))

        cached = sum(u["prompt_tokens_details"]["cached_tokens"] for u in usages)
        assert cached >= 0.8 * sum(shared[desk] for desk, _ in jobs), (cached, shared)
        where = {desk: holders(f, desk) for desk in PREFIXES}
        assert all(len(replicas) == 1 for replicas in where.values()), f"a prefix reached both replicas: {where}"

        # The replica of the first desk dies; every later request must still be answered, by the other.
        victim = where["orchard"][0]
        f.replicas[victim].kill()
        survivor = f.replicas[1 - victim]
        before = served(survivor)
        for i in range(3):
            for desk in PREFIXES:
                eventually(f.url, chat(desk, f"After the outage, question {i}?"))
        assert served(survivor) - before >= 3 * len(PREFIXES)
        assert f.router.alive()

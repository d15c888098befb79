"""The fleet benchmark: two kvserve replicas behind smg, `cache_aware` against `round_robin`, one run.

The shared-prompt workload with four system prompts: four support desks, each with its own
~550-token handbook (they differ from the first word); USERS_PER_DESK users per desk ask ROUNDS
questions one after another, all users at once. Each replica's page cache keeps about two
handbooks (--prefix-state-mb 30: 80 pages of 23 KiB rows, a handbook is 35), the situation a fleet is for:
a router that sends each desk to one replica lets the two caches together hold all four, while
one that spreads every desk over both makes each cache cycle through all four. Each policy gets
fresh replicas of SmolLM2-135M, one llama.cpp thread each.

Reports, per policy, the requests each replica served, the share of prompt tokens attached from
cache, the tokens attached, and TTFT; the target is cache_aware attaching at least 1.5x the tokens
round_robin does.

python -m bench.fleet
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx

from bench.client import Result, gather_limited, stream_chat
from bench.stats import markdown_table, percentile
from kvserve.config import embedded_model_path
from kvserve.testing.fleet import fleet, missing_router, served

RESULTS = Path(__file__).parent / "results"
DESKS = ("billing", "shipping", "returns", "warranty")
USERS_PER_DESK = 2
ROUNDS = 4
MAX_TOKENS = 16
# bench.client asks for model "bench"; smg routes on that name, so every replica serves it.
REPLICA_SETTINGS = {"model_alias": "bench", "threads": 1, "parallel": 8, "ctx_size": 2048, "prefix_state_mb": 30}
POLICIES = ("cache_aware", "round_robin")


def handbook(desk: str, lines: int = 24) -> str:
    """~550 tokens of one desk's rules; no two desks share a first token."""
    rules = [f"{desk} rule {i}: case type {i * 7 % 13} goes to queue {i % 9} within {i % 4 + 1} days."
             for i in range(lines)]
    return f"{desk.capitalize()} desk of Example Corp. Quote the rule that applies.\n" + "\n".join(rules)


async def desk_users(url: str) -> list[Result]:
    """Every user at once; each user's rounds one after another, users of a desk interleaved."""
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=64)) as client:
        async def user(desk: str, u: int) -> list[Result]:
            system = {"role": "system", "content": handbook(desk)}
            return [await stream_chat(client, url, [system, {"role": "user", "content": f"User {u}, case {r}?"}],
                                      MAX_TOKENS) for r in range(ROUNDS)]

        jobs = [lambda d=desk, u=u: user(d, u) for u in range(USERS_PER_DESK) for desk in DESKS]
        per_user = await gather_limited(jobs, len(jobs))
    return [result for results in per_user for result in results]


def summarize(policy: str, results: list[Result], per_replica: list[float]) -> dict:
    return {
        "policy": policy,
        "requests": len(results),
        "requests_per_replica": per_replica,
        "prompt_tokens": sum(r.prompt_tokens for r in results),
        "cached_tokens": sum(r.cached_tokens for r in results),
        "cached_ratio": sum(r.cached_tokens for r in results) / max(1, sum(r.prompt_tokens for r in results)),
        "ttft_p50": percentile([r.ttft for r in results], 0.5),
        "ttft_p95": percentile([r.ttft for r in results], 0.95),
        "errors": sum(r.error is not None for r in results),
    }


def main() -> str:
    if reason := missing_router("smg"):
        raise SystemExit(reason)
    rows = []
    for policy in POLICIES:
        logs = RESULTS / "fleet-logs" / policy
        with fleet(embedded_model_path(), logs, "smg", policy, REPLICA_SETTINGS) as f:
            results = asyncio.run(desk_users(f.url))
            rows.append(summarize(policy, results, [served(r) for r in f.replicas]))
    by = {r["policy"]: r for r in rows}
    attached = by["cache_aware"]["cached_tokens"] / max(1, by["round_robin"]["cached_tokens"])
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "fleet.json").write_text(json.dumps({"rows": rows, "cache_aware_over_round_robin": attached}, indent=2))
    table = markdown_table(
        ["smg policy", "requests per replica", "prompt tokens", "cached tokens", "cached / prompt", "TTFT p50 s",
         "TTFT p95 s", "errors"],
        [[r["policy"], " / ".join(f"{n:.0f}" for n in r["requests_per_replica"]), r["prompt_tokens"],
          r["cached_tokens"], f"{r['cached_ratio']:.0%}", r["ttft_p50"], r["ttft_p95"], r["errors"]] for r in rows],
    )
    summary = f"\n\ncache_aware attaches {attached:.2f}x the tokens round_robin does (target: 1.5x)"
    (RESULTS / "fleet.md").write_text(table + summary + "\n")
    return table + summary


if __name__ == "__main__":
    print(main())

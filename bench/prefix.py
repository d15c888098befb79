"""Issue 3's benchmark: a shared ~1,000-token system prompt, with and without the prefix cache.

- shared: 8 concurrent users, one system prompt, distinct questions, 3 rounds each; TTFT and the
  share of the system prompt served from cache after the first request;
- unique: 8 concurrent users with nothing in common (every prompt distinct): throughput with the
  cache on must match --no-prefix-cache (the cache costs nothing when it cannot help).

python -m bench prefix
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx

from bench.client import Result, stream_chat
from bench.servers import free_port, kvserve_command, running
from bench.stats import markdown_table, percentile

RESULTS = Path(__file__).parent / "results"
USERS = 8
ROUNDS = 3
MAX_TOKENS = 32


def system_prompt(words: int = 700) -> str:
    """~1,000 tokens of varied text (a policy handbook), the same for every user."""
    topics = ["billing", "shipping", "returns", "warranty", "privacy", "accounts", "security", "support"]
    lines = [f"Section {i}: the {topics[i % 8]} policy, clause {i * 7 % 13}, applies to case {i}."
             for i in range(words // 12)]
    return "You are the support assistant of Example Corp. Follow this handbook.\n" + "\n".join(lines)


async def users(url: str, messages_for) -> list[list[Result]]:
    """USERS concurrent users, each sending ROUNDS requests one after another."""
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=32)) as client:
        async def user(u: int) -> list[Result]:
            return [await stream_chat(client, url, messages_for(u, r), MAX_TOKENS) for r in range(ROUNDS)]

        return await asyncio.gather(*(user(u) for u in range(USERS)))


def shared_messages(system: str):
    return lambda u, r: [{"role": "system", "content": system},
                         {"role": "user", "content": f"User {u}, question {r}: which clause covers case {u * 3 + r}?"}]


def unique_messages(salt: str):
    """Prompts that share nothing with each other, nor with another call's (a different salt)."""
    return lambda u, r: [{"role": "user", "content": f"{salt} story {u}-{r}: "
                          + f"a tale of the number {u * 31 + r} and its {salt} friends. " * 40}]


def summarize(name: str, cache: bool, per_user: list[list[Result]], system_tokens: int) -> dict:
    results = [x for rounds in per_user for x in rounds]
    first_arrival = min(per_user, key=lambda rounds: rounds[0].ttft)[0]  # the request that filled the cache
    later = [x for x in results if x is not first_arrival]
    wall = max(sum(x.seconds for x in rounds) for rounds in per_user)
    return {
        "workload": name,
        "cache": cache,
        "ttft_p50": percentile([x.ttft for x in results], 0.5),
        "ttft_p95": percentile([x.ttft for x in results], 0.95),
        "output_tok_s": sum(x.output_tokens for x in results) / wall,
        "cached_share_after_first": (sum(x.cached_tokens for x in later) / (system_tokens * len(later))
                                     if system_tokens else 0.0),
        "cached_tokens": sum(x.cached_tokens for x in results),
        "prompt_tokens": sum(x.prompt_tokens for x in results),
        "errors": sum(x.error is not None for x in results),
    }


def system_token_count(url: str, system: str) -> int:
    """Tokens of the rendered system part: the prompt of a chat that is only the system message."""
    body = {"messages": [{"role": "system", "content": system}], "max_tokens": 1}
    return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=600).json()["usage"]["prompt_tokens"]


def main() -> str:
    system = system_prompt()
    rows = []
    for cache in (True, False):
        port = free_port()
        flags = [] if cache else ["--no-prefix-cache"]
        with running(kvserve_command(port, "--parallel", "16", *flags), port,
                     RESULTS / f"prefix-{'cache' if cache else 'nocache'}.log") as url:
            asyncio.run(users(url, unique_messages("warm-up")))  # shares nothing with what follows
            rows.append(summarize("unique", cache, asyncio.run(users(url, unique_messages("measured"))), 0))
            n_system = system_token_count(url, system)
            rows.append(summarize("shared", cache, asyncio.run(users(url, shared_messages(system))), n_system))
    by = {(r["workload"], r["cache"]): r for r in rows}
    ratios = {
        "shared_ttft_p50_speedup": by["shared", False]["ttft_p50"] / by["shared", True]["ttft_p50"],
        "shared_cached_share_after_first": by["shared", True]["cached_share_after_first"],
        "unique_throughput_ratio": by["unique", True]["output_tok_s"] / by["unique", False]["output_tok_s"],
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "prefix.json").write_text(json.dumps({"rows": rows, "ratios": ratios}, indent=2))
    table = markdown_table(
        ["workload", "prefix cache", "TTFT p50 s", "TTFT p95 s", "output tok/s", "cached / system prompt after 1st",
         "errors"],
        [[r["workload"], "on" if r["cache"] else "off", r["ttft_p50"], r["ttft_p95"], r["output_tok_s"],
          f"{r['cached_share_after_first']:.0%}" if r["workload"] == "shared" else "-", r["errors"]] for r in rows],
    )
    summary = (f"\n\nshared TTFT p50 speed-up: {ratios['shared_ttft_p50_speedup']:.1f}x; "
               f"cached share of the system prompt after the first request: "
               f"{ratios['shared_cached_share_after_first']:.0%}; "
               f"unique-prompt throughput, cache on / off: {ratios['unique_throughput_ratio']:.3f}")
    (RESULTS / "prefix.md").write_text(table + summary + "\n")
    return table + summary


if __name__ == "__main__":
    print(main())

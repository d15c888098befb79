"""The prefix benchmark: a shared ~1,000-token system prompt, with and without the prefix cache.

- shared: 8 concurrent users, one system prompt, distinct questions, 3 rounds each; TTFT and the
  share of the system prompt served from cache after the first request;
- unique: 8 concurrent users with nothing in common (every prompt distinct): throughput with the
  cache on must match --no-prefix-cache (the cache costs nothing when it cannot help).

python -m bench prefix
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx

from bench import workloads
from bench.stats import markdown_table, summarize
from bench.workloads import Run
from kvserve.testing import ServerProcess

RESULTS = Path(__file__).parent / "results"
ROUNDS = 3
MAX_TOKENS = 32


def summary(name: str, cache: bool, run: Run, system_tokens: int) -> dict:
    first_arrival = min(run.per_user, key=lambda rounds: rounds[0].ttft)[0]  # the request that filled the cache
    later = [x for x in run.results if x is not first_arrival]
    return {
        "workload": name,
        "cache": cache,
        **summarize(run.results, run.wall),
        "cached_share_after_first": (sum(x.cached_tokens or 0 for x in later) / (system_tokens * len(later))
                                     if system_tokens else 0.0),
    }


def system_token_count(url: str, system: str) -> int:
    """Tokens of the rendered system part: the prompt of a chat that is only the system message."""
    body = {"messages": [{"role": "system", "content": system}], "max_tokens": 1}
    return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=600).json()["usage"]["prompt_tokens"]


def main() -> str:
    rows = []
    for cache in (True, False):
        log = RESULTS / f"prefix-{'cache' if cache else 'nocache'}.log"
        with ServerProcess.kvserve(log, parallel=16, prefix_cache=cache) as server:
            server.wait_healthy()
            url = server.url
            # the warm-up shares nothing with what follows
            workloads.run_sync(url, workloads.unique("warm-up", rounds=ROUNDS), MAX_TOKENS)
            unique = workloads.run_sync(url, workloads.unique("measured", rounds=ROUNDS), MAX_TOKENS)
            rows.append(summary("unique", cache, unique, 0))
            n_system = system_token_count(url, workloads.system_prompt())
            shared = workloads.run_sync(url, workloads.shared(rounds=ROUNDS), MAX_TOKENS)
            rows.append(summary("shared", cache, shared, n_system))
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
    summary_line = (f"\n\nshared TTFT p50 speed-up: {ratios['shared_ttft_p50_speedup']:.1f}x; "
                    f"cached share of the system prompt after the first request: "
                    f"{ratios['shared_cached_share_after_first']:.0%}; "
                    f"unique-prompt throughput, cache on / off: {ratios['unique_throughput_ratio']:.3f}")
    (RESULTS / "prefix.md").write_text(table + summary_line + "\n")
    return table + summary_line


if __name__ == "__main__":
    print(main())

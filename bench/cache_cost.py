"""python -m bench cache-cost: what cold cached pages cost traffic that never reuses them.

Two kvservers, otherwise alike, one with the prefix cache and one with --no-prefix-cache, serve the
same unique-prompt traffic (`workloads.unique`: no request shares a page with another) twice:
- fresh: the first traffic each server sees;
- steady state: after a warm-up of other unique requests (twice --prefix-cache-cells of prompt
  tokens) has filled the page cache as far as pages nobody reuses may fill it (its cold cap, a
  quarter of --prefix-cache-cells), checked on /metrics before measuring, as on a server that has
  run a while.
The target: output tok/s with the cache on at least TARGET x with it off, both times (a cache that
costs nothing may also measure a little faster: that is noise, not a miss). Both servers are up
from the start and take turns, one idle while the other measures, so each pair of measurements is
taken back to back on the same machine load.

python -m bench cache-cost [--quick]
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path

from bench import compare, workloads
from bench.report import describe_machine, machine
from bench.stats import markdown_table, summarize
from kvserve.config import embedded_model_path
from kvserve.testing import ServerProcess, http_get, read_metrics

RESULTS = Path(__file__).parent / "results"
TARGET = 0.98
WARM_UP_FILL = 2  # warm-up prompt tokens, in caps: enough to fill the cache and then turn it over


@dataclass(frozen=True)
class Traffic:
    """What each measurement sends: `users` at once, `rounds` requests each, `max_tokens` long answers."""
    users: int = 8
    rounds: int = 2
    max_tokens: int = 64


QUICK = Traffic(users=4, rounds=1, max_tokens=16)


@dataclass(frozen=True)
class CacheFill:
    held_pages: int
    page_rows: int
    cap_cells: int  # --prefix-cache-cells
    cold_cap_cells: int  # what pages no request has reused may fill of it: all unique traffic donates

    @property
    def reached_cap(self) -> bool:
        """At least as many whole pages as the cold cap holds. A donation past it evicts pages down
        to it, but only pages no running request holds: while requests run it may stay above."""
        return self.held_pages >= self.cold_cap_cells // self.page_rows


def cache_fill(url: str) -> CacheFill:
    status, body = http_get(f"{url}/server_info")
    if status != 200:
        raise RuntimeError(f"{url}/server_info answered {status}")
    cache = json.loads(body)["cache"]
    held = read_metrics(url).value("kvserve_prefix_cache_held_pages")
    return CacheFill(held_pages=int(held), page_rows=cache["page_rows"], cap_cells=cache["prefix_cache_cells"],
                     cold_cap_cells=cache["prefix_cache_cold_cells"])


def measure(url: str, phase: str, cache: bool, traffic: Traffic, extra: dict) -> dict:
    workload = workloads.unique(phase, users=traffic.users, rounds=traffic.rounds)
    run = workloads.run_sync(url, workload, traffic.max_tokens, extra)
    row = {"phase": phase, "cache": cache, **summarize(run.results, run.wall)}
    print(f"{phase:>7} cache {'on ' if cache else 'off'}: {row['output_tok_s']:.2f} tok/s, "
          f"ITL p95 {row['itl_p95'] * 1000:.0f} ms, {row['errors']} errors {row['first_error'] or ''}", flush=True)
    return row


def warm_up(url: str, cells: int, users: int, extra: dict) -> int:
    """Unique one-token requests, `users` at a time, until their prompts add up to WARM_UP_FILL x
    `cells`; the prompt tokens sent. Every prompt is donated to the cache as soon as it is evaluated."""
    sent = 0
    while sent < WARM_UP_FILL * cells:
        run = workloads.run_sync(url, workloads.unique(f"warm-up {sent}", users=users, rounds=1), 1, extra)
        failed = [r.error for r in run.results if r.error]
        if failed:
            raise RuntimeError(f"warm-up request failed: {failed[0]}")
        sent += sum(r.prompt_tokens for r in run.results)
    return sent


def ratios(rows: list[dict]) -> dict[str, dict]:
    """Per phase: output tok/s with the cache on over off, and whether it meets TARGET."""
    by = {(r["phase"], r["cache"]): r["output_tok_s"] for r in rows}
    out = {}
    for phase in dict.fromkeys(r["phase"] for r in rows):
        ratio = by[phase, True] / by[phase, False] if by[phase, False] else float("nan")
        out[phase] = {"ratio": ratio, "met": ratio >= TARGET}
    return out


def run(model: Path, traffic: Traffic, results: Path = RESULTS, **settings: object) -> dict:
    """Both measurements on a cache-on and a cache-off kvserve with `settings` (kvserve_command's)."""
    extra = {"logit_bias": compare.end_of_generation_bias(model)}
    with contextlib.ExitStack() as stack:
        servers = {cache: stack.enter_context(ServerProcess.kvserve(
            results / f"cache-cost-{'on' if cache else 'off'}.log", model=model, prefix_cache=cache, **settings))
            for cache in (True, False)}
        for server in servers.values():
            server.wait_healthy()
        rows = [measure(server.url, "fresh", cache, traffic, extra) for cache, server in servers.items()]
        cap = cache_fill(servers[True].url).cap_cells
        warm_up_tokens = {cache: warm_up(server.url, cap, traffic.users, extra) for cache, server in servers.items()}
        filled = cache_fill(servers[True].url)
        if not filled.reached_cap:
            raise RuntimeError(f"the warm-up left the cache below its cap: {filled} (a cap past the context's "
                               f"bound is cut, as {servers[True].log} says)")
        rows += [measure(server.url, "steady", cache, traffic, extra) for cache, server in servers.items()]
        after = cache_fill(servers[True].url)
    return {"machine": machine(), "settings": {"model": model.name, **settings}, "traffic": asdict(traffic),
            "warm_up_prompt_tokens": warm_up_tokens[True], "cache_before_steady": asdict(filled),
            "cache_after_steady": asdict(after),
            "rows": rows, "ratios": ratios(rows)}


def markdown(result: dict) -> str:
    t, before = result["traffic"], result["cache_before_steady"]
    header = (f"{describe_machine(result['machine'])}; {result['settings']['model']}; {t['users']} users x "
              f"{t['rounds']} rounds of unique prompts, {t['max_tokens']} output tokens each. Steady state: after "
              f"{result['warm_up_prompt_tokens']} warm-up prompt tokens, the cache held {before['held_pages']} pages "
              f"x {before['page_rows']} rows: its cap for pages nobody reused, {before['cold_cap_cells']} cells of "
              f"{before['cap_cells']}.")
    table = markdown_table(
        ["phase", "prefix cache", "output tok/s", "TTFT p50 s", "ITL p50 ms", "ITL p95 ms", "errors"],
        [[r["phase"], "on" if r["cache"] else "off", r["output_tok_s"], r["ttft_p50"], r["itl_p50"] * 1000,
          r["itl_p95"] * 1000, r["errors"]] for r in result["rows"]])
    goals = markdown_table(
        ["phase", "output tok/s, cache on / off", f"met (≥ {TARGET:g})"],
        [[phase, f"{r['ratio']:.3f}", "yes" if r["met"] else "**no**"] for phase, r in result["ratios"].items()])
    return f"{header}\n\n{table}\n\n{goals}"


def main(quick: bool = False) -> str:
    """Default kvserve settings on the default model; writes bench/results/cache-cost.{json,md}."""
    # quick: a smaller cap, so that the warm-up takes seconds
    settings = {"prefix_cache_cells": 1024} if quick else {}
    result = run(embedded_model_path(), QUICK if quick else Traffic(), **settings)
    name = "cache-cost-partial" if quick else "cache-cost"
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps(result, indent=2) + "\n")
    text = markdown(result)
    (RESULTS / f"{name}.md").write_text(text + "\n")
    return text

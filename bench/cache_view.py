"""python -m bench cache-view: the cache view's cost with 10,000 cached pages.

A kvserve on a tiny random-weight llama (the model does not matter here, only what the cache holds)
is filled with 1,000 distinct 160-token prompts: 1,000 chains of 10 pages of 16 rows. Then it times
GET /v1/cache and GET /metrics, and, where Playwright and Debian's chromium are installed, what
/ui/cache reports for its refreshes: the time to read both and the time its script takes to
rebuild the page from them (layout and paint come after). Writes bench/results/cache_view.{json,md}.
"""

from __future__ import annotations

import json
import random
import re
import shutil
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from kvserve.testing import ServerProcess
from kvserve.testing.tiny_models import tiny_model

RESULTS = Path(__file__).parent / "results"
PROMPTS, PROMPT_TOKENS, PAGE_ROWS = 1_000, 160, 16
CALLS = 20


def _fill(url: str) -> None:
    rng = random.Random(0)
    prompts = [[rng.randrange(1000, 30000) for _ in range(PROMPT_TOKENS)] for _ in range(PROMPTS)]

    def send(prompt: list[int]) -> None:
        answer = httpx.post(f"{url}/v1/completions", json={"prompt": prompt, "max_tokens": 1}, timeout=300)
        answer.raise_for_status()

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(send, prompts))


def _timed_get(url: str) -> tuple[float, int]:
    started = time.perf_counter()
    answer = httpx.get(url, timeout=60)
    answer.raise_for_status()
    return (time.perf_counter() - started) * 1000, len(answer.content)


def _browser_refreshes(url: str, count: int = 5) -> list[tuple[int, int]] | None:
    """(read ms, drawn ms) of `count` refreshes of /ui/cache, or None without a browser."""
    chromium = shutil.which("chromium")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        return None
    if chromium is None:
        return None
    seen: list[tuple[int, int]] = []
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium, headless=True,
                                             args=["--no-sandbox", "--disable-gpu", "--disable-background-networking"])
        page = browser.new_page()
        page.goto(f"{url}/ui/cache")
        last = ""
        while len(seen) < count:
            page.locator("#updated", has_text="drawn in").wait_for()
            text = page.inner_text("#updated")
            if text != last:
                last = text
                read, drawn = map(int, re.search(r"read in (\d+) ms, drawn in (\d+) ms", text).groups())
                seen.append((read, drawn))
            page.wait_for_timeout(500)
        browser.close()
    return seen


def main() -> str:
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(scratch)
        model = tiny_model("llama", root)
        with ServerProcess.kvserve(root / "kvserve.log", model=model, threads=2, parallel=8, ctx_size=1024,
                                   page_rows=PAGE_ROWS, prefix_state_mb=4096) as server:
            server.wait_healthy()
            _fill(server.url)
            view = httpx.get(f"{server.url}/v1/cache", timeout=60).json()
            cache = [_timed_get(f"{server.url}/v1/cache") for _ in range(CALLS)]
            metrics = [_timed_get(f"{server.url}/metrics") for _ in range(CALLS)]
            refreshes = _browser_refreshes(server.url)
    result = {
        "held_pages": view["held_pages"], "chains": len(view["chains"]),
        "cache_ms_median": statistics.median(ms for ms, _ in cache), "cache_bytes": cache[-1][1],
        "metrics_ms_median": statistics.median(ms for ms, _ in metrics),
        "page_read_ms_median": statistics.median(r for r, _ in refreshes) if refreshes else None,
        "page_drawn_ms_median": statistics.median(d for _, d in refreshes) if refreshes else None,
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "cache_view.json").write_text(json.dumps(result, indent=2) + "\n")
    table = "\n".join(f"| {name} | {value} |" for name, value in result.items())
    report = f"# Cache view with {result['held_pages']:,} cached pages\n\n| what | value |\n|---|---|\n{table}\n"
    (RESULTS / "cache_view.md").write_text(report)
    return report

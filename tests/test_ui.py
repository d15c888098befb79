"""The playground (/) and the live cache view (/ui/cache) in a real headless Chromium against a live
kvserve: Debian's `chromium`, driven by Playwright's Python package (no browser download). Where
Chromium is missing these tests skip; `make test` installs it when it runs as root.

KVSERVE_SCREENSHOTS=docs/images pytest tests/test_ui.py rewrites the README's screenshots."""

from __future__ import annotations

import json
import os
import random
import re
import shutil
from pathlib import Path
from typing import Iterable, Iterator

import httpx
import pytest

from conftest import serve, served

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = pytest.mark.skipif(
    CHROMIUM is None, reason="Chromium is not installed (Debian: apt-get install chromium; make test does it as root)")

# Headless and offline: no sandbox (root in a container), no GPU, nothing fetched in the background.
# Playwright gives each launch a fresh, temporary --user-data-dir of its own.
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
SYSTEM = ("You are the archivist of a large library. Answer with the shelf number and nothing else. " * 3).strip()
KEY = "sesame"
SCREENSHOTS = os.environ.get("KVSERVE_SCREENSHOTS")
WAIT_MS = 120_000  # how long a wait may last before it fails (a loaded 2-core machine answers slowly)


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        yield chromium
        chromium.close()


def _new_page(browser):
    """A page in a context of its own (fresh storage); its uncaught errors and policy violations kept."""
    context = browser.new_context(viewport={"width": 1280, "height": 760})
    context.set_default_timeout(WAIT_MS)
    page = context.new_page()
    page.problems = []
    page.on("pageerror", lambda error: page.problems.append(str(error)))
    page.on("console", lambda m: page.problems.append(m.text) if "Content Security Policy" in m.text else None)
    return context, page


@pytest.fixture
def page(browser):
    context, page = _new_page(browser)
    yield page
    context.close()
    assert page.problems == []


@pytest.fixture(scope="module")
def url(smollm2) -> Iterator[str]:
    with serve(smollm2, parallel=4, threads=1) as base:
        yield base


def _screenshot(page, name: str) -> None:
    if SCREENSHOTS:
        page.screenshot(path=str(Path(SCREENSHOTS) / name))


def _sse_lines(lines: Iterable[str]) -> Iterator[dict]:
    return (json.loads(line[6:]) for line in lines if line.startswith("data: ") and line != "data: [DONE]")


def _sse(body: bytes) -> list[dict]:
    return list(_sse_lines(body.decode().splitlines()))


def _send(page, text: str) -> dict:
    """Send `text` from the composer; returns what the page shows of the answer and what the API sent."""
    with page.expect_response(lambda r: r.url.endswith("/v1/chat/completions")) as answered:
        page.fill("#prompt", text)
        page.press("#prompt", "Enter")
    response = answered.value
    answer = page.locator(".message.assistant[data-done]").last
    answer.wait_for()
    stats = {s.get_attribute("data-stat"): s.inner_text() for s in answer.locator(".stats [data-stat]").all()}
    return {"request": response.request.post_data_json, "content_type": response.headers["content-type"],
            "events": _sse(response.body()), "shown": answer.locator(".content").inner_text(), "stats": stats}


@pytest.fixture(scope="module")
def chat(browser, url: str) -> Iterator[tuple[dict, dict]]:
    """Two conversations in the playground with one system prompt: the answers to their first messages."""
    context, page = _new_page(browser)
    page.goto(f"{url}/")
    page.fill("#system", SYSTEM)
    page.fill("#temperature", "0")
    page.fill("#max_tokens", "12")
    first = _send(page, "Where is Dune?")
    page.click("#new-chat")
    second = _send(page, "Where is Emma?")
    _screenshot(page, "playground.png")
    yield first, second
    context.close()
    assert page.problems == []


def _streamed_text(events: list[dict]) -> str:
    return "".join(e["choices"][0]["delta"].get("content", "") for e in events if e["choices"])


def _usage(events: list[dict]) -> dict:
    (usage,) = [e["usage"] for e in events if e.get("usage")]
    return usage


def test_a_message_streams_its_answer(chat) -> None:
    first, _ = chat
    assert first["request"]["stream"] is True and first["request"]["messages"][0] == {"role": "system", "content": SYSTEM}
    assert first["content_type"].startswith("text/event-stream")
    pieces = [e for e in first["events"] if e["choices"] and e["choices"][0]["delta"].get("content")]
    assert len(pieces) > 1  # the answer came in pieces, and the page shows all of them, in order
    assert first["shown"] == _streamed_text(first["events"]).strip() != ""
    usage = _usage(first["events"])
    assert first["stats"]["prompt"] == f"{usage['prompt_tokens']} prompt tokens"
    assert first["stats"]["cached"] == "0 cached"
    assert re.fullmatch(r"TTFT \d+ ms", first["stats"]["ttft"]) and re.fullmatch(r"[\d.]+ tok/s", first["stats"]["speed"])


def test_a_second_conversation_with_the_same_system_prompt_shows_cached_tokens(chat) -> None:
    _, second = chat
    assert [m["role"] for m in second["request"]["messages"]] == ["system", "user"]  # a new conversation
    cached = _usage(second["events"])["prompt_tokens_details"]["cached_tokens"]
    assert cached >= 48  # the system prompt's tokens, at least
    assert second["stats"]["cached"] == f"{cached} cached"


def test_the_cache_view_shows_the_chain_and_the_streams(chat, page, url: str) -> None:
    page.goto(f"{url}/ui/cache")
    chain = page.locator("tr.chain", has_text="Where is Emma?")
    chain.wait_for()
    tokens = int(chain.locator("td.tokens").inner_text())
    assert tokens >= 48 and tokens % 16 == 0  # whole pages of --page-rows 16
    view = httpx.get(f"{url}/v1/cache").json()
    assert any("Where is Emma?" in c["preview"] and c["tokens"] == tokens and c["bytes"] > 0 for c in view["chains"])
    streams = page.locator("#streams .stream")
    assert streams.count() == 4  # --parallel 4
    assert page.locator("#streams .stream.resident").count() >= 1  # a finished conversation keeps its rows
    assert re.search(r"of 64 MiB \(--prefix-state-mb\)", page.inner_text("#store-text"))
    assert re.fullmatch(r"since start: [1-9]\d* of \d+ prompt tokens from the cache \([\d.]+%\) · \d+ in-place reuses "
                        r"\(\d+ tokens kept in place\)", page.inner_text("#total-text"))
    # A request while the view is open shows in its last minutes, with the tokens the API says it reused.
    answer = httpx.post(f"{url}/v1/chat/completions", timeout=600, json={
        "max_tokens": 2, "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Where is Ivanhoe?"}]})
    usage = answer.json()["usage"]
    rate = page.locator("#rate-text", has_text=re.compile(rf"hit rate [\d.]+% of {usage['prompt_tokens']} prompt tokens"))
    rate.wait_for()
    shown = float(re.search(r"hit rate ([\d.]+)%", rate.inner_text())[1])
    assert shown == pytest.approx(100 * usage["prompt_tokens_details"]["cached_tokens"] / usage["prompt_tokens"], abs=0.05)
    assert shown > 0
    _screenshot(page, "cache.png")


def test_the_cache_view_shows_a_running_request_as_a_live_stream(chat, page, url: str) -> None:
    body = {"max_tokens": 2000, "ignore_eos": True, "stream": True, "prompt": "One, two, three,"}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=600) as running:
        events = _sse_lines(running.iter_lines())  # held: closing it would close the stream, and end the request
        next(e for e in events if e["choices"][0]["text"])  # it decodes
        page.goto(f"{url}/ui/cache")
        live = page.locator("#streams .stream.live")
        live.wait_for()
        assert live.count() == 1 and int(live.locator(".tokens").inner_text().split()[0]) > 0
    # the client left: the server frees the stream within a step, and the view shows it idle again
    page.locator("#streams .stream.live").wait_for(state="detached")


def test_the_playground_shows_tool_calls_as_calls_and_reasoning_folded(page, url: str) -> None:
    """What the API streams for a tool call and for reasoning (answered here by the test, as the
    served model does neither), drawn as a call and as a closed block."""
    head = {"id": "c", "object": "chat.completion.chunk", "created": 0, "model": "m"}
    deltas = [{"role": "assistant", "content": ""}, {"reasoning_content": "The user wants "},
              {"reasoning_content": "the weather."},
              {"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                               "function": {"name": "get_weather", "arguments": ""}}]},
              {"tool_calls": [{"index": 0, "function": {"arguments": '{"city": '}}]},
              {"tool_calls": [{"index": 0, "function": {"arguments": '"Paris"}'}}]}]
    chunks = [{**head, "choices": [{"index": 0, "delta": d, "finish_reason": None}]} for d in deltas]
    chunks.append({**head, "choices": [], "usage": {"prompt_tokens": 30, "completion_tokens": 12, "total_tokens": 42,
                                                    "prompt_tokens_details": {"cached_tokens": 16}}})
    sse = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
    page.route("**/v1/chat/completions", lambda route: route.fulfill(body=sse, content_type="text/event-stream"))
    page.goto(f"{url}/")
    page.fill("#prompt", "Weather in Paris?")
    page.press("#prompt", "Enter")
    answer = page.locator(".message.assistant[data-done]")
    answer.wait_for()
    assert answer.locator(".tool-call").inner_text() == 'get_weather({"city": "Paris"})'
    reasoning = answer.locator("details.reasoning")
    assert reasoning.get_attribute("open") is None and reasoning.locator("summary").inner_text() == "reasoning"
    reasoning.locator("summary").click()
    assert reasoning.locator("div").inner_text() == "The user wants the weather."
    assert answer.locator("[data-stat=cached]").inner_text() == "16 cached"
    page.reload()  # kept in the browser: the conversation, its call and its numbers come back
    assert page.locator(".message.assistant .tool-call").inner_text() == 'get_weather({"city": "Paris"})'
    assert page.locator(".message.assistant [data-stat=prompt]").inner_text() == "30 prompt tokens"


def _big_cache(chains: int) -> dict:
    rng = random.Random(7)
    return {
        "page_rows": 16, "enabled": True, "held_pages": chains, "held_bytes": 3 << 30, "budget_bytes": 4 << 30,
        "chains": [{"id": i, "tokens": 16 * rng.randint(1, 200), "pages_alive": 1, "bytes": 1 << 20,
                    "hits": rng.randint(0, 1000), "preview": f"chain {i}"} for i in range(chains)],
        "pool": {"cells": 8 * 4096, "used_cells": 0, "streams": 8, "free_streams": 8, "inplace_reuses": 0,
                 "stream_cells": 4096, "stream_states": [{"seq": s, "state": "empty", "tokens": 0} for s in range(8)]},
    }


def test_the_cache_view_draws_only_the_top_chains_of_ten_thousand(page, url: str) -> None:
    big = _big_cache(10_000)
    page.route("**/v1/cache", lambda route: route.fulfill(json=big))
    page.goto(f"{url}/ui/cache")
    page.locator("#chains-count", has_text=re.compile("^10000 chains")).wait_for()
    rows = page.locator("tr.chain")
    assert rows.count() == 20
    best = sorted(big["chains"], key=lambda c: (-c["hits"], -c["tokens"]))[:20]
    assert [int(h) for h in rows.locator("td.hits").all_inner_texts()] == [c["hits"] for c in best]
    assert rows.locator("td.preview").all_inner_texts() == [c["preview"] for c in best]
    assert re.search(r"read in \d+ ms, drawn in \d+ ms$", page.inner_text("#updated"))  # what bench cache-view reads


def test_the_cache_view_shows_the_disk_tier(page, tiny, tmp_path: Path) -> None:
    with served(tiny("llama"), threads=1, prefix_disk_dir=tmp_path, prefix_disk_mb=64) as (base, app):
        page.goto(f"{base}/ui/cache")
        page.locator("body[data-refreshes]").wait_for(state="attached")
        assert page.locator("#store-text").inner_text() and not page.locator("#disk").is_hidden()
        httpx.post(f"{base}/v1/completions", timeout=600, json={"prompt": "the archive " * 40, "max_tokens": 1})
        assert app.state.models.persistence.disk.flush(30)
        pages = app.state.models.persistence.disk.stats().pages
        assert pages > 0
        text = page.locator("#disk-text", has_text=re.compile(rf"of 48 MiB \(the pages' share of --prefix-disk-mb\) · {pages} pages"))
        text.wait_for()
        assert re.search(r"0 refused · 0 writes dropped · 0 evicted · "
                         r"runs \(long prompts in one file\): 0, 0 B of 16 MiB, 0 restored \(0 from memory\), 0 refused$", text.inner_text())


def test_the_cache_view_shows_what_each_drafter_drafted_and_gained(page, smollm2: Path) -> None:
    """A prediction the answer follows is drafted (`ngram` drafts it whatever the step costs): the
    view shows its drafted and accepted tokens as /server_info counts them, and its measured tokens
    per second against the undrafted steps'."""
    with serve(smollm2, speculative="ngram", parallel=2, threads=1) as base:
        body = {"messages": [{"role": "user", "content": "Say: the quick brown fox jumps over the lazy dog"}],
                "max_tokens": 16, "temperature": 0}
        text = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=600).json()["choices"][0]["message"]["content"]
        httpx.post(f"{base}/v1/chat/completions", timeout=600,
                   json={**body, "prediction": {"type": "content", "content": text}}).raise_for_status()
        spec = httpx.get(f"{base}/server_info").json()["speculative"]
        drafted = spec["by_drafter"]["prediction"]
        assert drafted["accepted"] > 0 and drafted["tokens_per_second"] > 0 and spec["undrafted_tokens_per_second"] > 0
        page.goto(f"{base}/ui/cache")
        row = page.locator("tr.drafter[data-drafter=prediction]")
        row.wait_for()
        assert row.locator("td.drafted").inner_text() == str(drafted["drafted"])
        assert row.locator("td.accepted").inner_text().startswith(f"{drafted['accepted']} (")
        assert float(row.locator("td.speed").inner_text().removesuffix(" tok/s")) == drafted["tokens_per_second"]
        gained = drafted["tokens_per_second"] - spec["undrafted_tokens_per_second"]
        assert row.locator("td.gained").inner_text() == f"{'+' if gained >= 0 else '−'}{abs(gained):.2f} tok/s"
        assert page.locator("#spec-text").inner_text().startswith("--speculative ngram, up to 16 tokens a draft")
        assert "1: " in page.locator("#spec-prices").inner_text()


def test_the_cache_view_says_when_speculation_is_off(page, tiny) -> None:
    with serve(tiny("llama"), threads=1, speculative="off") as base:  # off asked for, whatever the default
        page.goto(f"{base}/ui/cache")
        page.locator("#spec-text", has_text="off (--speculative off").wait_for()
        assert page.locator("#spec-table").is_hidden()


# --- --api-key and --no-ui -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def keyed(tiny) -> Iterator[str]:
    with serve(tiny("llama"), api_key=KEY, threads=1) as base:
        yield base


def test_with_an_api_key_the_page_asks_for_it(page, keyed: str) -> None:
    page.goto(f"{keyed}/")  # the page itself is public; the API behind it is not
    dialog = page.locator("#key-dialog")
    dialog.wait_for()
    assert "needs an API key" in dialog.inner_text()
    page.fill("#key-dialog input", "wrong")
    page.press("#key-dialog input", "Enter")
    page.locator("#key-dialog", has_text="refused").wait_for()
    page.fill("#key-dialog input", KEY)
    page.press("#key-dialog input", "Enter")
    page.locator("#model", has_text="tiny-llama").wait_for()
    assert not dialog.is_visible()
    assert page.evaluate("sessionStorage.getItem('kvserve.apiKey')") == KEY
    page.goto(f"{keyed}/ui/cache")  # the same tab keeps the key: no second question
    page.locator("body[data-refreshes]").wait_for(state="attached")
    assert not dialog.is_visible()
    page.problems = [p for p in page.problems if "401" not in p]


def test_no_ui_serves_neither_page_and_the_api_is_unchanged(tiny) -> None:
    with served(tiny("llama"), ui=False) as (base, app):
        for path in ("/", "/ui/cache", "/ui/static/api.js"):
            assert httpx.get(f"{base}{path}").status_code == 404, path
        assert httpx.get(f"{base}/health").status_code == 200
        without_ui = set(app.openapi()["paths"])
    with served(tiny("llama")) as (base, app):
        for path in ("/", "/ui/cache", "/ui/static/playground.js"):
            assert httpx.get(f"{base}{path}").status_code == 200, path
        assert set(app.openapi()["paths"]) == without_ui  # the pages are not API


def test_with_several_models_the_pages_pick_one(page, tiny, smollm2: Path, tmp_path: Path) -> None:
    """The playground lists the chat models of /v1/models and sends to the one picked; the cache view
    shows a loaded model's cache, picked among the loaded ones."""
    folder = tmp_path / "models"
    folder.mkdir()
    (folder / "smollm2.gguf").symlink_to(smollm2)
    (folder / "tiny-llama.gguf").symlink_to(tiny("llama"))
    with served(None, models_dir=folder, parallel=2, ctx_size=512, threads=1, prefix_state_mb=16) as (base, _):
        page.goto(f"{base}/")
        picker = page.locator("#model")
        picker.locator("option", has_text="tiny-llama (unloaded)").wait_for(state="attached")
        assert picker.locator("option").all_inner_texts() == ["smollm2 (unloaded)", "tiny-llama (unloaded)"]
        picker.select_option("tiny-llama")
        page.fill("#max_tokens", "4")
        sent = _send(page, "Hello")
        assert sent["request"]["model"] == "tiny-llama"
        assert {e["model"] for e in sent["events"]} == {"tiny-llama"}
        loaded = {m["id"]: m["status"]["value"] for m in httpx.get(f"{base}/v1/models").json()["data"]}
        assert loaded == {"smollm2": "unloaded", "tiny-llama": "loaded"}
        page.reload()
        assert page.locator("#model").input_value() == "tiny-llama"  # the pick is remembered
        page.goto(f"{base}/ui/cache")
        page.locator("body[data-refreshes]").wait_for(state="attached")
        cache_picker = page.locator("#model")
        assert cache_picker.is_visible() and cache_picker.locator("option").all_inner_texts() == ["tiny-llama"]
        page.locator("#store-text", has_text=re.compile(r"\S")).wait_for()
        assert "not updated" not in page.locator("#updated").inner_text()

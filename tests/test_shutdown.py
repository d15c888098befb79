"""SIGTERM drains, a second signal cuts the drain: a real `python -m kvserve` process, its JSON logs, its keys
and its exit status."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
from pathlib import Path

import anthropic
import httpx
import openai

from kvserve.server.errors import SHUTTING_DOWN
from kvserve.testing import ServerProcess, free_port, read_metrics, wait_until

KEY = "sk-very-secret-9f8e7d"


async def _stream(client: httpx.AsyncClient, url: str, body: dict, started: asyncio.Event) -> list[str]:
    """The SSE data lines of one streamed completion."""
    lines: list[str] = []
    async with client.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                lines.append(line.removeprefix("data: "))
                started.set()
    return lines


def _draining(log: Path) -> bool:
    """The server has logged that it drains, so SIGTERM has been handled (a substring test: the
    line being written may be read half-way)."""
    return '"message": "draining:' in log.read_text()


async def _drain_scenario(server: ServerProcess) -> tuple[list[str], list[str], httpx.Response, int]:
    url = server.url
    headers = {"Authorization": f"Bearer {KEY}", "X-Request-Id": "drain-test-1"}
    async with httpx.AsyncClient(timeout=60, headers=headers) as client:
        short_started, long_started = asyncio.Event(), asyncio.Event()
        short = asyncio.create_task(_stream(client, url, {"prompt": "hi", "max_tokens": 40, "ignore_eos": True},
                                            short_started))
        long = asyncio.create_task(_stream(client, url, {"prompt": "hi", "max_tokens": 4000, "ignore_eos": True},
                                           long_started))
        await asyncio.wait_for(asyncio.gather(short_started.wait(), long_started.wait()), 30)
        server.terminate()
        await asyncio.to_thread(wait_until, lambda: _draining(server.log), 30, "the server logging that it drains")
        refused = await client.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        health = (await client.get(f"{url}/health")).status_code
        return await short, await long, refused, health


def test_sigterm_lets_streams_finish_or_end_with_an_error_then_exits_0(tiny, tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text(f"# one key per line\n{KEY}\nsk-another\n")
    log = tmp_path / "kvserve.log"
    with ServerProcess.kvserve(log, model=tiny("llama"), threads=1, parallel=2, drain_timeout=1,
                               api_key_file=keys, log_format="json") as server:
        server.wait_healthy()
        short, long, refused, health = asyncio.run(_drain_scenario(server))
        assert server.wait(timeout=30) == 0

    assert short[-1] == "[DONE]" and json.loads(short[-2])["choices"][0]["finish_reason"] == "length"
    cut = json.loads(long[-2])["error"]
    assert long[-1] == "[DONE]" and "shutting down" in cut["message"] and cut["code"] == "shutting_down"
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "shutting_down"
    assert health == 503

    text = log.read_text()
    records = [json.loads(line) for line in text.splitlines()]  # every line is a JSON object
    assert any(r["request_id"] == "drain-test-1" for r in records)
    assert KEY not in text and "sk-another" not in text


async def _swap_scenario(server: ServerProcess) -> tuple[list[str], httpx.Response]:
    """A stream on one model, a request for another that waits for room (`--models-max 1`), then
    SIGTERM: the stream's lines and the waiting request's answer."""
    async with httpx.AsyncClient(timeout=60) as client:
        started = asyncio.Event()
        body = {"model": "smollm2", "prompt": "hi", "max_tokens": 120, "ignore_eos": True}
        stream = asyncio.create_task(_stream(client, server.url, body, started))
        await asyncio.wait_for(started.wait(), 60)
        waiting = asyncio.create_task(client.post(f"{server.url}/v1/completions",
                                                  json={"model": "tiny", "prompt": "hi", "max_tokens": 2}))
        await asyncio.sleep(0.5)  # it waits for smollm2's lease to end
        server.terminate()
        return await stream, await waiting


def test_sigterm_while_a_request_waits_for_a_model_swap_exits_0_and_loads_nothing(
        smollm2: Path, tiny, tmp_path: Path) -> None:
    """The drain waits for the model serving; the request waiting to swap models gets a 503 at once,
    no model loads after SIGTERM, and the server exits. (A swap once unloaded the draining engine
    under the drain, whose task died on the engine's closed thread: the server never exited.)"""
    folder = tmp_path / "models"
    folder.mkdir()
    (folder / "smollm2.gguf").symlink_to(smollm2)
    (folder / "tiny.gguf").symlink_to(tiny("llama"))
    log = tmp_path / "kvserve.log"
    with ServerProcess.kvserve(log, models_dir=folder, models_max=1, threads=1, parallel=2, ctx_size=512,
                               drain_timeout=30) as server:
        server.wait_healthy()
        assert httpx.post(f"{server.url}/models/load", json={"model": "smollm2"}, timeout=120).status_code == 200
        lines, waiting = asyncio.run(_swap_scenario(server))
        assert server.wait(timeout=60) == 0
    assert lines[-1] == "[DONE]" and json.loads(lines[-2])["choices"][0]["finish_reason"] == "length"
    assert waiting.status_code == 503 and waiting.json()["error"]["code"] == "shutting_down"
    text = log.read_text()
    assert "loading model tiny" not in text and "Traceback" not in text and "never retrieved" not in text


LONG = {"model": "m", "max_tokens": 4000, "messages": [{"role": "user", "content": "hi"}]}


async def _interrupted_twice(server: ServerProcess) -> list[BaseException | None]:
    """Four requests in flight (OpenAI and Anthropic, streamed and whole), Ctrl-C, and Ctrl-C again
    as the server drains: what each client raised (None: it finished)."""
    oai = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=60)
    claude = anthropic.AsyncAnthropic(base_url=server.url, api_key="x", max_retries=0, timeout=60)

    async def streamed_chat() -> None:
        async for _ in await oai.chat.completions.create(**LONG, stream=True, extra_body={"ignore_eos": True}):
            pass

    async def streamed_message() -> None:
        async with claude.messages.stream(**LONG) as events:
            async for _ in events:
                pass

    calls = [streamed_chat(), streamed_message(), oai.chat.completions.create(**LONG, extra_body={"ignore_eos": True}),
             claude.messages.create(**LONG)]
    tasks = [asyncio.create_task(call) for call in calls]
    await asyncio.to_thread(wait_until, lambda: read_metrics(server.url).value("kvserve_requests_running") == 4, 30,
                            "four requests running")
    server.interrupt()
    await asyncio.to_thread(wait_until, lambda: "draining:" in server.log.read_text(), 30, "the server draining")
    server.interrupt()
    results = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 15)  # not the drain's 60 s
    return [r if isinstance(r, BaseException) else None for r in results]


def test_a_second_ctrl_c_fails_what_is_in_flight_at_once_and_exits_130(tiny, tmp_path: Path) -> None:
    """The first Ctrl-C drains; the second fails every request in flight with a 503 `shutting_down` in
    its API's shape (a stream: its error event), then the server shuts down as after a drain and
    exits 130, as a shell reports an interrupted process. It once quit with no shutdown at all: the
    requests' tasks were cancelled (a plain-text 500, a cut stream, tracebacks) and it exited 0."""
    log = tmp_path / "kvserve.log"
    with ServerProcess.kvserve(log, model=tiny("llama"), threads=1, parallel=4, drain_timeout=60) as server:
        server.wait_healthy()
        chat_stream, message_stream, chat, message = asyncio.run(_interrupted_twice(server))
        assert server.wait(timeout=30) == 130

    for failed in (chat_stream, chat):  # a stream's error chunk, or the 503 before any
        assert isinstance(failed, openai.APIError) and failed.code == "shutting_down", repr(failed)
    assert isinstance(chat, openai.InternalServerError) and chat.status_code == 503
    for failed in (message_stream, message):
        assert isinstance(failed, anthropic.APIStatusError), repr(failed)
        assert failed.body["error"] == {"type": "overloaded_error", "message": SHUTTING_DOWN}
    assert message.status_code == 503
    text = log.read_text()
    assert "drained; 4 requests were cut short" in text and "Application shutdown complete" in text
    assert "Traceback" not in text and "Exception in ASGI" not in text


def test_a_signal_while_the_model_loads_exits_at_once_with_one_line(smollm2: Path, tmp_path: Path) -> None:
    """llama.cpp's load cannot be interrupted, and nothing waits for it: SIGTERM as the model starts
    loading ends the process at once, 143, one line. (The server once loaded the whole model, then
    shut down and exited 0.)"""
    log = tmp_path / "kvserve.log"
    with ServerProcess.kvserve(log, model=smollm2, threads=1, ctx_size=512) as server:
        server.wait_for(lambda: "loading model" in log.read_text(), "the load beginning", timeout=60)
        server.terminate()
        assert server.wait(timeout=10) == 143
    text = log.read_text()
    assert text.splitlines()[-1].endswith("SIGTERM: exiting at once")
    assert " loaded (" not in text and "Traceback" not in text


def test_a_signal_before_the_model_loads_exits_at_once_with_one_line(smollm2: Path) -> None:
    """Before the server starts (settings, imports, the checks before the load: here held in the
    checks), Ctrl-C is one line and 130, not a KeyboardInterrupt's traceback."""
    code = ("import sys, time\nimport kvserve.scheduler.engine as engine\nfrom kvserve.__main__ import main\n"
            "engine.preflight = lambda settings: print('checking', flush=True) or time.sleep(60)\n"
            "main(sys.argv[1:])\n")
    process = subprocess.Popen([sys.executable, "-c", code, "--model", str(smollm2), "--port", str(free_port())],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert process.stdout.readline() == "checking\n"
    process.send_signal(signal.SIGINT)
    _, err = process.communicate(timeout=10)
    assert process.returncode == 130 and err == "SIGINT: exiting at once\n"

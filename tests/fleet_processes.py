"""kvserve replicas behind a real router, as processes on loopback ports: what the fleet test and
`python -m bench.fleet` start. Every process runs in its own session and is stopped by its PID.

Routers (both Rust, installed from PyPI by the test extra):
- smg, the SGLang Model Gateway: `cache_aware` keeps an approximate radix tree of request text;
- vllm-router: `cache_aware` asks a replica to render each request (/v1/chat/completions/render)
  and matches tokens.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import httpx

from bench.servers import free_port, kvserve_command

# The router packages: PyPI name -> the module their console script runs.
ROUTER_MODULES = {"smg": "smg", "vllm-router": "vllm_router"}


def wait_until(check: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError):
            if check():
                return
        time.sleep(0.2)
    raise TimeoutError(f"{what} not within {timeout:.0f}s")


class Process:
    """A child process in its own session, its output in a log file."""

    def __init__(self, command: list[str], log: Path) -> None:
        self.command = command
        self.log = log
        with open(log, "w") as out:
            self.popen = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def kill(self) -> None:
        """SIGKILL: a replica that dies without a word, as a crashed machine would."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pid, signal.SIGKILL)
        self.popen.wait()

    def stop(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pid, signal.SIGTERM)
        try:
            self.popen.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.kill()

    def tail(self, lines: int = 30) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])


@dataclass
class Replica:
    url: str
    process: Process

    def served(self) -> float:
        """Requests this replica finished, from its /metrics."""
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        return sum(float(line.split()[-1]) for line in text.splitlines()
                   if line.startswith("kvserve_request_success_total"))


def start_replica(model: Path, logs: Path, name: str, *flags: str) -> Replica:
    port = free_port()
    command = kvserve_command(port, "--model", str(model), *flags)
    return Replica(f"http://127.0.0.1:{port}", Process(command, logs / f"{name}.log"))


def router_command(router: str, port: int, metrics_port: int, workers: list[str], policy: str) -> list[str]:
    """The router on 127.0.0.1, its Prometheus listener on loopback too, probing workers every second
    so that a dead replica leaves the rotation within seconds."""
    common = ["--host", "127.0.0.1", "--port", str(port), "--prometheus-host", "127.0.0.1",
              "--prometheus-port", str(metrics_port), "--worker-urls", *workers, "--policy", policy,
              "--health-check-interval-secs", "1"]
    if router == "smg":
        # Routing on request text needs no tokenizer; without this smg would look for one at the
        # GGUF path /server_info reports.
        return [sys.executable, "-m", "smg.launch_router", *common, "--disable-tokenizer-autoload",
                "--log-level", "warn"]
    if router == "vllm-router":
        return [sys.executable, "-m", "vllm_router.launch_router", *common, "--log-level", "warning"]
    raise ValueError(f"unknown router {router!r}")


def missing_router(router: str) -> str | None:
    """Why `router` cannot run here, or None."""
    if importlib.util.find_spec(ROUTER_MODULES[router]) is None:
        return f"{router} is not installed (pip install -e '.[test]' installs it)"
    return None


def _workers_ready(url: str, n: int) -> bool:
    workers = httpx.get(f"{url}/workers", timeout=5).json()["workers"]
    return len(workers) == n and all(w["is_healthy"] for w in workers)


@dataclass
class Fleet:
    url: str  # the router's
    replicas: list[Replica]
    router: Process


@contextlib.contextmanager
def fleet(model: Path, logs: Path, router: str, policy: str, replica_flags: list[str],
          n: int = 2) -> Iterator[Fleet]:
    """`n` replicas of `model` behind `router`, healthy and registered; everything stopped after."""
    logs.mkdir(parents=True, exist_ok=True)
    started: list[Process] = []
    try:
        replicas = [start_replica(model, logs, f"replica-{i}", *replica_flags) for i in range(n)]
        started += [r.process for r in replicas]
        for replica in replicas:
            wait_until(lambda: _healthy(replica), 180, f"{replica.url}/health")
        port = free_port()
        command = router_command(router, port, free_port(), [r.url for r in replicas], policy)
        process = Process(command, logs / f"{router}.log")
        started.append(process)
        url = f"http://127.0.0.1:{port}"
        wait_until(lambda: process.alive() and _workers_ready(url, n), 60, f"{router} with {n} healthy workers")
        yield Fleet(url, replicas, process)
    finally:
        for process in reversed(started):
            process.stop()


def _healthy(replica: Replica) -> bool:
    if not replica.process.alive():
        raise RuntimeError(f"replica exited:\n{replica.process.tail()}")
    return httpx.get(f"{replica.url}/health", timeout=2).status_code == 200

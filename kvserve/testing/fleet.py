"""kvserve replicas behind a real router, as processes on loopback ports: what the fleet test and
`python -m bench.fleet` start.

Routers (both Rust, installed from PyPI by the test extra):
- smg, the SGLang Model Gateway: `cache_aware` keeps an approximate radix tree of request text;
- vllm-router: `cache_aware` asks a replica to render each request (/v1/chat/completions/render)
  and matches tokens.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Mapping

from kvserve.testing.metrics import read_metrics
from kvserve.testing.processes import ServerProcess, free_port, http_get

# The router packages: PyPI name -> the module their console script runs.
ROUTER_MODULES = {"smg": "smg", "vllm-router": "vllm_router"}


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


def served(replica: ServerProcess) -> float:
    """Requests the replica finished, from its /metrics."""
    return read_metrics(replica.url).total("kvserve_request_success_total")


def _workers_ready(url: str, n: int) -> bool:
    status, body = http_get(f"{url}/workers", timeout=5)
    workers = json.loads(body)["workers"] if status == 200 else []
    return len(workers) == n and all(w["is_healthy"] for w in workers)


@dataclass
class Fleet:
    url: str  # the router's
    replicas: list[ServerProcess]
    router: ServerProcess


@contextlib.contextmanager
def fleet(model: Path, logs: Path, router: str, policy: str, replica_settings: Mapping[str, object],
          n: int = 2) -> Iterator[Fleet]:
    """`n` kvserve replicas of `model` with `replica_settings` behind `router`, healthy and
    registered; everything stopped after, the router first."""
    with contextlib.ExitStack() as started:
        replicas = [started.enter_context(ServerProcess.kvserve(logs / f"replica-{i}.log", model=model,
                                                                **replica_settings)) for i in range(n)]
        for replica in replicas:
            replica.wait_healthy()
        port = free_port()
        command = router_command(router, port, free_port(), [r.url for r in replicas], policy)
        proxy = started.enter_context(ServerProcess(command, port, logs / f"{router}.log"))
        proxy.wait_for(lambda: _workers_ready(proxy.url, n), f"{router} with {n} healthy workers", timeout=60)
        yield Fleet(proxy.url, replicas, proxy)

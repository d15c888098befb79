"""The servers a comparison runs, each with the same model, threads and context."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from kvserve.testing import kvserve_command


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
    only: tuple[str, ...] = ()  # the workloads it runs; () for all of them

    def runs(self, workload: str) -> bool:
        return not self.only or workload in self.only


def contenders(setup: Setup, llama_server: Path) -> list[Server]:
    """kvserve, llama-server (with -np as kvserve's slots, and at its defaults) and llama-cpp-python's
    server, each with its defaults otherwise."""
    model, threads = str(setup.model), str(setup.threads)
    # kvserve's --ctx-size is one request's context (a stream each); llama-server's -c is split
    # evenly between its -np slots, so it gets slots x the per-request context
    total_ctx = str(setup.slots * setup.ctx_per_request)
    return [
        Server("kvserve", lambda port: kvserve_command(
            port=port, model=model, threads=threads, parallel=setup.slots, ctx_size=str(setup.ctx_per_request))),
        Server("llama-server", lambda port: [
            str(llama_server), "--host", "127.0.0.1", "--port", str(port), "--model", model,
            "--threads", threads, "--threads-batch", threads, "--parallel", str(setup.slots),
            "--ctx-size", total_ctx]),
        # llama-server as a user first starts it: no -np, no --ctx-size (4 slots in one unified
        # cache of the model's training context), a second reference where prompts come back
        Server("llama-server-defaults", lambda port: [
            str(llama_server), "--host", "127.0.0.1", "--port", str(port), "--model", model,
            "--threads", threads, "--threads-batch", threads], only=("shared", "conversations")),
        # one request at a time; interrupt_requests off, or each new request cuts the running stream
        Server("llama-cpp-python", lambda port: [
            sys.executable, "-m", "llama_cpp.server", "--host", "127.0.0.1", "--port", str(port),
            "--model", model, "--n_threads", threads, "--n_threads_batch", threads,
            "--n_ctx", str(setup.ctx_per_request), "--interrupt_requests", "False"], health="/v1/models"),
    ]


"""Servers as child processes on loopback ports: start one, wait until it answers, stop it.

HTTP goes through the standard library, so this runs from a plain install. Every process runs in
its own session and is signalled as a group, so whatever it spawned stops with it.
"""

from __future__ import annotations

import contextlib
import http.client
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import TracebackType
from typing import Callable, Sequence

from kvserve.config import Settings

# What a server that is not listening yet, or is closing, raises: "not ready", not a failure.
_NOT_ANSWERING = (OSError, http.client.HTTPException)
# The servers are on loopback: a proxy from the environment (http_proxy) must not see their requests.
_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def kvserve_command(**settings: object) -> list[str]:
    """`python -m kvserve` with `settings` (Settings' field names) as flags, on 127.0.0.1 unless
    `host` says otherwise: `ctx_size=4096` is `--ctx-size 4096`, `prefix_cache=False` is
    `--no-prefix-cache`, None leaves the default. A name kvserve does not know raises TypeError."""
    unknown = set(settings) - set(Settings.model_fields)
    if unknown:
        raise TypeError(f"not kvserve settings: {', '.join(sorted(unknown))}")
    command = [sys.executable, "-m", "kvserve"]
    for name, value in {"host": "127.0.0.1", **settings}.items():
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            command.append(flag if value else flag.replace("--", "--no-", 1))
        elif value is not None:
            command += [flag, str(value)]
    return command


def http_get(url: str, timeout: float = 10) -> tuple[int, bytes]:
    """The status and body of a GET of `url`; OSError when nothing answers."""
    try:
        with _DIRECT.open(url, timeout=timeout) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


def wait_until(ready: Callable[[], bool], timeout: float, what: str) -> None:
    """Poll `ready` until it is true, TimeoutError naming `what` after `timeout` seconds. A server
    that does not answer yet counts as not ready; any other exception `ready` raises ends the wait."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(*_NOT_ANSWERING):
            if ready():
                return
        time.sleep(0.05)
    raise TimeoutError(f"{what}: not within {timeout:g}s")


class ServerExited(RuntimeError):
    """The server process ended while something waited for it."""


class ServerProcess:
    """A server command listening on `port`, in its own session, its output in `log`. As a
    context manager it is stopped when the block ends."""

    def __init__(self, command: Sequence[str], port: int, log: Path) -> None:
        self.command = list(command)
        self.url = f"http://127.0.0.1:{port}"
        self.log = log
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "w") as out:
            self._popen = subprocess.Popen(self.command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)

    @classmethod
    def kvserve(cls, log: Path, **settings: object) -> "ServerProcess":
        """kvserve with `settings` (see `kvserve_command`), on a free port unless `port` is one."""
        port = int(settings.pop("port", None) or free_port())
        return cls(kvserve_command(port=port, **settings), port, log)

    @property
    def pid(self) -> int:
        return self._popen.pid

    def alive(self) -> bool:
        return self._popen.poll() is None

    def tail(self, lines: int = 30) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])

    def wait_for(self, ready: Callable[[], bool], what: str, timeout: float = 180) -> None:
        """`wait_until`, failing at once if the process exits; either failure quotes its log."""
        def alive_and_ready() -> bool:
            if not self.alive():
                raise ServerExited(f"{self.command[0]} exited with {self._popen.returncode} before {what}")
            return ready()

        try:
            wait_until(alive_and_ready, timeout, what)
        except (ServerExited, TimeoutError) as exc:
            raise type(exc)(f"{exc}; the end of {self.log}:\n{self.tail()}") from None

    def wait_healthy(self, path: str = "/health", timeout: float = 180) -> None:
        """Wait until GET `path` answers 200 (kvserve's /health does once the model is loaded)."""
        self.wait_for(lambda: http_get(f"{self.url}{path}", timeout=2)[0] == 200, f"{self.url}{path} answering 200",
                      timeout)

    def terminate(self) -> None:
        """SIGTERM to the process group: the polite stop, which kvserve answers by draining."""
        self._signal(signal.SIGTERM)

    def interrupt(self) -> None:
        """SIGINT to the process group, as Ctrl-C in its terminal."""
        self._signal(signal.SIGINT)

    def kill(self) -> None:
        """SIGKILL to the process group, as a crashed machine would end it; returns once it is gone."""
        self._signal(signal.SIGKILL)
        self._popen.wait()

    def wait(self, timeout: float) -> int:
        """The exit status; subprocess.TimeoutExpired if it is still running after `timeout` seconds."""
        return self._popen.wait(timeout=timeout)

    def stop(self, grace: float = 30) -> int:
        """SIGTERM, then SIGKILL if it has not exited within `grace` seconds; the exit status."""
        self.terminate()
        try:
            return self.wait(grace)
        except subprocess.TimeoutExpired:
            self.kill()
            return self._popen.returncode

    def _signal(self, sig: signal.Signals) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pid, sig)

    def __enter__(self) -> "ServerProcess":
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()

"""`kvserve` / `python -m kvserve`: parse settings, load the model, serve."""

from __future__ import annotations

import socket
import sys

from pydantic import ValidationError
from pydantic_settings import SettingsError

from kvserve.server.signals import exiting_at_once


def _one_line(exc: Exception) -> str:
    if isinstance(exc, ValidationError):
        err = exc.errors()[0]
        message = err["msg"].removeprefix("Value error, ")
        if not err["loc"]:
            return message
        return "--" + "-".join(str(p) for p in err["loc"]).replace("_", "-") + f": {message}"
    return str(exc)


def _check_address(host: str, port: int) -> None:
    """OSError naming --host and --port where the server could not listen there (in use, no such address)."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
            probe.bind(address)
    except OSError as exc:
        raise OSError(f"--host {host} --port {port}: {exc.strerror or exc}") from None


def main(argv: list[str] | None = None) -> None:
    with exiting_at_once():  # until the server drains on a signal, one ends the process at once
        _start(argv)


def _start(argv: list[str] | None) -> None:
    from kvserve.config import Settings

    try:
        settings = Settings(_cli_parse_args=sys.argv[1:] if argv is None else argv)
    except (ValidationError, SettingsError, ValueError) as exc:
        print(f"kvserve: {_one_line(exc)}", file=sys.stderr)
        raise SystemExit(2) from None

    from kvserve.scheduler.engine import preflight
    from kvserve.server.app import serve
    from kvserve.cache.disk_store import DiskLocked
    from kvserve.server.catalog import catalog, keep_alive_seconds
    from kvserve.server.persistence import Persistence

    try:
        keep_alive_seconds(settings.keep_alive)
    except ValueError as exc:
        print(f"kvserve: --keep-alive: {str(exc).removeprefix('keep_alive: ')}", file=sys.stderr)
        raise SystemExit(2) from None
    try:
        _check_address(settings.host, settings.port)  # before a load that may take a minute
        specs = catalog(settings)
        if not settings.many_models:
            preflight(settings)
        persistence = Persistence.open(settings, [spec.name for spec in specs])  # a busy folder stops this one here
    except (ValueError, DiskLocked, OSError) as exc:
        print(f"kvserve: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    raise SystemExit(serve(settings, specs, persistence))


if __name__ == "__main__":
    main()

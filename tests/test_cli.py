"""The command line: a bad value or a missing model is one clear line and exit status 2."""

from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.parametrize("args, says", [
    (["--port", "abc"], "--port"),
    (["--model", "/nonexistent/model.gguf"], "--model: file not found"),
    (["--parallel", "0"], "--parallel"),
])
def test_bad_settings_exit_2_with_one_line(args: list[str], says: str) -> None:
    done = subprocess.run([sys.executable, "-m", "kvserve", *args], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and says in lines[0] and "Traceback" not in done.stderr


def test_env_vars_are_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvserve.config import Settings

    monkeypatch.setenv("KVSERVE_PORT", "8123")
    monkeypatch.setenv("KVSERVE_PREFIX_CACHE", "false")
    settings = Settings(_cli_parse_args=[])
    assert settings.port == 8123 and settings.prefix_cache is False
    assert Settings(_cli_parse_args=["--port", "9000"]).port == 9000  # flags win

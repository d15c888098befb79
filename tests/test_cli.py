"""The command line: a bad value or a missing model is one clear line and exit status 2; the
harness spells settings as the flags kvserve parses."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvserve.testing import free_port, kvserve_command


@pytest.mark.parametrize("args, says", [
    (["--port", "abc"], "--port"),
    (["--model", "/nonexistent/model.gguf"], "--model: file not found"),
    (["--parallel", "0"], "--parallel"),
    (["--kv-events", "tcp://127.0.0.1:99999"], "--kv-events: 'tcp://127.0.0.1:99999': a tcp address ends in its port"),
    (["--kv-events", "ipc:///tmp/kv", "--kv-events-replay", "ipc:///tmp/kv"], "--kv-events-replay: 'ipc:///tmp/kv' is"),
    (["--kv-events", "garbage"], "--kv-events 'garbage': cannot bind: Invalid argument"),
    (["--kv-events", "ipc:///nonexistent/dir/sock"], "--kv-events 'ipc:///nonexistent/dir/sock': cannot bind"),
    (["--api-key", " "], "--api-key is empty"),  # every route open, where the operator asked for a key
    (["--api-key", "null"], "--api-key gives no key"),  # the command line reads null as none
    (["--metrics-need-key"], "--metrics-need-key needs a key"),
    (["--keep-alive", "abc"], "--keep-alive: 'abc' is not a duration"),
    (["--max-body-mb", "inf"], "--max-body-mb: Input should be a finite number"),
    (["--prefix-state-mb", "inf"], "--prefix-state-mb: Input should be a finite number"),
    (["--threads", "40000"], "--threads"),
    (["--host", ""], "--host"),
])
def test_bad_settings_exit_2_with_one_line(args: list[str], says: str) -> None:
    done = subprocess.run([sys.executable, "-m", "kvserve", *args], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and says in lines[0] and "Traceback" not in done.stderr


def test_a_key_file_without_a_key_stops_the_server(tmp_path: Path) -> None:
    """Blank and comment lines only: every route would be open, where the operator asked for keys."""
    keys = tmp_path / "keys"
    keys.write_text("# keys for this server, one per line\n\n   \n# (none yet)\n")
    test_bad_settings_exit_2_with_one_line(["--api-key-file", str(keys)], "holds no key")


def test_kv_events_addresses_with_a_port_or_a_star_are_settings() -> None:
    from kvserve.config import Settings

    for pub, replay in (("tcp://*:1", "tcp://*:65535"), ("tcp://127.0.0.1:*", "tcp://127.0.0.1:*"),
                        ("ipc:///tmp/kv-pub", "ipc:///tmp/kv-replay"), ("tcp://[::1]:5557", None)):
        settings = Settings(kv_events=pub, kv_events_replay=replay)
        assert (settings.kv_events, settings.kv_events_replay) == (pub, replay)


def test_env_vars_are_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvserve.config import Settings

    monkeypatch.setenv("KVSERVE_PORT", "8123")
    monkeypatch.setenv("KVSERVE_PREFIX_CACHE", "false")
    settings = Settings(_cli_parse_args=[])
    assert settings.port == 8123 and settings.prefix_cache is False
    assert Settings(_cli_parse_args=["--port", "9000"]).port == 9000  # flags win


@pytest.mark.parametrize("variable, says", [
    ("KVSERVE_PREFIX_DISK_DRI", "KVSERVE_PREFIX_DISK_DRI is not a setting's variable (did you mean KVSERVE_PREFIX_DISK_DIR?)"),
    ("KVSERVE_SPECULATIVE_MODE", "KVSERVE_SPECULATIVE_MODE is not a setting's variable (did you mean KVSERVE_SPECULATIVE?)"),
    ("kvserve_ctx_sise", "kvserve_ctx_sise is not a setting's variable (did you mean KVSERVE_CTX_SIZE?)"),  # read in any case
    ("KVSERVE_SERVICE_HOST", "KVSERVE_SERVICE_HOST is not a setting's variable (--ctx-size's is KVSERVE_CTX_SIZE)"),
])
def test_a_variable_that_is_no_setting_exits_2_with_one_line(variable: str, says: str) -> None:
    """A misspelt variable once left its setting at the default, silently."""
    env = {**os.environ, variable: "1"}
    done = subprocess.run([sys.executable, "-m", "kvserve"], capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode == 2 and done.stderr.strip().splitlines() == [f"kvserve: {says}"], done.stderr


def test_variables_kvserve_reads_elsewhere_are_no_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from kvserve.config import NOT_SETTINGS, Settings

    for variable in NOT_SETTINGS:
        monkeypatch.setenv(variable, str(tmp_path))
    assert Settings(_cli_parse_args=[]).port == 8000


def test_kvserve_command_spells_settings_as_the_flags_they_parse_from(tmp_path: Path) -> None:
    from kvserve.config import Settings

    model = tmp_path / "model.gguf"
    model.touch()  # the settings only check that the file exists
    chosen = {"model": model, "port": 9000, "ctx_size": 4096, "prefix_cache": False, "metrics_need_key": True,
              "api_key": "k", "drain_timeout": 1.5, "log_format": "json"}
    command = kvserve_command(**chosen, metrics_compat=None)
    assert command[:3] == [sys.executable, "-m", "kvserve"]
    parsed = Settings(_cli_parse_args=command[3:])
    assert {name: getattr(parsed, name) for name in chosen} == chosen
    assert parsed.host == "127.0.0.1" and parsed.metrics_compat is None
    with pytest.raises(TypeError, match="ctx"):
        kvserve_command(ctx=4096)


def test_prefix_state_mb_is_the_budget_and_prefix_cache_mb_its_alias(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvserve.config import Settings

    assert Settings(_cli_parse_args=["--prefix-state-mb", "1"]).prefix_state_mb == 1
    assert Settings(_cli_parse_args=["--prefix-cache-mb", "3"]).prefix_state_mb == 3
    monkeypatch.setenv("KVSERVE_PREFIX_STATE_MB", "5")
    assert Settings(_cli_parse_args=[]).prefix_state_mb == 5
    assert Settings(_cli_parse_args=["--prefix-state-mb", "7"]).prefix_state_mb == 7  # flags win
    with pytest.raises(ValueError, match="alias"):
        Settings(_cli_parse_args=["--prefix-state-mb", "1", "--prefix-cache-mb", "2"])


def test_prefix_state_mb_reaches_server_info(tmp_path: Path) -> None:
    """`kvserve --prefix-state-mb 1` once exited 2: the design's flag must start a server with that budget."""
    import httpx

    from kvserve.testing import ServerProcess

    command = [sys.executable, "-m", "kvserve", "--prefix-state-mb", "1", "--parallel", "2", "--ctx-size", "512"]
    port = free_port()
    with ServerProcess([*command, "--port", str(port)], port, tmp_path / "kvserve.log") as server:
        server.wait_healthy()
        assert httpx.get(f"{server.url}/server_info").json()["cache"]["prefix_state_bytes"] == 1024 * 1024


def test_a_file_llama_cpp_cannot_read_exits_2_with_one_line(tmp_path: Path) -> None:
    not_gguf = tmp_path / "model.gguf"
    not_gguf.write_bytes(b"GGUF" + bytes(range(256)) * 4)
    done = subprocess.run([sys.executable, "-m", "kvserve", "--port", str(free_port()), "--model", str(not_gguf)], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 2 and done.stderr.strip().splitlines() == [
        f"kvserve: --model {not_gguf}: llama.cpp cannot read it (not a GGUF file, or a damaged one)"], done.stderr


def test_an_address_in_use_exits_2_before_the_model_loads() -> None:
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run([sys.executable, "-m", "kvserve", "--port", str(port)], capture_output=True, text=True,
                              timeout=60)
    assert done.returncode == 2 and done.stderr.strip().splitlines() == [
        f"kvserve: --host 127.0.0.1 --port {port}: Address already in use"], done.stderr

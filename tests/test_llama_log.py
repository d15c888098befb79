"""llama.cpp's log reaches Python's logging at the level llama.cpp gives each message; the server's
log shows its warnings and errors, not its loading report."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from kvserve.llama.model import Model, ModelLoadError
from kvserve.testing import ServerProcess


def test_each_message_keeps_its_llama_cpp_level(smollm2: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="kvserve.llama")
    Model(smollm2).close()
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF" + bytes(20))  # the magic, then version 0
    with pytest.raises(ModelLoadError):
        Model(broken)

    def levels(says: str) -> set[str]:
        return {r.levelname for r in caplog.records if r.name == "kvserve.llama" and says in r.getMessage()}

    assert levels("loaded meta data") == {"INFO"}
    assert levels("is not marked as EOG") == {"DEBUG"}
    assert levels("failed to load model") == {"ERROR"}


def test_default_start_logs_no_error(tmp_path: Path) -> None:
    """SmolLM2 at the defaults: llama.cpp may warn only that mean pooling (what kvserve's embeddings
    use for a model that declares none) differs from the model's own; nothing else, no error."""
    with ServerProcess.kvserve(tmp_path / "kvserve.log", log_format="json") as server:
        server.wait_healthy()
    records = [json.loads(line) for line in server.log.read_text().splitlines()]
    assert [r for r in records if r["level"] in ("ERROR", "CRITICAL")] == []
    llama = [(r["level"], r["message"]) for r in records if r["logger"] == "kvserve.llama"]
    assert all(level == "WARNING" and "pooling_type is [-1], but [1] was specified" in message
               for level, message in llama), llama

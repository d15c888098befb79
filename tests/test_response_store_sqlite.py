"""The Responses store in SQLite (`--prefix-disk-dir`): the memory store's bounds and owners on a
file that outlives the process, a corrupt file moved aside, two stores sharing one file; then
real servers: a restart with the data dir keeps `previous_response_id` chains (one without it
forgets them), and behind a router, a conversation pinned by a header reaches its replica."""

from __future__ import annotations

import contextlib
import json
import logging
import sqlite3
import threading
from pathlib import Path
from typing import Iterator

import httpx
import openai
import pytest

from kvserve.server.responses_api.schemas import (
    FunctionCallItem, FunctionCallOutputItem, MessageItem, ReasoningItem, ReasoningText, TextContent,
)
from kvserve.server.responses_api.sqlite_store import FILE_NAME, SqliteResponseStore
from kvserve.testing.fleet import missing_router, router_command, served
from kvserve.testing.processes import ServerProcess, free_port, http_get

MODEL = "smollm2"


class Clock:
    def __init__(self, now: float = 1_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def body(response_id: str, text: str = "") -> dict:
    return {"id": response_id, "output": [text]}


def items(text: str) -> list[MessageItem]:
    return [MessageItem(role="user", content=text)]


@pytest.fixture
def open_store(tmp_path: Path) -> Iterator:
    """open_store(max_count=..., ...) -> a store on tmp_path's file; every one closed after the test."""
    opened: list[SqliteResponseStore] = []

    def open_(directory: Path = tmp_path, max_count: int = 100, max_bytes: int = 1 << 20, ttl: float = 60,
              clock: Clock | None = None) -> SqliteResponseStore:
        opened.append(SqliteResponseStore(directory, max_count, max_bytes, ttl, clock or Clock()))
        return opened[-1]

    yield open_
    for store in opened:
        store.close()


def test_every_kind_of_item_comes_back_as_it_was_stored(open_store) -> None:
    context = [
        MessageItem(role="system", content="Be brief."),
        MessageItem(role="user", content=[TextContent(type="input_text", text="Weather in Oslo?")]),
        ReasoningItem(type="reasoning", summary=[ReasoningText(type="summary_text", text="look it up")]),
        FunctionCallItem(type="function_call", call_id="c1", name="weather", arguments='{"city": "Oslo"}'),
        FunctionCallOutputItem(type="function_call_output", call_id="c1", output="rain"),
        MessageItem(role="assistant", content=[TextContent(type="output_text", text="Rain.")]),
    ]
    answer = {"id": "r", "object": "response", "output": [{"type": "message", "content": []}], "usage": None}
    store = open_store()
    assert store.put(answer, context)
    stored = store.get("r")
    assert stored.body == answer and stored.context == context and stored.owner is None
    assert [type(item) for item in stored.context] == [type(item) for item in context]
    assert store.bytes_used == stored.size > 0 and len(store) == 1
    assert store.delete("r") and not store.delete("r") and store.get("r") is None and len(store) == 0


def test_a_response_is_its_owners_alone(open_store) -> None:
    store = open_store()
    assert store.put(body("r"), items("secret"), owner="key-a")
    assert store.get("r", "key-b") is None and store.get("r") is None
    assert not store.delete("r", "key-b") and not store.delete("r")
    assert store.get("r", "key-a").context == items("secret")
    assert store.delete("r", "key-a") and len(store) == 0


def test_entries_expire_after_ttl(open_store) -> None:
    clock = Clock()
    store = open_store(ttl=30, clock=clock)
    store.put(body("a"), items("a"))
    clock.now += 20
    store.put(body("b"), items("b"))
    clock.now += 10
    assert store.get("a") is None and not store.delete("a") and store.get("b") is not None
    clock.now += 20
    assert store.get("b") is None and len(store) == 0 and store.bytes_used == 0


def test_byte_bound_drops_the_oldest_and_refuses_what_never_fits(open_store) -> None:
    store = open_store(max_bytes=1000)
    for name in ("a", "b", "c"):
        assert store.put(body(name), items(name * 300))
    assert store.bytes_used <= 1000 and store.get("a") is None and store.get("c") is not None
    assert not store.put(body("huge"), items("h" * 2000))
    assert store.get("huge") is None and store.get("c") is not None


def test_count_bound_drops_the_oldest(open_store) -> None:
    store = open_store(max_count=2)
    for name in ("a", "b", "c"):
        assert store.put(body(name), items(name))
    assert store.get("a") is None and store.get("b").body == body("b") and len(store) == 2
    store.put(body("b"), items("b again"))  # stored again: now the newest, so "c" goes next
    store.put(body("d"), items("d"))
    assert store.get("c") is None and store.get("b").context == items("b again") and len(store) == 2


def test_zero_count_keeps_nothing(open_store) -> None:
    store = open_store(max_count=0)
    assert not store.put(body("a"), items("a")) and store.get("a") is None


def test_a_reopened_file_keeps_its_responses_their_order_and_their_expiry(tmp_path: Path, open_store) -> None:
    clock = Clock()
    first = open_store(ttl=100, clock=clock)
    for name in ("a", "b", "c"):
        first.put(body(name), items(name), owner="key")
        clock.now += 10
    first.close()
    again = open_store(ttl=100, clock=clock)
    assert [again.get(n, "key").context for n in "abc"] == [items(n) for n in "abc"] and len(again) == 3
    clock.now = 1_000_000.0 + 100  # "a" was stored at the start: its wall-clock expiry has come
    assert again.get("a", "key") is None and again.get("b", "key") is not None
    again.close()
    smaller = open_store(max_count=1, ttl=100, clock=clock)  # bounds that shrank trim the oldest at open
    assert len(smaller) == 1 and smaller.get("c", "key") is not None


def test_a_ttl_lowered_across_a_restart_applies_from_the_restart(open_store) -> None:
    """A row stored for 30 days, reopened by a server whose TTL is an hour, lives an hour more, not a
    month (an operator shortens retention with the flag); a mutation that leaves `expires` alone
    still answers it 20 days later."""
    clock = Clock()
    first = open_store(ttl=30 * 86400, clock=clock)
    first.put(body("old"), items("secret"))
    first.close()
    clock.now += 2 * 3600
    again = open_store(ttl=3600, clock=clock)
    assert again.get("old") is not None
    clock.now += 3600
    assert again.get("old") is None and len(again) == 0
    again.close()
    longer = open_store(ttl=30 * 86400, clock=clock)  # a TTL raised again brings nothing back
    assert longer.get("old") is None


def test_the_byte_bound_counts_utf8_bytes(open_store) -> None:
    """Non-ASCII text takes up to 4 bytes a character on disk: the bound counts those, not characters
    (a mutation counting characters keeps 4x the budget of this text)."""
    store = open_store(max_bytes=10_000)
    for name in "abcdef":
        store.put(body(name), items("\N{GRINNING FACE}" * 1000))  # 4,000 bytes of UTF-8 each
    assert store.bytes_used <= 10_000 and len(store) == 2 and store.bytes_used > 8000


def test_a_corrupt_file_is_moved_aside_and_an_empty_one_started(tmp_path: Path, open_store,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    garbage = b"this is not an SQLite database" * 200
    (tmp_path / FILE_NAME).write_bytes(garbage)
    with caplog.at_level(logging.WARNING, logger="kvserve.server"):
        store = open_store()
    assert "moved to" in caplog.text
    [aside] = tmp_path.glob(f"{FILE_NAME}.corrupt-*")
    assert aside.read_bytes() == garbage
    assert len(store) == 0 and store.put(body("a"), items("a")) and store.get("a") is not None


def test_a_damaged_page_is_caught_at_open(tmp_path: Path, open_store) -> None:
    store = open_store()
    for i in range(200):
        store.put(body(f"r{i}"), items("x" * 200))
    store.close()
    path = tmp_path / FILE_NAME
    with sqlite3.connect(path) as db:  # fold the WAL into the file, so the damage below is what is read
        db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    data = bytearray(path.read_bytes())
    data[4096 * 2:4096 * 4] = b"\xff" * 8192  # two pages of the table, overwritten
    path.write_bytes(bytes(data))
    reopened = open_store()
    assert list(tmp_path.glob(f"{FILE_NAME}.corrupt-*")) and len(reopened) == 0
    assert reopened.put(body("a"), items("a")) and reopened.get("a") is not None


def test_a_row_that_does_not_decode_is_absent_and_deleted(tmp_path: Path, open_store) -> None:
    store = open_store()
    store.put(body("a"), items("a"))
    store.put(body("b"), items("b"))
    with sqlite3.connect(tmp_path / FILE_NAME) as db:
        db.execute("UPDATE responses SET context = ? WHERE id = 'a'", (json.dumps([{"type": "image"}]),))
    assert store.get("a") is None and len(store) == 1 and store.get("b").context == items("b")


@pytest.mark.parametrize("stored", ["5", "{}", '{"id": "x", "output": []}', '{"id": "a", "output": 7}',
                                    '{"output": []}', '[{"id": "a", "output": []}]'])
def test_a_body_that_is_not_the_response_object_is_absent_and_deleted(tmp_path: Path, open_store,
                                                                       stored: str) -> None:
    store = open_store()
    store.put(body("a"), items("a"))
    store.put(body("b"), items("b"))
    with sqlite3.connect(tmp_path / FILE_NAME) as db:
        db.execute("UPDATE responses SET body = ? WHERE id = 'a'", (stored,))
    assert store.get("a") is None and len(store) == 1 and store.get("b").body == body("b")


def test_two_stores_on_one_file_from_two_threads(tmp_path: Path, open_store) -> None:
    stores = [open_store(max_count=50), open_store(max_count=50)]
    errors: list[BaseException] = []

    def fill(store: SqliteResponseStore, name: str) -> None:
        try:
            for i in range(100):
                assert store.put(body(f"{name}{i}", name), items(f"{name} {i}"))
                got = store.get(f"{name}{i}")
                # gone only if the other thread stored 50 since (the bound is both's): on a loaded box
                # one thread can wait out the other's 50 stores between its put and its get
                assert got is None or got.context == items(f"{name} {i}")
        except BaseException as error:  # noqa: BLE001 - reported on the test's thread
            errors.append(error)

    threads = [threading.Thread(target=fill, args=(store, name)) for store, name in zip(stores, "xy")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not errors, errors
    assert len(stores[0]) == len(stores[1]) == 50  # one bound across both writers
    with sqlite3.connect(tmp_path / FILE_NAME) as db:
        assert db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        ids = [row[0] for row in db.execute("SELECT id FROM responses ORDER BY seq")]
    assert ids[-1] in ("x99", "y99")  # the last one stored is kept, whichever thread stored it
    for response_id in ids:  # the 50 kept read back right through either store
        for store in stores:
            assert store.get(response_id).context == items(f"{response_id[0]} {response_id[1:]}")
    assert all(store.get(i) is not None for store in stores for i in ids)  # each reads what the other wrote


# --- real servers --------------------------------------------------------------------------------


@contextlib.contextmanager
def started(log: Path, **settings: object) -> Iterator[openai.OpenAI]:
    """kvserve serving SmolLM2 until the block ends, then stopped by SIGTERM (which must exit 0)."""
    server = ServerProcess.kvserve(log, threads=1, parallel=2, ctx_size=2048, **settings)
    try:
        server.wait_healthy()
        with openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120) as client:
            yield client
    finally:
        assert server.stop() == 0, server.tail()


def test_a_restart_with_the_data_dir_keeps_previous_response_id_chains(tmp_path: Path) -> None:
    data = tmp_path / "data"  # not there yet: the server makes it
    with started(tmp_path / "first.log", prefix_disk_dir=data) as client:
        first = client.responses.create(model=MODEL, input="Name a color.", temperature=0, max_output_tokens=12,
                                        store=True)
        first_items = client.responses.input_items.list(first.id).model_dump()
    assert (data / FILE_NAME).is_file()
    with started(tmp_path / "second.log", prefix_disk_dir=data) as client:
        assert client.responses.retrieve(first.id).model_dump() == first.model_dump()
        assert client.responses.input_items.list(first.id).model_dump() == first_items  # the same ids, too
        second = client.responses.create(model=MODEL, input="Name another one.", previous_response_id=first.id,
                                         temperature=0, max_output_tokens=12)
        spelled_out = client.responses.create(model=MODEL, temperature=0, max_output_tokens=12, store=False, input=[
            {"role": "user", "content": "Name a color."},
            {"role": "assistant", "content": first.output_text},
            {"role": "user", "content": "Name another one."}])
        continued = [item.id for item in client.responses.input_items.list(second.id, order="asc")]
    assert continued[:2] == [first_items["data"][0]["id"], first.output[0].id] and len(continued) == 3
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens == spelled_out.usage.input_tokens > first.usage.input_tokens
    assert second.output_text == spelled_out.output_text


def test_a_restart_without_the_data_dir_forgets(tmp_path: Path) -> None:
    with started(tmp_path / "first.log") as client:
        first = client.responses.create(model=MODEL, input="Name a color.", max_output_tokens=4, store=True)
        assert client.responses.retrieve(first.id).id == first.id
    with started(tmp_path / "second.log") as client:
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(first.id)


# --- behind a router -----------------------------------------------------------------------------


@contextlib.contextmanager
def pinned_fleet(tiny, logs: Path) -> Iterator[tuple[str, list[ServerProcess]]]:
    """Two replicas, each with its own data dir, behind smg placing conversations round-robin and
    pinning each to its replica by the `x-smg-routing-key` header (`--routing-key-override`)."""
    with contextlib.ExitStack() as stack:
        replicas = [stack.enter_context(ServerProcess.kvserve(
            logs / f"replica-{i}.log", model=tiny("llama"), model_alias="fleet", threads=1, parallel=2,
            ctx_size=2048, prefix_disk_dir=logs / f"data-{i}")) for i in range(2)]
        for replica in replicas:
            replica.wait_healthy()
        port = free_port()
        command = router_command("smg", port, free_port(), [r.url for r in replicas], "round_robin")
        router = stack.enter_context(ServerProcess([*command, "--routing-key-override"], port, logs / "smg.log"))
        router.wait_for(lambda: _healthy_workers(router.url) == 2, "smg with 2 healthy workers", timeout=60)
        yield router.url, replicas


def _healthy_workers(url: str) -> int:
    status, answer = http_get(f"{url}/workers", timeout=5)
    return sum(w["is_healthy"] for w in json.loads(answer)["workers"]) if status == 200 else 0


def respond(url: str, key: str | None, **fields: object) -> httpx.Response:
    headers = {"x-smg-routing-key": key} if key else {}
    return httpx.post(f"{url}/v1/responses", headers=headers, timeout=60,
                      json={"model": "fleet", "max_output_tokens": 4, **fields})


def test_a_routing_key_takes_each_continuation_to_the_replica_that_stored_it(tiny, tmp_path: Path) -> None:
    if reason := missing_router("smg"):
        pytest.skip(reason)
    with pinned_fleet(tiny, tmp_path) as (url, replicas):
        for conversation in range(4):
            previous = respond(url, f"conversation-{conversation}", input="Hello.")
            for turn in range(3):
                assert previous.status_code == 200, previous.text
                previous = respond(url, f"conversation-{conversation}", input=f"And {turn}?",
                                   previous_response_id=previous.json()["id"])
            assert previous.status_code == 200, previous.text
        assert all(served(r) == 8 for r in replicas)  # the conversations spread, each stayed on its replica
        # Without the key round_robin takes the continuation to the other replica, which never saw it.
        unpinned = respond(url, None, input="Hello.")
        assert respond(url, None, input="And?", previous_response_id=unpinned.json()["id"]).status_code == 404

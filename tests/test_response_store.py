"""The Responses store's bounds: count, bytes and age, on a clock the test moves."""

from __future__ import annotations

from kvserve.server.responses_api.schemas import MessageItem
from kvserve.server.responses_api.store import ResponseStore


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def body(response_id: str, text: str = "") -> dict:
    return {"id": response_id, "output": [text]}


def items(text: str) -> list[MessageItem]:
    return [MessageItem(role="user", content=text)]


def test_count_bound_drops_the_oldest() -> None:
    store = ResponseStore(max_count=2, max_bytes=1 << 20, ttl=60, clock=Clock())
    for name in ("a", "b", "c"):
        assert store.put(body(name), items(name))
    assert store.get("a") is None and store.get("b").body == body("b") and len(store) == 2
    assert store.get("c").context == items("c")


def test_byte_bound_drops_the_oldest_and_refuses_what_never_fits() -> None:
    store = ResponseStore(max_count=100, max_bytes=1000, ttl=60, clock=Clock())
    for name in ("a", "b", "c"):
        assert store.put(body(name), items(name * 300))
    assert store.bytes_used <= 1000 and store.get("a") is None and store.get("c") is not None
    assert not store.put(body("huge"), items("h" * 2000))
    assert store.get("huge") is None and store.get("c") is not None


def test_entries_expire_after_ttl() -> None:
    clock = Clock()
    store = ResponseStore(max_count=10, max_bytes=1 << 20, ttl=30, clock=clock)
    store.put(body("a"), items("a"))
    clock.now = 20
    store.put(body("b"), items("b"))
    clock.now = 30
    assert store.get("a") is None and store.get("b") is not None
    clock.now = 50
    assert store.get("b") is None and len(store) == 0 and store.bytes_used == 0


def test_delete_and_replace_keep_the_byte_count() -> None:
    store = ResponseStore(max_count=10, max_bytes=1 << 20, ttl=60, clock=Clock())
    store.put(body("a"), items("a" * 50))
    store.put(body("a"), items("a"))  # the same id again replaces it
    assert len(store) == 1 and store.get("a").context == items("a")
    assert store.bytes_used == store.get("a").size
    store.put(body("b"), items("b"))
    assert store.delete("a") and not store.delete("a")
    assert store.bytes_used == store.get("b").size > 0


def test_zero_count_keeps_nothing() -> None:
    store = ResponseStore(max_count=0, max_bytes=1 << 20, ttl=60)
    assert not store.put(body("a"), items("a")) and store.get("a") is None


def test_a_response_is_its_owners_alone() -> None:
    store = ResponseStore(max_count=10, max_bytes=1 << 20, ttl=60, clock=Clock())
    assert store.put(body("r"), items("secret"), owner="key-a")
    assert store.get("r", "key-b") is None and store.get("r") is None
    assert not store.delete("r", "key-b") and store.get("r", "key-a").context == items("secret")
    assert store.delete("r", "key-a") and len(store) == 0

"""The host store: exact byte accounting under a flood, eviction order, locks, and a tree's leaves."""

from __future__ import annotations

import os
import random

import numpy as np
import pytest

from kvserve.cache.host_store import HostStore, default_budget_mb, size_of
from kvserve.llama.batch import Batch
from kvserve.llama.context import Context, ContextParams
from kvserve.llama.model import Model
from kvserve.llama.seq_state import KvPage, SeqState


def test_put_get_and_account_bytes() -> None:
    store: HostStore[str, bytes] = HostStore(100)
    assert store.put("a", b"x" * 40) and store.put("b", np.zeros(30, np.uint8))
    assert store.bytes_used == 70 and len(store) == 2 and "a" in store
    assert store.peek("a") == b"x" * 40 and store.get("missing") is None
    with pytest.raises(KeyError, match="once"):
        store.put("a", b"y")
    assert not store.put("huge", b"z" * 101)  # larger than the whole budget
    assert store.discard("a") and not store.discard("a")
    assert store.bytes_used == 30
    stats = store.stats()
    assert (stats.bytes, stats.entries, stats.evictions, stats.budget_bytes) == (30, 1, 0, 100)


def test_replace_grows_a_locked_entry_within_the_budget() -> None:
    """A page that gains its window's rows: others make room, or nothing changes."""
    evicted: list[str] = []
    store: HostStore[str, bytes] = HostStore(100, on_evict=evicted.append)
    store.put("page", b"." * 30, lock=True)
    store.put("other", b"." * 40)
    with pytest.raises(ValueError, match="locked"):
        store.replace("other", b"." * 10)
    assert store.replace("page", b"." * 50) and evicted == [] and store.bytes_used == 90
    assert store.replace("page", b"." * 70) and evicted == ["other"] and store.bytes_used == 70
    assert not store.replace("page", b"." * 101) and store.peek("page") == b"." * 70
    store.unlock("page")
    assert store.evict(70) == 70 and store.bytes_used == 0  # the lock counted the grown size


def test_evicts_cold_before_hot_then_least_recently_used() -> None:
    evicted: list[str] = []
    store: HostStore[str, bytes] = HostStore(40, on_evict=evicted.append)
    for key in "abcd":
        store.put(key, b"." * 10)
    store.get("a")  # a turns hot
    store.touch("b")  # b is the most recent cold one
    store.put("e", b"." * 25)  # needs 25 bytes: three entries go
    assert evicted == ["c", "d", "b"]
    store.get("e")
    store.put("f", b"." * 15)
    assert evicted == ["c", "d", "b", "a"]  # hot, but least recently used of what is left
    assert store.bytes_used == 40 and store.stats().evictions == 4 and store.stats().evicted_bytes == 40


def test_lower_rank_goes_first() -> None:
    evicted: list[str] = []
    store: HostStore[str, bytes] = HostStore(20, on_evict=evicted.append)
    store.put("opening", b"." * 10, rank=1)
    store.put("conversation", b"." * 10)
    store.get("conversation")
    store.put("new", b"." * 10)
    assert evicted == ["conversation"]


def test_locked_entries_are_never_evicted() -> None:
    evicted: list[str] = []
    store: HostStore[str, bytes] = HostStore(30, on_evict=evicted.append)
    store.put("read", b"." * 10, lock=True)
    store.put("held", b"." * 10)
    store.lock("held")
    store.put("free", b"." * 10)
    assert not store.fits(11) and not store.put("big", b"." * 11)
    assert evicted == [] and store.bytes_used == 30  # a refused put evicts nothing
    assert store.put("small", b"." * 10) and evicted == ["free"]
    store.unlock("held")
    assert store.put("again", b"." * 10) and evicted == ["free", "held"]
    with pytest.raises(ValueError, match="locked"):
        store.discard("read")
    with pytest.raises(ValueError, match="without a lock"):
        store.unlock("small")
    with pytest.raises(RuntimeError, match="locked"):
        store.clear()
    store.unlock("read")
    store.clear()
    assert store.bytes_used == 0 and len(store) == 0


def test_a_tree_loses_leaves_first() -> None:
    """Pages of a chain: each child locks its parent, so eviction takes the tail first."""
    store: HostStore[int, bytes] = HostStore(50)
    parent_of: dict[int, int] = {}
    evicted: list[int] = []

    def on_evict(key: int) -> None:
        evicted.append(key)
        if key in parent_of:
            store.unlock(parent_of[key])

    store.on_evict = on_evict
    for page in range(5):  # one chain 0 <- 1 <- ... <- 4, the root page most recently touched
        if page:
            store.lock(page - 1)
            parent_of[page] = page - 1
        store.put(page, b"." * 10)
    store.touch(0)
    store.evict(30)
    assert evicted == [4, 3, 2]


def test_the_budget_holds_exactly_under_a_flood() -> None:
    """Random puts, gets, locks and unlocks; after every step the bytes held are exactly the sizes
    of the entries kept, within the budget, every locked entry is kept, and each victim was the
    first in eviction order of what was evictable when it went."""
    rng = random.Random(20)
    budget = 64 * 1024
    clock = iter(range(1, 10**9))
    seen: dict[int, tuple[int, int, int]] = {}  # key -> (hits, last use, size): the test's own record
    locks: dict[int, int] = {}
    evicted: list[int] = []

    def order(key: int) -> tuple[bool, int]:
        hits, last, _ = seen[key]
        return hits > 0, last

    def on_evict(key: int) -> None:
        assert not locks.get(key)
        candidates = [k for k in seen if k in store and not locks.get(k)]
        assert all(order(key) < order(k) for k in candidates)
        evicted.append(key)

    store: HostStore[int, bytes] = HostStore(budget, on_evict=on_evict)
    for key in range(20_000):
        size = rng.choice((512, 4096, 12_000, 40_000))
        if store.put(key, bytes(size)):
            seen[key] = (0, next(clock), size)
        else:
            assert size > budget - sum(seen[k][2] for k, n in locks.items() if n)
        held = [k for k in seen if k in store]
        if held and rng.random() < 0.5:
            k = rng.choice(held)
            store.get(k)
            hits, _, size = seen[k]
            seen[k] = (hits + 1, next(clock), size)
        if held and rng.random() < 0.1:
            k = rng.choice(held)
            store.lock(k)
            locks[k] = locks.get(k, 0) + 1
        locked = [k for k, n in locks.items() if n]
        if locked and rng.random() < 0.12:
            k = rng.choice(locked)
            store.unlock(k)
            locks[k] -= 1
        kept = [k for k in seen if k in store]
        assert store.bytes_used == sum(seen[k][2] for k in kept) <= budget
        assert all(k in store for k in locked)
        for gone in [k for k in seen if k not in store]:
            del seen[gone]
    assert len(evicted) > 10_000 and store.stats().evictions == len(evicted)
    assert len(store._heap) <= 2 * len(store) + 64  # stale heap items are compacted away


def test_default_budget_is_a_quarter_of_ram() -> None:
    ram_mb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / (1024 * 1024)
    assert default_budget_mb() == int(ram_mb // 4)


class _Pages:
    """A chain of pages as one entry (a store of a page tree would key each page by its node)."""

    def __init__(self, pages: list[KvPage]) -> None:
        self.pages = pages
        self.nbytes = sum(p.nbytes for p in pages)


def _eval(ctx: Context, batch: Batch, seq: int, tokens: list[int], start: int) -> np.ndarray:
    batch.clear()
    for i, token in enumerate(tokens):
        batch.add(token, start + i, seq, i == len(tokens) - 1)
    ctx.decode(batch)
    return ctx.logits(batch.n_tokens - 1).copy()


def test_pages_and_checkpoints_share_one_budget(tiny) -> None:
    """A llama page's rows and a Mamba checkpoint are entries of one store; each restores from it."""
    store: HostStore[object, object] = HostStore(1 << 20)
    tokens = list(range(200, 240))
    logits = {}
    for arch in ("llama", "mamba"):
        model = Model(tiny(arch))
        ctx = Context(model, ContextParams(n_ctx_seq=256, n_batch=64, n_seq_max=2, n_threads=1))
        batch = Batch(64)
        state = SeqState(ctx) if arch == "llama" else None
        for seq in (0, 1):
            if seq == 0:
                _eval(ctx, batch, 0, tokens[:32], 0)
                key = ("pages", arch) if arch == "llama" else ("checkpoint", arch)
                value = state.donate(0, 16) if arch == "llama" else ctx.read_seq_state(0)
                assert store.put(key, value if arch == "mamba" else _Pages(value))
            else:
                stored = store.get(key)
                if arch == "llama":
                    state.attach(1, stored.pages, 32)
                else:
                    ctx.write_seq_state(1, stored)
            logits[arch, seq] = _eval(ctx, batch, seq, tokens[32:33], 32)
        batch.close()
        ctx.close()
        model.close()
        np.testing.assert_array_equal(logits[arch, 0], logits[arch, 1])
    assert store.bytes_used == sum(size_of(store.peek(k)) for k in (("pages", "llama"), ("checkpoint", "mamba")))

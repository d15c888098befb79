"""KV cache events in vLLM's wire format: kvserve/cache/kv_events.py publishes, the consumer of
kvserve/testing/kv_events.py decodes and indexes (no models). Sockets on ephemeral TCP ports of
127.0.0.1."""

from __future__ import annotations

import itertools
import threading
import time

import msgpack
import pytest
import zmq

from kvserve.cache.kv_events import END_SEQ, KvEventPublisher
from kvserve.testing.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventIndex,
    Subscriber,
    decode_batch,
)

ANY = "tcp://127.0.0.1:*"
BS = 4


@pytest.fixture(autouse=True)
def _pod(monkeypatch):
    monkeypatch.setenv("POD_NAME", "pod-a")


@pytest.fixture
def closing():
    """Closes what a test opened, publishers first."""
    opened: list = []
    yield opened.append
    for thing in sorted(opened, key=lambda t: not isinstance(t, KvEventPublisher)):
        thing.close()


def h(*path: int) -> bytes:
    """A block hash named by its path from the root."""
    return b"blk-" + bytes(path)


def toks(*path: int) -> list[int]:
    """The tokens of the chain `path`: block i holds 4 tokens that depend on path[: i + 1]."""
    return [t for i in range(len(path)) for t in (path[i] * 10 + i * 1000 + k for k in range(BS))]


def wait_until(cond, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.005)
    return cond()


def blocks(events) -> list[tuple]:
    """Events one block at a time, so batching and merging do not change what is compared."""
    out: list[tuple] = []
    for e in events:
        if isinstance(e, BlockStored):
            parents = [e.parent_block_hash, *e.block_hashes[:-1]]
            for i, (b, p) in enumerate(zip(e.block_hashes, parents)):
                out.append(("stored", b, p, tuple(e.token_ids[i * BS : (i + 1) * BS]), e.medium, e.lora_name))
        elif isinstance(e, BlockRemoved):
            out.extend(("removed", b, e.medium) for b in e.block_hashes)
        else:
            out.append(("cleared",))
    return out


def publish_script(pub: KvEventPublisher, rounds: int) -> dict[str, list[tuple]]:
    """Stored chains, removals and clears on two models, in several wakes; what each topic must carry."""
    expect: dict[str, list[tuple]] = {"kv@pod-a@m1": [], "kv@pod-a@m2": []}
    for r in range(rounds):
        for model in ("m1", "m2"):
            topic = f"kv@pod-a@{model}"
            pub.stored(model, [h(r), h(r, 1)], None, toks(r, 1), BS, None, "cpu")
            pub.stored(model, [h(r, 1, 2)], h(r, 1), toks(r, 1, 2)[2 * BS :], BS, "ad", "cpu")  # another adapter
            pub.removed(model, [h(r, 1, 2)], "cpu")
            expect[topic] += [("stored", h(r), None, tuple(toks(r)), "cpu", None),
                              ("stored", h(r, 1), h(r), tuple(toks(r, 1)[BS:]), "cpu", None),
                              ("stored", h(r, 1, 2), h(r, 1), tuple(toks(r, 1, 2)[2 * BS :]), "cpu", "ad"),
                              ("removed", h(r, 1, 2), "cpu")]
            if r % 3 == 2:
                pub.cleared(model)
                expect[topic].append(("cleared",))
        time.sleep(0.02)  # two intervals: the rounds go out in several batches
    return expect


# -- the wire ------------------------------------------------------------------------------------


def test_every_message_decodes_with_its_topic_and_numbers_without_gaps(closing):
    pub = KvEventPublisher(ANY, ANY, interval=0.01)
    closing(pub)
    raw = zmq.Context.instance().socket(zmq.SUB)
    closing(raw)
    raw.setsockopt(zmq.SUBSCRIBE, b"")
    raw.connect(pub.endpoint)
    sub = Subscriber(pub.endpoint, pub.replay_endpoint, topic="kv@pod-a@")
    closing(sub)
    sub.poll(0.3)  # both connected (a replay fills what a slow join misses anyway)

    expect = publish_script(pub, rounds=12)
    assert wait_until(lambda: pub.stats()["queued"] == 0 and pub.stats()["events"] == 12 * 2 * 3 + 8)
    last = pub.stats()["last_seq"]
    assert last >= 2 * 3  # several wakes, a batch per topic each
    assert sub.wait_for(last)

    assert [b.seq for b in sub.batches] == list(range(last + 1))
    assert sub.lost == [] and sub.errors == [] and sub.duplicates == 0
    for topic, want in expect.items():
        got = [e for b in sub.batches if b.topic == topic for e in b.events]
        assert blocks(got) == want, topic
    assert {b.topic for b in sub.batches} == set(expect)

    frames = []
    while raw.poll(200):
        frames.append(raw.recv_multipart())
    seqs = [int.from_bytes(f[1], "big") for f in frames]
    assert frames and all(len(f) == 3 and len(f[1]) == 8 for f in frames)
    assert seqs == list(range(seqs[0], last + 1))  # a slow join may miss a first few, never one between
    for topic, _, payload in frames:
        batch = msgpack.unpackb(payload)
        assert topic.decode() in expect
        assert isinstance(batch, list) and len(batch) == 3 and isinstance(batch[0], float) and batch[2] == 0
        for event in batch[1]:  # msgspec's array_like + tag: the class name, then the fields in order
            assert event[0] in ("BlockStored", "BlockRemoved", "AllBlocksCleared")
            assert len(event) == {"BlockStored": 8, "BlockRemoved": 3, "AllBlocksCleared": 1}[event[0]]
            if event[0] == "BlockStored":
                assert all(isinstance(x, bytes) for x in event[1]) and event[5] is None and event[6] == "cpu"


def test_a_chain_stored_call_by_call_goes_out_as_one_event(closing):
    pub = KvEventPublisher(ANY, ANY, interval=0.2)
    closing(pub)
    pub.stored("m", [h(1)], None, toks(1), BS, None, "cpu")
    pub.stored("m", [h(1, 2)], h(1), toks(1, 2)[BS:], BS, None, "cpu")
    pub.stored("m", [h(1, 2, 3)], h(1, 2), toks(1, 2, 3)[2 * BS :], BS, None, "disk")  # another medium
    pub.removed("m", [h(1, 2)], "cpu")
    pub.removed("m", [h(1)], "cpu")
    assert wait_until(lambda: pub.stats()["events"] == 5)
    sub = Subscriber(pub.endpoint, pub.replay_endpoint)
    closing(sub)
    assert sub.wait_for(0)
    assert sub.batches[0].events == [
        BlockStored([h(1), h(1, 2)], None, toks(1, 2), BS, None, "cpu", None),
        BlockStored([h(1, 2, 3)], h(1, 2), toks(1, 2, 3)[2 * BS :], BS, None, "disk", None),
        BlockRemoved([h(1, 2), h(1)], "cpu"),
    ]


def test_the_map_layout_is_vllms_current_one(closing):
    pub = KvEventPublisher(ANY, ANY, layout="map")
    closing(pub)
    pub.stored("m", [h(1)], None, toks(1), BS, "ad", "cpu")
    pub.removed("m", [h(1)], "cpu")
    pub.cleared("m")
    assert wait_until(lambda: pub.stats()["events"] == 3)
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    closing(dealer)
    dealer.connect(pub.replay_endpoint)
    dealer.send_multipart([b"", (0).to_bytes(8, "big")])
    assert dealer.poll(3000)
    _, topic, seq, payload = dealer.recv_multipart()
    assert (topic, seq) == (b"kv@pod-a@m", (0).to_bytes(8, "big"))
    assert msgpack.unpackb(payload)[1] == [
        {"type": "BlockStored", "block_hashes": [h(1)], "parent_block_hash": None, "token_ids": toks(1),
         "block_size": BS, "lora_id": None, "medium": "cpu", "lora_name": "ad"},
        {"type": "BlockRemoved", "block_hashes": [h(1)], "medium": "cpu"},
        {"type": "AllBlocksCleared"},
    ]
    assert dealer.poll(3000) and dealer.recv_multipart() == [b"", b"", END_SEQ, b""]


# -- replay --------------------------------------------------------------------------------------


def publish_batches(pub: KvEventPublisher, n: int, first: int = 0) -> None:
    """`n` batches: one stored event each on its own model, all in one wake."""
    for i in range(first, first + n):
        pub.stored(f"m{i}", [h(i)], None, toks(i), BS, None, "cpu")
    assert wait_until(lambda: pub.stats()["batches"] == first + n)


def test_a_late_subscriber_gets_the_batches_before_it_by_replay(closing):
    pub = KvEventPublisher(ANY, ANY)
    closing(pub)
    publish_batches(pub, 30)
    sub = Subscriber(pub.endpoint, pub.replay_endpoint, topic="kv@pod-a@")
    closing(sub)
    assert sub.wait_for(29)
    assert [b.seq for b in sub.batches] == list(range(30))
    assert [b.topic for b in sub.batches] == [f"kv@pod-a@m{i}" for i in range(30)]
    assert sub.lost == [] and sub.errors == []
    assert sub.index("kv@pod-a@m7").predict(toks(7) + [1], BS) == BS


def test_a_subscriber_that_sees_a_gap_asks_a_replay_from_the_first_missed(closing):
    pub = KvEventPublisher(ANY, ANY)
    closing(pub)
    publish_batches(pub, 10)
    sub = Subscriber(pub.endpoint, pub.replay_endpoint, catch_up=False)
    closing(sub)
    n = 10
    while sub.last_seq < 0 and n < 100:  # until one live batch got through the slow join
        publish_batches(pub, 1, first=n)
        n += 1
        sub.poll(0.05)
    assert sub.wait_for(n - 1)
    assert sub.gaps[0][0] == 0 and sub.replays >= 1
    assert [b.seq for b in sub.batches] == list(range(n))
    assert sub.lost == [] and sub.errors == []


def test_what_the_ring_no_longer_holds_is_lost_and_said_so(closing):
    pub = KvEventPublisher(ANY, ANY, replay_batches=5)
    closing(pub)
    publish_batches(pub, 20)
    sub = Subscriber(pub.endpoint, pub.replay_endpoint)
    closing(sub)
    assert sub.wait_for(19)
    assert sub.lost == [(0, 15)]
    assert [b.seq for b in sub.batches] == list(range(15, 20))


def test_a_skipped_sequence_number_is_seen(closing):
    """The check the gap test relies on: a publisher that skips a number is caught."""
    pub = KvEventPublisher(ANY, ANY)
    closing(pub)
    pub._seq = (i for i in itertools.count() if i != 3)
    publish_batches(pub, 6)
    sub = Subscriber(pub.endpoint, pub.replay_endpoint)
    closing(sub)
    assert sub.wait_for(6)
    assert sub.lost == [(3, 4)]


def test_a_batch_that_does_not_encode_is_dropped_and_the_numbers_go_on(closing):
    pub = KvEventPublisher(ANY, ANY, interval=0.2)
    closing(pub)
    pub.stored("bad", [object()], None, toks(1), BS, None, "cpu")  # type: ignore[list-item]
    pub.stored("good", [h(1)], None, toks(1), BS, None, "cpu")
    assert wait_until(lambda: pub.stats()["events"] == 1)
    publish_batches(pub, 1, first=1)
    assert pub.stats()["dropped"] == 1
    sub = Subscriber(pub.endpoint, pub.replay_endpoint)
    closing(sub)
    assert sub.wait_for(1)
    assert [b.topic for b in sub.batches] == ["kv@pod-a@good", "kv@pod-a@m1"] and sub.lost == []


# -- decoding both layouts -----------------------------------------------------------------------

STORED_FIELDS = {"block_hashes": [h(1), 7], "parent_block_hash": None, "token_ids": toks(1), "block_size": BS,
                 "lora_id": None, "medium": "GPU", "lora_name": None}
EXPECTED = [BlockStored([h(1), 7], None, toks(1), BS, None, "GPU", None), BlockRemoved([7], "GPU"),
            AllBlocksCleared()]


def test_positional_and_tagged_map_events_decode_alike():
    positional = [["BlockStored", *STORED_FIELDS.values()], ["BlockRemoved", [7], "GPU"], ["AllBlocksCleared"]]
    tagged = [{"type": "BlockStored", **STORED_FIELDS}, {"type": "BlockRemoved", "block_hashes": [7], "medium": "GPU"},
              {"type": "AllBlocksCleared"}]
    for events in (positional, tagged):
        assert decode_batch(msgpack.packb([1.5, events, 0])) == (1.5, EXPECTED)
    assert decode_batch(msgpack.packb({"ts": 1.5, "events": tagged, "data_parallel_rank": 0})) == (1.5, EXPECTED)
    # fields vLLM added later (extra_keys, group_idx, ...) are ignored; older events lack medium/lora_name
    newer = [["BlockStored", *STORED_FIELDS.values(), [None, None], 0, "full_attention"],
             {"type": "BlockStored", **STORED_FIELDS, "extra_keys": None, "group_idx": 0}]
    assert decode_batch(msgpack.packb([2, newer]))[1] == [EXPECTED[0]] * 2
    older = ["BlockStored", [5], None, toks(1), BS, None]
    assert decode_batch(msgpack.packb([2, [older]]))[1] == [BlockStored([5], None, toks(1), BS)]


@pytest.mark.parametrize("payload", [
    b"\xc1",  # not msgpack
    msgpack.packb("batch"),
    msgpack.packb([1.0]),
    msgpack.packb(["now", []]),
    msgpack.packb([1.0, [["BlockMoved", [1]]]]),
    msgpack.packb([1.0, [{"type": "BlockMoved"}]]),
    msgpack.packb([1.0, [{"block_hashes": [1]}]]),  # no tag
    msgpack.packb([1.0, [["BlockStored", [1], None, [1, 2]]]]),  # no block_size
    msgpack.packb([1.0, [["BlockRemoved", "nope", "GPU"]]]),
    msgpack.packb([1.0, [{"type": "BlockStored", **STORED_FIELDS, "token_ids": ["a"]}]]),
])
def test_anything_else_raises(payload):
    with pytest.raises(ValueError):
        decode_batch(payload)


# -- the index -----------------------------------------------------------------------------------


def test_the_index_predicts_whole_blocks_and_follows_media():
    index = EventIndex()
    prompt = toks(1, 2, 3) + [99]
    index.apply(BlockStored([h(1), h(1, 2), h(1, 2, 3)], None, toks(1, 2, 3), BS, medium="cpu"))
    index.apply(BlockStored([h(1), h(1, 2)], None, toks(1, 2), BS, medium="disk"))
    assert index.predict(prompt, BS) == 3 * BS
    assert index.predict(toks(1, 2, 3), BS) == 3 * BS  # the last block too (the replica attaches it but a row)
    assert index.predict(toks(1, 2, 3)[:-1], BS) == 2 * BS  # a partial last block is not held
    assert index.predict(toks(1, 2)[:BS] + toks(7)[:BS] + [1], BS) == BS  # diverges at block 2
    assert index.predict(toks(5, 2, 3) + [1], BS) == 0  # another first block

    index.apply(BlockRemoved([h(1), h(1, 2), h(1, 2, 3)], "cpu"))
    assert index.media(h(1)) == {"disk"}
    assert index.predict(prompt, BS) == 2 * BS  # still on disk
    index.apply(BlockRemoved([h(1, 2)], "disk"))
    assert index.predict(prompt, BS) == BS
    index.apply(BlockRemoved([h(1)], "disk"))
    assert index.predict(prompt, BS) == 0 and index.blocks == {}


def test_the_index_from_the_wire_follows_media_and_clears_by_topic(closing):
    pub = KvEventPublisher(ANY, ANY)
    closing(pub)
    sub = Subscriber(pub.endpoint, pub.replay_endpoint, topic="kv@pod-a@")
    closing(sub)
    prompt = toks(1, 2) + [5]

    def settle(n_events: int) -> None:
        assert wait_until(lambda: pub.stats()["events"] == n_events)
        assert sub.wait_for(pub.stats()["last_seq"])

    for model in ("a", "b"):
        pub.stored(model, [h(1), h(1, 2)], None, toks(1, 2), BS, None, "cpu")
        pub.stored(model, [h(1), h(1, 2)], None, toks(1, 2), BS, None, "disk")
    pub.removed("a", [h(1), h(1, 2)], "cpu")
    settle(5)
    a, b = sub.index("kv@pod-a@a"), sub.index("kv@pod-a@b")
    assert a.predict(prompt, BS) == 2 * BS and a.media(h(1)) == {"disk"}
    pub.removed("a", [h(1, 2)], "disk")
    settle(6)
    assert a.predict(prompt, BS) == BS
    pub.cleared("a")
    settle(7)
    assert a.predict(prompt, BS) == 0 and b.predict(prompt, BS) == 2 * BS
    assert sub.lost == [] and sub.errors == []


# -- never blocking, bounded close ---------------------------------------------------------------


def test_a_full_queue_drops_and_counts_and_calls_never_wait(closing):
    pub = KvEventPublisher(ANY, max_queued=10, interval=0.001)
    closing(pub)
    entered, release = threading.Event(), threading.Event()
    real_send = pub._send

    def stuck_send(sock, frames):
        entered.set()
        release.wait(30)
        real_send(sock, frames)

    pub._send = stuck_send
    pub.stored("m", [h(0)], None, toks(0), BS, None, "cpu")
    assert entered.wait(5)  # the publisher thread is stuck in a send

    start = time.perf_counter()
    for i in range(10_000):
        pub.stored("m", [h(1)], None, toks(1), BS, None, "cpu")
    elapsed = time.perf_counter() - start
    assert elapsed < 1.0, elapsed  # ~µs a call; no call waits for the thread
    stats = pub.stats()
    assert (stats["dropped"], stats["queued"], stats["batches"]) == (10_000 - 10, 10, 1)

    start = time.perf_counter()
    pub.close(timeout=0.3)  # the thread is still stuck: close gives up on it in time
    assert time.perf_counter() - start < 1.0
    pub.removed("m", [h(1)], "cpu")
    assert pub.stats()["dropped"] == 10_000 - 10 + 1  # after close, dropped too
    release.set()
    pub._thread.join(5)
    assert not pub._thread.is_alive()
    assert pub.stats()["events"] == 1 + 10  # what was queued went out once the send returned


def test_close_sends_what_is_queued_then_closes_in_time(closing):
    pub = KvEventPublisher(ANY, ANY, interval=0.5)
    closing(pub)  # a second close is a no-op
    sub = Subscriber(pub.endpoint, pub.replay_endpoint)
    closing(sub)
    pub.cleared("m")
    assert sub.wait_for(0, timeout=5)  # connected, live
    for i in range(5):
        pub.stored("m", [h(i)], None, toks(i), BS, None, "cpu")
    start = time.perf_counter()
    pub.close()
    assert time.perf_counter() - start < 2.5
    assert not pub._thread.is_alive()
    assert pub.stats() == {"batches": 2, "events": 6, "dropped": 0, "last_seq": 1, "queued": 0}
    assert sub.wait_for(1, timeout=3)
    assert [bl[1] for bl in blocks(sub.batches[1].events)] == [h(i) for i in range(5)]


def test_a_bad_endpoint_fails_at_construction():
    with pytest.raises(OSError, match="--kv-events 'tcp://no-such-host.invalid:1': cannot bind"):
        KvEventPublisher("tcp://no-such-host.invalid:1")


@pytest.mark.parametrize("endpoint, replay, says", [
    ("garbage", None, "--kv-events 'garbage': cannot bind: Invalid argument"),
    ("ipc:///nonexistent/dir/sock", None, "--kv-events 'ipc:///nonexistent/dir/sock': cannot bind: No such file"),
    (ANY, "garbage", "--kv-events-replay 'garbage': cannot bind: Invalid argument"),
])
def test_an_address_that_does_not_bind_is_an_os_error_naming_its_flag(endpoint, replay, says):
    with pytest.raises(OSError, match=says):
        KvEventPublisher(endpoint, replay)


def test_a_port_in_use_is_an_os_error_naming_its_flag(closing):
    first = KvEventPublisher(ANY)
    closing(first)
    with pytest.raises(OSError, match=f"--kv-events-replay '{first.endpoint}': cannot bind: Address already in use"):
        KvEventPublisher(ANY, first.endpoint)

"""A consumer of KV cache events in vLLM's wire format (kvserve/cache/kv_events.py publishes them; vLLM's
vllm/distributed/kv_events.py defines it): what the tests check the publisher against, and a reference
for a router's own.

    sub = Subscriber("tcp://replica:5557", "tcp://replica:5558", topic="kv@")
    while True:
        sub.poll(0.1)
        sub.index("kv@replica@my-model").predict(prompt_tokens, block_size=64)

Invariants:
- `decode_batch` takes an EventBatch as vLLM's array `[ts, events, data_parallel_rank]` (or a map with
  "ts" and "events"), each event a tagged array (`["BlockStored", ...]`, vLLM until its PR #42892) or a
  tagged map (`{"type": "BlockStored", ...}`, since; 0.26.0 sends maps); fields past the ones known are
  ignored; a missing required field, a wrong type or an unknown tag raises ValueError;
- a `Subscriber` applies every sequence number at most once and in increasing order; a number it has
  not seen (a gap, or the first message of a late start) is asked of the replay socket from the first
  one missing, and what arrives live meanwhile waits; numbers neither live nor replay brings are
  recorded in `lost` and skipped;
- sequence numbers are the publisher's, across all its topics: subscribe to a prefix of them all (the
  pod's "kv@pod@") or every other topic's batch shows as a gap, filled (and ignored) by a replay;
- an `EventIndex` holds a block while some medium that stored it has not removed it; AllBlocksCleared
  empties the index of its topic.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Union

import msgpack
import zmq

Hash = Union[bytes, int]
END_SEQ = (-1).to_bytes(8, "big", signed=True)


@dataclass(frozen=True)
class BlockStored:
    block_hashes: list[Hash]
    parent_block_hash: Hash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None


@dataclass(frozen=True)
class BlockRemoved:
    block_hashes: list[Hash]
    medium: str | None = None


@dataclass(frozen=True)
class AllBlocksCleared:
    pass


Event = Union[BlockStored, BlockRemoved, AllBlocksCleared]

# tag -> (class, its fields in vLLM's declaration order, how many are required)
_EVENTS: dict[str, tuple[type, tuple[str, ...], int]] = {
    "BlockStored": (BlockStored, ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
                                  "medium", "lora_name"), 4),
    "BlockRemoved": (BlockRemoved, ("block_hashes", "medium"), 1),
    "AllBlocksCleared": (AllBlocksCleared, (), 0),
}


# -- decoding -------------------------------------------------------------------------------------


def decode_batch(payload: bytes) -> tuple[float, list[Event]]:
    """An EventBatch's timestamp and events, either layout; ValueError for anything else."""
    try:
        batch = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except Exception as e:
        raise ValueError(f"not msgpack: {e}") from None
    if isinstance(batch, list) and len(batch) >= 2:
        ts, events = batch[0], batch[1]
    elif isinstance(batch, dict) and "ts" in batch and "events" in batch:
        ts, events = batch["ts"], batch["events"]
    else:
        raise ValueError(f"not an EventBatch: {type(batch).__name__}")
    if not isinstance(ts, (int, float)) or isinstance(ts, bool) or not isinstance(events, list):
        raise ValueError("an EventBatch is [ts: float, events: list, ...]")
    return float(ts), [decode_event(e) for e in events]


def decode_event(obj: Any) -> Event:
    """One event: a tagged array (tag first, fields in order) or a tagged map (tag under "type")."""
    if isinstance(obj, list) and obj and isinstance(obj[0], str):
        tag, values = obj[0], dict(zip(_fields(obj[0]), obj[1:]))
    elif isinstance(obj, dict) and isinstance(obj.get("type"), str):
        tag, values = obj["type"], obj
        _fields(tag)
    else:
        raise ValueError(f"not a tagged event: {obj!r:.80}")
    cls, names, required = _EVENTS[tag]
    missing = [n for n in names[:required] if n not in values]
    if missing:
        raise ValueError(f"{tag} without {', '.join(missing)}")
    fields = {n: values[n] for n in names if n in values}
    _check(tag, fields)
    return cls(**fields)


def _fields(tag: str) -> tuple[str, ...]:
    if tag not in _EVENTS:
        raise ValueError(f"unknown event type {tag!r}")
    return _EVENTS[tag][1]


def _is_hash(v: Any) -> bool:
    return isinstance(v, (bytes, int)) and not isinstance(v, bool)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


_CHECKS = {
    "block_hashes": lambda v: isinstance(v, list) and all(_is_hash(h) for h in v),
    "parent_block_hash": lambda v: v is None or _is_hash(v),
    "token_ids": lambda v: isinstance(v, list) and all(_is_int(t) for t in v),
    "block_size": _is_int,
    "lora_id": lambda v: v is None or _is_int(v),
    "medium": lambda v: v is None or isinstance(v, str),
    "lora_name": lambda v: v is None or isinstance(v, str),
}


def _check(tag: str, fields: dict[str, Any]) -> None:
    for name, value in fields.items():
        if not _CHECKS[name](value):
            raise ValueError(f"{tag}.{name} of a wrong type: {value!r:.80}")


# -- what a router knows --------------------------------------------------------------------------


@dataclass
class _Block:
    parent: Hash | None
    tokens: tuple[int, ...]
    media: set[str | None] = field(default_factory=set)


class EventIndex:
    """What a router knows from the events alone: for each block hash, its parent, tokens and the media it is in."""

    def __init__(self) -> None:
        self.blocks: dict[Hash, _Block] = {}
        self._children: dict[tuple[Hash | None, tuple[int, ...]], set[Hash]] = {}  # present blocks only
        self.skipped = 0  # BlockStored whose tokens are not whole blocks, one per hash (not indexed)

    def apply(self, event: Event) -> None:
        if isinstance(event, BlockStored):
            self._store(event)
        elif isinstance(event, BlockRemoved):
            self._remove(event)
        elif isinstance(event, AllBlocksCleared):
            self.blocks.clear()
            self._children.clear()
        else:
            raise TypeError(f"not an event: {event!r}")

    def media(self, block_hash: Hash) -> set[str | None]:
        block = self.blocks.get(block_hash)
        return set(block.media) if block else set()

    def predict(self, tokens: list[int], block_size: int) -> int:
        """The tokens of the whole blocks of a prompt a replica holds, from the start: first blocks
        (parent None) then children by (parent, tokens). (It attaches them but the prompt's last token.)"""
        if block_size <= 0:
            raise ValueError("block_size must be > 0")
        most = len(tokens) // block_size
        frontier: set[Hash | None] = {None}
        n = 0
        while n < most:
            chunk = tuple(tokens[n * block_size : (n + 1) * block_size])
            frontier = {h for p in frontier for h in self._children.get((p, chunk), ())}
            if not frontier:
                break
            n += 1
        return n * block_size

    def _store(self, e: BlockStored) -> None:
        size = e.block_size
        if size <= 0 or len(e.token_ids) != size * len(e.block_hashes):
            self.skipped += 1
            return
        parent = e.parent_block_hash
        for i, h in enumerate(e.block_hashes):
            block = self.blocks.get(h)
            if block is None:
                block = self.blocks[h] = _Block(parent, tuple(e.token_ids[i * size : (i + 1) * size]))
                self._children.setdefault((block.parent, block.tokens), set()).add(h)
            block.media.add(e.medium)
            parent = h

    def _remove(self, e: BlockRemoved) -> None:
        for h in e.block_hashes:
            block = self.blocks.get(h)
            if block is None:
                continue
            block.media.discard(e.medium)
            if not block.media:
                del self.blocks[h]
                siblings = self._children.get((block.parent, block.tokens), set())
                siblings.discard(h)
                if not siblings:
                    self._children.pop((block.parent, block.tokens), None)


# -- the subscriber -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Batch:
    seq: int
    topic: str
    ts: float
    events: list[Event]


class Subscriber:
    """A SUB socket (and a DEALER for replays) that decodes every message, checks sequence numbers and
    applies batches, in order, to one EventIndex per topic. Driven by `poll`, on the caller's thread."""

    def __init__(self, endpoint: str, replay_endpoint: str | None = None, topic: str = "", *,
                 catch_up: bool = True, replay_timeout: float = 2.0) -> None:
        self.topic = topic
        self.replay_timeout = replay_timeout
        self.last_seq = -1
        self.batches: list[Batch] = []  # applied, in order (batches of other topics are skipped)
        self.events: list[tuple[int, str, Event]] = []  # (seq, topic, event), in order
        self.gaps: list[tuple[int, int]] = []  # (first missing, the number that showed it)
        self.lost: list[tuple[int, int]] = []  # [first, end) of numbers neither live nor replay brought
        self.errors: list[tuple[int, str]] = []  # (seq, why) of messages that did not decode
        self.duplicates = 0  # live messages of a number already had (live, or brought by a replay)
        self.replays = 0  # replay requests sent
        self.indexes: dict[str, EventIndex] = {}
        self._pending: dict[int, tuple[bytes, bytes]] = {}  # seq -> (topic, payload), waiting for its turn
        self._replay_since: float | None = None  # when the replay in flight was asked
        self._replay_top = -1  # the highest number the replay in flight brought
        self._ctx = zmq.Context()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.RCVHWM, 0)
        self._sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self._sub.connect(endpoint)
        self._replay_endpoint = replay_endpoint
        self._dealer = self._new_dealer() if replay_endpoint else None
        if catch_up and self._dealer is not None:
            self._request_replay()

    def index(self, topic: str) -> EventIndex:
        return self.indexes.setdefault(topic, EventIndex())

    def poll(self, timeout: float = 0.1) -> int:
        """Receive and apply what arrives within `timeout` seconds; the number of batches applied."""
        before, deadline = len(self.batches), time.monotonic() + timeout
        poller = zmq.Poller()
        poller.register(self._sub, zmq.POLLIN)
        if self._dealer is not None:
            poller.register(self._dealer, zmq.POLLIN)
        while True:
            ready = dict(poller.poll(max(0.0, deadline - time.monotonic()) * 1000))
            if self._sub in ready:
                self._receive_live()
            if self._dealer is not None and self._dealer in ready:
                self._receive_replay()
            self._check_replay_timeout()
            self._drain()
            self._check_gap()
            if time.monotonic() >= deadline:
                return len(self.batches) - before

    def wait_for(self, seq: int, timeout: float = 5.0) -> bool:
        """Poll until `seq` is applied (or skipped as lost); False after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while self.last_seq < seq and time.monotonic() < deadline:
            self.poll(min(0.05, max(0.0, deadline - time.monotonic())))
        return self.last_seq >= seq

    def close(self) -> None:
        self._sub.close(linger=0)
        if self._dealer is not None:
            self._dealer.close(linger=0)
        self._ctx.term()

    # -- live messages --------------------------------------------------------------------------

    def _receive_live(self) -> None:
        while True:
            try:
                frames = self._sub.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 3 or len(frames[1]) != 8:
                self.errors.append((-1, f"a message of {len(frames)} frames"))
                continue
            topic, seq_bytes, payload = frames
            seq = int.from_bytes(seq_bytes, "big")
            if seq <= self.last_seq or seq in self._pending:
                self.duplicates += 1
                continue
            self._pending[seq] = (topic, payload)

    def _check_gap(self) -> None:
        """After a drain, a number waiting means the one before it is missing: ask a replay for it (or,
        with no replay socket, skip it as lost)."""
        if not self._pending or self._replay_since is not None:
            return
        first = min(self._pending)
        self.gaps.append((self.last_seq + 1, first))
        if self._dealer is not None:
            self._request_replay()
        else:
            self._skip_to(first)
            self._drain()

    # -- replays ----------------------------------------------------------------------------------

    def _new_dealer(self) -> zmq.Socket:
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.RCVHWM, 0)
        dealer.connect(self._replay_endpoint)
        return dealer

    def _request_replay(self) -> None:
        """Ask for every batch from the first number not applied; REQ's envelope: an empty frame first."""
        self._dealer.send_multipart([b"", (self.last_seq + 1).to_bytes(8, "big")])
        self.replays += 1
        self._replay_since, self._replay_top = time.monotonic(), -1

    def _receive_replay(self) -> None:
        while True:
            try:
                frames = self._dealer.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if frames and frames[0] == b"":
                frames = frames[1:]
            if len(frames) == 2:  # vLLM before its PR #45177: [seq, payload], no topic
                frames = [self.topic.encode(), *frames]
            if len(frames) != 3:
                self.errors.append((-1, f"a replay reply of {len(frames)} frames"))
                continue
            topic, seq_bytes, payload = frames
            if seq_bytes == END_SEQ or not payload:
                self._end_replay()
                continue
            seq = int.from_bytes(seq_bytes, "big")
            self._replay_top = max(self._replay_top, seq)
            if seq > self.last_seq and seq not in self._pending:
                self._pending[seq] = (topic, payload)

    def _end_replay(self) -> None:
        """The replay is over: apply what it brought; a hole left below what it brought (or with nothing
        brought) is lost, no longer kept; one above it is a new gap (`_check_gap` asks again)."""
        if self._replay_since is None:
            return  # the end of a replay given up on
        self._replay_since = None
        self._drain()
        if self._pending and (self.last_seq < self._replay_top or self._replay_top < 0):
            self._skip_to(min(self._pending))

    def _check_replay_timeout(self) -> None:
        if self._replay_since is None or time.monotonic() - self._replay_since < self.replay_timeout:
            return
        self._dealer.close(linger=0)  # so a late answer cannot end a later replay
        self._dealer = self._new_dealer()
        self._replay_top = -1
        self._end_replay()

    def _skip_to(self, seq: int) -> None:
        self.lost.append((self.last_seq + 1, seq))
        self.last_seq = seq - 1

    # -- applying ---------------------------------------------------------------------------------

    def _drain(self) -> None:
        while self.last_seq + 1 in self._pending:
            seq = self.last_seq + 1
            topic, payload = self._pending.pop(seq)
            self.last_seq = seq
            self._apply(seq, topic.decode(errors="replace"), payload)

    def _apply(self, seq: int, topic: str, payload: bytes) -> None:
        if not topic.startswith(self.topic):
            return  # another topic's batch, brought by a replay
        try:
            ts, events = decode_batch(payload)
        except ValueError as e:
            self.errors.append((seq, str(e)))
            return
        self.batches.append(Batch(seq, topic, ts, events))
        index = self.index(topic)
        for event in events:
            index.apply(event)
            self.events.append((seq, topic, event))

"""KV cache events for routers, on the wire as vLLM publishes them (vllm/distributed/kv_events.py,
ZmqEventPublisher), so a router built for vLLM's events follows kvserve's cache too.

Wire:
- PUB: one message per topic per wake, three frames: the topic (utf-8), the sequence number (8 bytes,
  big-endian) and msgpack of an EventBatch `[ts, events, data_parallel_rank]` (ts: float seconds since
  the epoch, rank 0);
- an event is msgspec's tagged struct: positional (`array_like`, as vLLM sent it until its PR #42892),
  the tag first and the required fields in declaration order,
    ["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium, lora_name]
    ["BlockRemoved", block_hashes, medium]
    ["AllBlocksCleared"]
  or, with `layout="map"`, a map with the tag under "type" (vLLM since #42892; 0.26.0 sends maps);
  hashes are msgpack bin (page keys), lora_id always nil (adapters go by name);
- replay (ROUTER): a client (REQ, or DEALER sending an empty frame first) sends the first sequence
  number it wants, 8 bytes big-endian; it gets one message [topic, seq, payload] for each batch still
  kept from that number on, in order, then the end marker [b"", -1 as 8 signed bytes, b""] (the
  topic frame is vLLM's since its PR #45177, in 0.26.0; before, replies were [seq, payload]).

Invariants:
- `stored`, `removed` and `cleared` never block and do no IO: each appends one event under a lock held
  for O(1); once `max_queued` events wait (or after `close`), an event is dropped and counted, as are
  the events of a batch that does not encode (a caller's bad value);
- one thread owns the sockets and the context; it wakes every `interval` (events wait for it, so one
  engine step's events go out together), answers replay requests and sends what waits: a message per
  topic, its events in the order they were queued, consecutive ones merged where vLLM would have sent
  one (a chain's blocks stored in a medium, blocks removed from one);
- sequence numbers run 0, 1, 2, ... over all topics without a gap; a batch enters the replay ring (the
  last `replay_batches`) before it is sent, so one the PUB socket dropped for a slow subscriber (past
  its high-water mark) can still be replayed;
- no socket operation waits: PUB drops past SNDHWM, the ROUTER's replies never block (past its
  high-water mark they are dropped and the client times out);
- `close()` returns within its timeout: the thread sends what was queued, then closes the sockets
  (a short linger, so the last batches leave) and its context.
- an address that does not bind (malformed, a missing folder, a port in use) fails `__init__` with an
  OSError naming its flag (`--kv-events`, `--kv-events-replay`), the address and zmq's reason.
"""

from __future__ import annotations

import itertools
import logging
import os
import socket
import threading
import time
from collections import deque
from typing import Any

import msgpack
import zmq

_log = logging.getLogger("kvserve.cache")

STORED, REMOVED, CLEARED = "BlockStored", "BlockRemoved", "AllBlocksCleared"
END_SEQ = (-1).to_bytes(8, "big", signed=True)  # the replay's end marker, as vLLM sends it
SNDHWM = 100_000  # messages a slow subscriber may lag before PUB drops for it (vLLM's default hwm)
LINGER_MS = 100  # what close leaves the last batches to leave the process
READY_TIMEOUT = 10.0  # seconds __init__ waits for the sockets to bind

_STORED_FIELDS = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name")
_REMOVED_FIELDS = ("block_hashes", "medium")


def _bind(sock: zmq.Socket, address: str, flag: str) -> None:
    """Bind `sock` to `address`; zmq's error becomes an OSError that names `flag` and `address`."""
    try:
        sock.bind(address)
    except zmq.ZMQError as e:
        raise OSError(f"{flag} {address!r}: cannot bind: {zmq.strerror(e.errno)}") from None


def pod_name() -> str:
    return os.environ.get("POD_NAME") or socket.gethostname()


class KvEventPublisher:
    """Publishes the cache's KV events; `stored`/`removed`/`cleared` from any thread."""

    def __init__(self, endpoint: str, replay_endpoint: str | None = None, topic: str = "kv@{pod}@{model}", *,
                 max_queued: int = 100_000, replay_batches: int = 10_000, interval: float = 0.01,
                 layout: str = "array") -> None:
        if layout not in ("array", "map"):
            raise ValueError("layout is 'array' (vLLM's positional events) or 'map' (its tagged maps, 0.26.0 on)")
        self.endpoint, self.replay_endpoint = endpoint, replay_endpoint  # the bound addresses once started
        self._template, self._pod = topic, pod_name()
        self._max_queued, self._interval, self._layout = max_queued, interval, layout
        self._lock = threading.Lock()
        self._queue: deque[tuple[str, list[Any]]] = deque()  # (model, event as a positional list)
        self._closed = False
        self._dropped = self._batches = self._events = 0
        self._last_seq = -1
        self._seq = itertools.count()
        self._ring: deque[tuple[int, bytes, bytes]] = deque(maxlen=replay_batches)  # (seq, topic, payload)
        self._topics: dict[str, bytes] = {}
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()
        if not self._ready.wait(READY_TIMEOUT) or self._error is not None:
            self._closed = True
            self._stop.set()
            raise self._error or TimeoutError("the KV event sockets did not bind")

    # -- the callers' side: O(1), no IO ------------------------------------------------------------

    def stored(self, model: str, block_hashes: list[bytes], parent: bytes | None, token_ids: list[int],
               block_size: int, lora_name: str | None, medium: str) -> None:
        """Blocks `block_hashes` (a chain from `parent`, `block_size` tokens each) entered `medium`.
        The lists are kept, not copied: pass lists nobody changes afterwards."""
        self._put(model, [STORED, block_hashes, parent, token_ids, block_size, None, medium, lora_name])

    def removed(self, model: str, block_hashes: list[bytes], medium: str) -> None:
        self._put(model, [REMOVED, block_hashes, medium])

    def cleared(self, model: str) -> None:
        self._put(model, [CLEARED])

    def _put(self, model: str, event: list[Any]) -> None:
        with self._lock:
            if self._closed or len(self._queue) >= self._max_queued:
                self._dropped += 1
                return
            self._queue.append((model, event))

    def stats(self) -> dict:
        """batches and events sent, events dropped (queue full or closed), the last sequence number sent
        (-1: none yet), events waiting."""
        with self._lock:
            return {"batches": self._batches, "events": self._events, "dropped": self._dropped,
                    "last_seq": self._last_seq, "queued": len(self._queue)}

    def close(self, timeout: float = 2.0) -> None:
        """Send what is queued and close, waiting at most `timeout` seconds (later events are dropped)."""
        with self._lock:
            self._closed = True
        self._stop.set()
        self._thread.join(timeout)
        if self._thread.is_alive():
            _log.warning("kv events: the publisher thread did not finish within %.1f s", timeout)

    # -- the publisher thread ----------------------------------------------------------------------

    def _run(self) -> None:
        ctx = zmq.Context()
        sockets: list[zmq.Socket] = []
        try:
            pub, router = self._bind(ctx, sockets)
        except BaseException as e:  # surfaces in __init__
            self._error = e
            self._close_all(ctx, sockets, 0)
            self._ready.set()
            return
        self._ready.set()
        try:
            self._loop(pub, router)
        finally:
            self._close_all(ctx, sockets, LINGER_MS)

    def _bind(self, ctx: zmq.Context, sockets: list[zmq.Socket]) -> tuple[zmq.Socket, zmq.Socket | None]:
        pub = ctx.socket(zmq.PUB)
        sockets.append(pub)
        pub.setsockopt(zmq.SNDHWM, SNDHWM)
        _bind(pub, self.endpoint, "--kv-events")
        self.endpoint = pub.getsockopt_string(zmq.LAST_ENDPOINT)
        if self.replay_endpoint is None:
            return pub, None
        router = ctx.socket(zmq.ROUTER)
        sockets.append(router)
        router.setsockopt(zmq.SNDHWM, (self._ring.maxlen or 0) + 2)  # room for a whole replay and its end
        _bind(router, self.replay_endpoint, "--kv-events-replay")
        self.replay_endpoint = router.getsockopt_string(zmq.LAST_ENDPOINT)
        return pub, router

    @staticmethod
    def _close_all(ctx: zmq.Context, sockets: list[zmq.Socket], linger_ms: int) -> None:
        for s in sockets:
            s.close(linger=linger_ms)
        ctx.term()

    def _loop(self, pub: zmq.Socket, router: zmq.Socket | None) -> None:
        while True:
            stopping = self._stop.wait(self._interval)
            try:
                if router is not None:
                    self._serve_replays(router)
                self._publish(pub, self._take())
            except Exception:  # a bad event or a socket error must not end the events
                _log.exception("kv events: publishing failed")
            if stopping and not self._queue:
                return

    def _take(self) -> deque[tuple[str, list[Any]]]:
        with self._lock:
            taken, self._queue = self._queue, deque()
        return taken

    def _publish(self, pub: zmq.Socket, taken: deque[tuple[str, list[Any]]]) -> None:
        by_topic: dict[bytes, list[list[Any]]] = {}
        calls: dict[bytes, int] = {}
        for model, event in taken:
            topic = self._topic(model)
            _append_merged(by_topic.setdefault(topic, []), event)
            calls[topic] = calls.get(topic, 0) + 1
        for topic, events in by_topic.items():
            try:
                payload = msgpack.packb([time.time(), [self._encode(e) for e in events], 0], use_bin_type=True)
            except Exception:  # a caller's bad value: this batch is dropped, the others and the numbers go on
                _log.exception("kv events: a batch of %s did not encode", topic)
                with self._lock:
                    self._dropped += calls[topic]
                continue
            seq = next(self._seq)
            self._ring.append((seq, topic, payload))
            with self._lock:
                self._batches += 1
                self._events += calls[topic]  # calls, not wire events: sent + dropped + queued = calls
                self._last_seq = seq
            self._send(pub, [topic, seq.to_bytes(8, "big"), payload])

    def _send(self, pub: zmq.Socket, frames: list[bytes]) -> None:
        try:
            pub.send_multipart(frames, zmq.NOBLOCK)
        except zmq.Again:  # PUB drops rather than blocks; kept for transports that might not
            pass

    def _topic(self, model: str) -> bytes:
        topic = self._topics.get(model)
        if topic is None:
            topic = self._topics[model] = self._template.format(pod=self._pod, model=model).encode()
        return topic

    def _encode(self, event: list[Any]) -> list[Any] | dict[str, Any]:
        if self._layout == "array":
            return event
        fields = {STORED: _STORED_FIELDS, REMOVED: _REMOVED_FIELDS, CLEARED: ()}[event[0]]
        return {"type": event[0], **dict(zip(fields, event[1:]))}

    def _serve_replays(self, router: zmq.Socket) -> None:
        while router.poll(0):
            frames = router.recv_multipart(zmq.NOBLOCK)
            if len(frames) != 3 or len(frames[2]) != 8:
                _log.warning("kv events: a replay request of %d frames, ignored", len(frames))
                continue
            client, first = frames[0], int.from_bytes(frames[2], "big")
            start = max(0, first - self._ring[0][0]) if self._ring else 0
            for seq, topic, payload in itertools.islice(self._ring, start, None):
                router.send_multipart([client, b"", topic, seq.to_bytes(8, "big"), payload], zmq.NOBLOCK)
            router.send_multipart([client, b"", b"", END_SEQ, b""], zmq.NOBLOCK)


def _append_merged(events: list[list[Any]], event: list[Any]) -> None:
    """Append `event`, merged into the last one when it continues it: a BlockStored whose parent is the
    last block stored just before (same medium, size and adapter), or a BlockRemoved from the same
    medium. vLLM too sends a request's new blocks as one BlockStored."""
    last = events[-1] if events else None
    if last is not None and last[0] == event[0] == STORED and last[1] and event[2] == last[1][-1] \
            and last[4:] == event[4:]:
        events[-1] = [STORED, [*last[1], *event[1]], last[2], [*last[3], *event[3]], *last[4:]]
    elif last is not None and last[0] == event[0] == REMOVED and last[2] == event[2]:
        events[-1] = [REMOVED, [*last[1], *event[1]], last[2]]
    else:
        events.append(event)

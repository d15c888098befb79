"""KV events from a real server: a router that knows only the events (vLLM's wire format, decoded by
kvserve.testing.kv_events) predicts `/v1/prefix/match`'s `page_tokens` exactly, prompt after prompt, while pages go
from host memory to disk and out of it, and again after a restart on the same folder, where the same
router's index forgets what died with the process before."""

from __future__ import annotations

import random
import time
from pathlib import Path

import httpx
import pytest

from conftest import served
from kvserve.testing.kv_events import EventIndex, Subscriber

PAGE = 16


def _caught_up(app, subscriber: Subscriber) -> None:
    """Wait until the cache took in the pages it read from disk off the engine thread, the disk has
    written what was queued and the subscriber applied every batch sent."""
    persistence, cache = app.state.models.persistence, app.state.models.only.cache
    deadline = time.monotonic() + 30
    while cache.pending() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert persistence.disk.flush(30)
    deadline = time.monotonic() + 10
    while persistence.publisher.stats()["queued"] and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.05)  # the publisher's wake interval: a batch taken from the queue is being sent
    assert subscriber.wait_for(persistence.publisher.stats()["last_seq"], 10)


def _index(subscriber: Subscriber) -> EventIndex:
    topics = list(subscriber.indexes)
    assert len(topics) == 1 and topics[0].startswith("kv@") and topics[0].endswith("@m")
    return subscriber.indexes[topics[0]]


def _in_host(index: EventIndex) -> list[bytes]:
    return [h for h, block in index.blocks.items() if "cpu" in block.media]


def _check(url: str, index: EventIndex, prompt: list[int]) -> int:
    got = httpx.post(f"{url}/v1/prefix/match", json={"model": "m", "prompt": prompt}, timeout=30).json()
    assert got["page_size"] == PAGE
    assert index.predict(prompt, PAGE) == got["page_tokens"], "the events' index and the replica disagree"
    assert len(got["page_keys"]) * PAGE == got["page_tokens"]
    assert min(got["page_tokens"], got["prompt_tokens"] - 1) <= got["cached_tokens"]
    return got["page_tokens"]


def _prompts(rng: random.Random, n: int) -> list[list[int]]:
    """Prompts over a few shared openings (token ids of plain words), so that they share pages."""
    words = list(range(1000, 9000))
    openings = [rng.sample(words, rng.randrange(20, 90)) for _ in range(6)]
    return [rng.choice(openings) + rng.sample(words, rng.randrange(1, 40)) for _ in range(n)]


@pytest.mark.parametrize("seed", [7])
def test_an_index_built_from_events_predicts_prefix_match(smollm2: Path, tmp_path: Path, seed: int) -> None:
    rng = random.Random(seed)
    # host memory for a handful of pages and a disk for a few dozen: both tiers evict
    tiers = dict(prefix_disk_dir=tmp_path, prefix_state_mb=2, prefix_disk_mb=12, model_alias="m",
                 kv_events="tcp://127.0.0.1:*", kv_events_replay="tcp://127.0.0.1:*")
    prompts = _prompts(rng, 200)
    with served(smollm2, **tiers) as (url, app):
        publisher = app.state.models.persistence.publisher
        subscriber = Subscriber(publisher.endpoint, publisher.replay_endpoint, "kv@")
        try:
            matched = 0
            for i, prompt in enumerate(prompts):
                if i % 3 == 0:  # serve one: its pages enter host memory and disk, older ones leave
                    body = {"model": "m", "prompt": prompt, "max_tokens": 1, "temperature": 0}
                    assert httpx.post(f"{url}/v1/completions", json=body, timeout=60).status_code == 200
                _caught_up(app, subscriber)
                matched += _check(url, _index(subscriber), prompt) > 0
            disk = app.state.models.persistence.disk.stats()
            assert disk.evictions > 0 and app.state.models.only.cache.stats().evicted_pages > 0
            assert matched > 50 and not subscriber.gaps and not subscriber.errors
            known = dict(subscriber.indexes)  # what the router knows as the server goes
            assert _in_host(_index(subscriber))  # pages a restart loses, which no event will say are gone
        finally:
            subscriber.close()
    with served(smollm2, **tiers) as (url, app):  # a restart: cleared, then what the disk holds announced again
        publisher = app.state.models.persistence.publisher
        subscriber = Subscriber(publisher.endpoint, publisher.replay_endpoint, "kv@")
        subscriber.indexes.update(known)  # the same router, following the new process
        try:
            _caught_up(app, subscriber)
            assert not _in_host(_index(subscriber))  # the new process holds nothing in host memory yet
            assert sum(_check(url, _index(subscriber), prompt) > 0 for prompt in prompts) > 0
        finally:
            subscriber.close()

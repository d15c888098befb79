"""The disk tier on real llama.cpp: pages (and checkpoints) written behind survive the process, and a
prompt attached from disk after a restart generates what it generates from scratch; a page one row
off, another model's or another KV type's file, a flipped byte, a truncation or two swapped names
are never attached; two servers never share a folder; a SIGKILL loses only what was in flight."""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import signal
import threading
import time
from pathlib import Path
from typing import Iterator

import httpx
import numpy as np
import pytest

from conftest import greedy, run, run_traced, served, settings
from equality import SMOLLM2_TOLERANCE, TINY_TOLERANCE, TOP, assert_like_alone
from kvserve.cache import page_cache
from kvserve.cache.disk_store import DiskStore
from kvserve.cache.prefix_key import PrefixKey
from kvserve.cache.tiers import Tiers
from kvserve.llama.context import Context
from kvserve.llama.sampler import SamplingParams
from kvserve.llama.seq_state import SeqState
from kvserve.scheduler import kv_manager
from kvserve.scheduler.engine import Engine
from kvserve.scheduler.request import Request
from kvserve.testing.processes import ServerProcess

MIB = 1024 * 1024
TEXT = ("The harbour master kept a ledger of every ship that came in: its name, its cargo, the crew's "
        "home ports and the weather they had met on the way. ") * 6


@contextlib.contextmanager
def disk_engine(model: Path, folder: Path, queue_bytes: int = 256 * MIB, **overrides) -> Iterator[Engine]:
    """An engine whose pages go to a disk store in `folder`; closing it closes the store (writes done)."""
    chosen = settings(model, **overrides)
    disk = DiskStore(folder, 256 * MIB, queue_bytes=queue_bytes)
    loaded = Engine.load(chosen.model_settings(), chosen, tiers=Tiers(disk=disk, tag="m"))
    try:
        yield loaded
    finally:
        disk.flush(30)
        loaded.close()
        disk.close()


def traced(prompt: list[int], max_tokens: int = 8) -> Request:
    return Request(id=f"r{len(prompt)}-{os.urandom(3).hex()}", prompt=prompt, params=SamplingParams(temperature=0.0),
                   max_tokens=max_tokens, logprobs=TOP)


def _alone(model: Path, prompt: list[int], **overrides):
    with contextlib.ExitStack() as stack:
        chosen = settings(model, prefix_cache=False, **overrides)
        e = Engine.load(chosen.model_settings(), chosen)
        stack.callback(e.close)
        request = traced(prompt)
        return run_traced(e, [request])[request.id]


def _after_restart(model: Path, folder: Path, prompt: list[int], **overrides) -> tuple[list, int]:
    """Serve `prompt` on a fresh engine over `folder`: its trace, and the tokens attached from disk."""
    with disk_engine(model, folder, **overrides) as e:
        request = traced(prompt)
        out = run_traced(e, [request])[request.id]
        return out, request.state.cached_tokens


@pytest.mark.parametrize("which", ["smollm2", "tiny-llama"])
def test_restart_attaches_from_disk_and_equals_scratch(smollm2: Path, tiny, tmp_path: Path, which: str) -> None:
    """SmolLM2 (quantized) and a tiny llama under plain attention, each within its tolerance."""
    model, tolerance, options = ((smollm2, SMOLLM2_TOLERANCE, {}) if which == "smollm2"
                                 else (tiny("llama"), TINY_TOLERANCE, {"flash_attn": "off"}))
    with disk_engine(model, tmp_path, **options) as e:
        prompt = e.model.tokenize(TEXT, add_special=True)
        request = traced(prompt)
        run_traced(e, [request])
        written = e.cache.stats().held_pages
    assert written >= len(prompt) // 16 - 1
    assert len(list((tmp_path / "pages").rglob("*.page"))) >= written
    alone = _alone(model, prompt, **options)
    out, cached = _after_restart(model, tmp_path, prompt, **options)
    assert cached == min(len(prompt) // 16 * 16, len(prompt) - 1)  # every whole page, but the last token
    assert_like_alone(alone, out, tolerance)


def test_pages_host_memory_cannot_keep_still_reach_the_disk(smollm2: Path, tmp_path: Path) -> None:
    """A host budget of two or three pages: every page donated is written all the same, and after a
    restart the prompt attaches them all from disk, equal to scratch."""
    small = {"prefix_state_mb": 1}
    with disk_engine(smollm2, tmp_path, **small) as e:
        prompt = e.model.tokenize(TEXT, add_special=True)
        run_traced(e, [traced(prompt)])
        assert e.cache.stats().held_pages < len(prompt) // 16 - 2
    assert len(list((tmp_path / "pages").rglob("*.page"))) >= len(prompt) // 16  # and the answer's
    alone = _alone(smollm2, prompt)
    out, cached = _after_restart(smollm2, tmp_path, prompt, **small)
    assert cached == min(len(prompt) // 16 * 16, len(prompt) - 1)
    assert_like_alone(alone, out, SMOLLM2_TOLERANCE)


@pytest.mark.parametrize("attached", [0, 128])
def test_a_long_prompts_pages_reach_the_disk_while_it_is_evaluated(smollm2: Path, tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch, attached: int) -> None:
    """A prompt evaluated in steps of 64 tokens donates its pages every `DONATE_EVERY` (64 here)
    tokens, and the disk tier writes them behind: the folder as a crash mid-prefill leaves it attaches
    them after a restart, equal to scratch. So do the pages after the `attached` tokens the prompt
    found on disk after an earlier restart. Donated only at the request's end, that folder held none
    of them."""
    monkeypatch.setattr(kv_manager, "DONATE_EVERY", 64)
    live, crashed = tmp_path / "live", tmp_path / "crashed"
    if attached:
        with disk_engine(smollm2, live) as e:  # the prompt's first pages reach the disk
            run_traced(e, [traced(e.model.tokenize(TEXT * 3, add_special=True)[: attached + 1])])
    with disk_engine(smollm2, live, batch_size=64) as e:
        prompt = e.model.tokenize(TEXT * 3, add_special=True)
        request = traced(prompt)
        e.scheduler.submit(request)
        while not request.state.choices or request.state.choices[0].session.n_past < attached + 192:
            assert all(output.error is None for output in e.scheduler.step())
        assert request.state.cached_tokens == attached
        evaluated = request.state.choices[0].session.n_past
        assert evaluated < len(prompt) - 64  # still evaluating its prompt
        assert e.cache.tiers.disk is not None and e.cache.tiers.disk.flush(30)
        shutil.copytree(live, crashed)
    alone = _alone(smollm2, prompt)
    out, cached = _after_restart(smollm2, crashed, prompt)
    assert cached == evaluated // 16 * 16
    assert_like_alone(alone, out, SMOLLM2_TOLERANCE)


def test_pages_read_past_the_host_budget_are_recent_after_the_next_restart(smollm2: Path, tmp_path: Path) -> None:
    """A restart's attach reads its run from disk without touching the files; the promotion that
    follows reads what host memory takes and touches those. The pages past the host budget must be
    touched too, or the restart after finds them as old as before and evicts them first (a mutation
    that leaves them fails)."""
    small = {"prefix_state_mb": 1}
    with disk_engine(smollm2, tmp_path, **small) as e:
        prompt = e.model.tokenize(TEXT, add_special=True)
        run_traced(e, [traced(prompt)])
    files = list((tmp_path / "pages").rglob("*.page"))
    hour_ago = os.stat(files[0]).st_mtime - 3600
    for f in files:
        os.utime(f, (hour_ago, hour_ago))
    with disk_engine(smollm2, tmp_path, **small) as e:
        request = traced(prompt)
        run_traced(e, [request])
        assert request.state.cached_tokens == min(len(prompt) // 16 * 16, len(prompt) - 1)
        e.cache.settle(timeout=None)
        run = e.cache.matched_keys(PrefixKey("", prompt))
        assert len(run) == len(prompt) // 16
        assert e.cache.stats().held_pages < len(run) - 2  # most of the run is past the host budget
    run_files = [tmp_path / "pages" / k.hex()[:2] / f"{k.hex()}.page" for k in run]
    assert all(os.stat(f).st_mtime > hour_ago + 1800 for f in run_files)


def test_matching_a_prompt_again_hashes_its_pages_once_and_never_trusts_a_changed_prompt(
        smollm2: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Admission and the attach match one prompt up to four times a step: its disk pages' keys are
    hashed once. The keys kept are the prompt's by content, not by the list they came in: a list
    changed in place, another prompt of the same length, or the same tokens in another namespace,
    is hashed anew (a cache by identity, or by tokens alone, fails here)."""
    with disk_engine(smollm2, tmp_path) as e:
        prompt = e.model.tokenize(TEXT, add_special=True)
        run_traced(e, [traced(prompt)])
    hashed: list[int] = []
    real = page_cache.page_key
    monkeypatch.setattr(page_cache, "page_key", lambda parent, tokens: (hashed.append(1), real(parent, tokens))[1])
    with disk_engine(smollm2, tmp_path) as e:
        whole, tokens = len(prompt) // 16, list(prompt)
        assert len(e.cache.matched_keys(PrefixKey("", tokens))) == whole
        assert len(hashed) == whole
        assert len(e.cache.matched_keys(PrefixKey("", tokens))) == whole and len(hashed) == whole
        tokens[16 * (whole - 1)] += 1  # its last whole page changed in place
        assert len(e.cache.matched_keys(PrefixKey("", tokens))) == whole - 1
        other = prompt[:16 * (whole - 1)] + [t + 1 for t in prompt[16 * (whole - 1):]]
        assert len(e.cache.matched_keys(PrefixKey("", other))) == whole - 1
        assert len(e.cache.matched_keys(PrefixKey("", prompt))) == whole
        assert e.cache.matched_keys(PrefixKey("tenant:other", prompt)) == []  # the same tokens, another namespace


def test_a_restarts_run_comes_into_host_memory_only_in_the_engines_idle_slices(smollm2: Path, tmp_path: Path) -> None:
    """After a restart's attach from disk, its run is read into host memory by `settle`, the
    engine's idle work, a slice at a time, and by nothing else: a reading thread beside the next
    request's decode made that decode take 254 ms instead of 85 (the 1.5B, 8,192 tokens). Left
    alone, nothing is read; a slice of no time reads nothing; an unbounded one reads the run."""
    with disk_engine(smollm2, tmp_path) as e:
        prompt = e.model.tokenize(TEXT, add_special=True)
        run_traced(e, [traced(prompt)])
    with disk_engine(smollm2, tmp_path) as e:
        run_traced(e, [traced(prompt)])
        disk = e.cache.tiers.disk
        reads = disk.stats().hits + disk.stats().misses
        time.sleep(0.5)
        e.cache.settle(timeout=0)
        assert disk.stats().hits + disk.stats().misses == reads
        assert e.cache.stats().held_pages == 0 and e.cache.pending()
        e.cache.settle(timeout=None)
        assert disk.stats().hits >= reads + len(prompt) // 16 - 1
        assert e.cache.stats().held_pages >= len(prompt) // 16 and not e.cache.pending()


def test_runs_waiting_for_an_idle_engine_are_bounded(smollm2: Path, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A server that never idles never reads its restarts' runs into host memory: past
    `MAX_PROMOTIONS` runs waiting (each holding its tail's pages), the oldest is dropped and stays on
    disk only, so memory stays bounded (a mutation that keeps every run fails)."""
    monkeypatch.setattr(page_cache, "MAX_PROMOTIONS", 2)
    with disk_engine(smollm2, tmp_path) as e:
        prompts = [e.model.tokenize(f"Story number {i}. " + TEXT, add_special=True) for i in range(3)]
        run_traced(e, [traced(p) for p in prompts])
    with disk_engine(smollm2, tmp_path) as e:
        for prompt in prompts:  # one at a time: each attaches its run from disk, then leaves it waiting
            run_traced(e, [traced(prompt)])
        e.cache.settle(timeout=None)
        in_host = [len(e.cache.tree.match(PrefixKey("", p), len(p) // 16)) for p in prompts]
    assert in_host[0] == 0 and min(in_host[1:]) >= len(prompts[1]) // 16 - 1, in_host


def test_a_prompt_larger_than_the_write_queue_reaches_the_disk_whole(smollm2: Path, tmp_path: Path) -> None:
    """Pages donated into host memory are queued for the disk whatever the write queue's byte bound
    (host memory holds them anyway): a prompt of a dozen pages through a queue of two reaches the
    disk whole, and a restart attaches all of it. Counting them against the queue (a mutation) lost
    all but the first two or three: a 16k-token prompt of a 1.5B lost its second half."""
    with disk_engine(smollm2, tmp_path, queue_bytes=MIB) as e:
        prompt = e.model.tokenize(TEXT, add_special=True)
        run_traced(e, [traced(prompt)])
        assert e.cache.tiers.disk.flush(30)
        assert e.cache.tiers.disk.stats().dropped_writes == 0
        page_bytes = e.cache.tiers.disk.stats().bytes / len(e.cache.tiers.disk)
    assert len(prompt) // 16 > 3 * MIB / page_bytes  # the prompt's pages: over three queues' worth
    out, cached = _after_restart(smollm2, tmp_path, prompt)
    assert cached == min(len(prompt) // 16 * 16, len(prompt) - 1)
    assert_like_alone(_alone(smollm2, prompt), out, SMOLLM2_TOLERANCE)


def test_a_server_stopped_right_after_an_answer_writes_its_pages_before_dropping_them(
        smollm2: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A server stopped right after an answer unloads its model while the answer's pages still wait
    for the writer. Letting its cache go first counted them against the write queue's bound, and
    past it they were lost: a 16k-token prompt of a 1.5B came back with 3,056 of its tokens after
    SIGTERM. Here: slow writes and a queue of one MiB."""
    real_write, real_init = DiskStore._write, DiskStore.__init__
    monkeypatch.setattr(DiskStore, "_write", lambda self, job: (time.sleep(0.3), real_write(self, job))[1])
    monkeypatch.setattr(DiskStore, "__init__", lambda self, *args, **kw: real_init(self, *args, **{**kw, "queue_bytes": MIB}))
    body = {"model": "m", "prompt": TEXT, "max_tokens": 2, "temperature": 0}
    with served(smollm2, prefix_disk_dir=tmp_path) as (url, app):
        first = httpx.post(f"{url}/v1/completions", json=body, timeout=120).json()
        waiting = app.state.models.persistence.disk.stats()
    prompt_tokens = first["usage"]["prompt_tokens"]
    assert waiting.queued > 3  # still waiting: more pages than the queue's MiB holds (a page here is 369 KB)
    monkeypatch.setattr(DiskStore, "_write", real_write)
    with served(smollm2, prefix_disk_dir=tmp_path) as (url, app):
        again = httpx.post(f"{url}/v1/completions", json=body, timeout=120).json()
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == min(prompt_tokens // 16 * 16, prompt_tokens - 1)
    assert again["choices"][0]["text"] == first["choices"][0]["text"]


def test_a_damaged_page_ends_the_run_read_from_disk(smollm2: Path, tmp_path: Path) -> None:
    """A restart reads its run of pages from disk straight into the stream; a damaged file in the
    middle of the run ends it there: the pages before it attach, equal to scratch, the file is
    removed (and written again once its page is computed). As the request ends, the pages on disk
    wait for the engine's idle work (`settle`) to read them into host memory, then the rest: not
    before (a mutation that reads them as the request ends fails)."""
    with disk_engine(smollm2, tmp_path) as e:
        prompt = e.model.tokenize(TEXT, add_special=True)
        run_traced(e, [traced(prompt)])
        keys = [node.key for node in e.cache.tree.match(PrefixKey("", prompt), len(prompt) // 16)]
    assert len(keys) > 4
    damaged = tmp_path / "pages" / keys[3].hex()[:2] / f"{keys[3].hex()}.page"
    data = bytearray(damaged.read_bytes())
    data[len(data) // 2] ^= 0x40
    damaged.write_bytes(bytes(data))
    alone = _alone(smollm2, prompt)
    with disk_engine(smollm2, tmp_path) as e:
        request = traced(prompt)
        out = run_traced(e, [request])[request.id]
        assert request.state.cached_tokens == 3 * 16
        assert e.cache.tiers.disk.stats().refused == 1
        assert e.cache.stats().held_pages == 0 and e.cache.pending()
        e.cache.settle(timeout=None)
        assert e.cache.stats().held_pages >= len(keys) and not e.cache.pending()
        assert e.cache.tiers.disk.flush(30)
        assert damaged.read_bytes() != bytes(data)  # removed, then written again as computed
    assert_like_alone(alone, out, SMOLLM2_TOLERANCE)


def test_another_prompts_rows_fail_the_comparison(smollm2: Path, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The restart comparison catches rows of the wrong prompt: with keys that forget the tokens (a
    mutation patched in), a prompt attaches another one's pages from disk and must fail it."""
    from kvserve.cache import page_cache, page_tree

    other = TEXT.replace("harbour master", "lighthouse keeper").replace("ships", "storms")
    with disk_engine(smollm2, tmp_path) as e:
        donor, prompt = (e.model.tokenize(t, add_special=True) for t in (TEXT, other))
        run(e, [greedy(donor, 1)])
    n = min(len(donor), len(prompt)) // 16 * 16
    prompt = prompt[:n] + donor[n:]  # same length, different pages
    alone = _alone(smollm2, prompt)
    out, cached = _after_restart(smollm2, tmp_path, prompt)
    assert cached == 0  # nothing of it was ever computed
    assert_like_alone(alone, out, SMOLLM2_TOLERANCE)

    def forgetful(parent: bytes, tokens) -> bytes:
        return hashlib.sha256(parent + len(tokens).to_bytes(4, "little")).digest()

    monkeypatch.setattr(page_cache, "page_key", forgetful)
    monkeypatch.setattr(page_tree, "page_key", forgetful)
    with disk_engine(smollm2, tmp_path / "mutant") as e:
        run(e, [greedy(donor, 1)])
    out, cached = _after_restart(smollm2, tmp_path / "mutant", prompt)
    assert cached > 0
    with pytest.raises(AssertionError):
        assert_like_alone(alone, out, SMOLLM2_TOLERANCE)


def test_another_kv_type_never_attaches(smollm2: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows of q8_0 K/V are of another format: their keys differ, so nothing attaches; and were the key
    to forget the KV type (a mutation), the layout check would refuse every such file."""
    q8 = dict(cache_type_k="q8_0", cache_type_v="q8_0", flash_attn="on")
    with disk_engine(smollm2, tmp_path, **q8) as e:
        prompt = e.model.tokenize(TEXT, add_special=True)
        run(e, [greedy(prompt, 4)])
    with disk_engine(smollm2, tmp_path, flash_attn="on") as e:
        request = greedy(prompt, 4)
        run(e, [request])
        assert request.state.cached_tokens == 0
    from kvserve.cache import page_key

    real = page_key.RowFormat.digest
    monkeypatch.setattr(page_key.RowFormat, "digest",
                        lambda self: real(page_key.RowFormat(self.model, "f16", "f16", self.v_transposed,
                                                             self.state_version, self.page_rows)))
    with disk_engine(smollm2, tmp_path, **q8) as e:
        run(e, [greedy(prompt, 4)])
    with disk_engine(smollm2, tmp_path, flash_attn="on") as e:
        request = greedy(prompt, 4)
        run(e, [request])
        # the prompt's first page, and maybe the answer's, read as the request ends
        assert request.state.cached_tokens == 0 and e.cache.disk_refused >= 1


def test_a_model_edited_in_its_middle_never_attaches_the_originals_pages(smollm2: Path, tmp_path: Path) -> None:
    """Two files alike but for bytes in the middle of their weights (a layer-edited variant) are two
    models: their page keys differ, so the variant on the original's folder attaches nothing. The
    fingerprint once read the size and the first and last MiB only: both got one, and the variant
    attached the original's rows (64 cached tokens, another first token's logprob)."""
    variant = tmp_path / "variant.gguf"
    data = bytearray(smollm2.read_bytes())
    middle = len(data) // 2
    data[middle : middle + (2 << 20)] = bytes(2 << 20)
    variant.write_bytes(data)
    with disk_engine(smollm2, tmp_path / "disk") as e:
        prompt = e.model.tokenize(TEXT, add_special=True)
        run(e, [greedy(prompt, 4)])
        original = e.model.fingerprint
    with disk_engine(variant, tmp_path / "disk") as e:
        request = greedy(prompt, 4)
        run(e, [request])
        assert e.model.fingerprint != original and request.state.cached_tokens == 0


@pytest.mark.parametrize("arch", ["lfm2", "mamba"])
def test_checkpoints_survive_a_restart(tiny, tmp_path: Path, arch: str) -> None:
    from test_state_cache import SYSTEM, _chat_request

    path = tiny(arch)
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Where is parcel 17?"}]
    other = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Is the Oslo route open today?"}]
    with disk_engine(path, tmp_path) as e:
        r, turn = _chat_request(e, messages)
        run(e, [r])
        assert turn.opening > 0
    with disk_engine(path, tmp_path, prefix_cache=False) as e:
        r, _ = _chat_request(e, other)
        scratch = run(e, [r])[r.id]
    with disk_engine(path, tmp_path) as e:
        r, t = _chat_request(e, other)
        assert run(e, [r])[r.id] == scratch
        assert r.state.cached_tokens == t.opening  # the opening's checkpoint, read from disk



@pytest.mark.parametrize("which", ["tiny-gemma3", pytest.param("gemma3-270m", marks=pytest.mark.slow)])
def test_sliding_window_pages_survive_a_restart(tiny, tmp_path: Path, request: pytest.FixtureRequest,
                                                which: str) -> None:
    """A sliding-window model keeps the window's rows with the pages at the opening's mark; after a
    restart another conversation on the same system prompt attaches them from disk (most of its
    opening) and answers as it does with the cache off."""
    from test_sliding_window import QUESTIONS, _chat

    path = tiny("gemma3") if which == "tiny-gemma3" else request.getfixturevalue("gemma3")
    options = {"flash_attn": "off"} if which == "tiny-gemma3" else {}
    with disk_engine(path, tmp_path, **options) as e:
        first, turn = _chat(e, QUESTIONS[0])
        run(e, [first])
        assert turn.opening > 0
    with disk_engine(path, tmp_path / "off", prefix_cache=False, **options) as e:
        r, _ = _chat(e, QUESTIONS[1])
        scratch = run(e, [r])[r.id]
    with disk_engine(path, tmp_path, **options) as e:
        r, t = _chat(e, QUESTIONS[1])
        assert run(e, [r])[r.id] == scratch
        assert r.state.cached_tokens >= 0.9 * t.opening, (r.state.cached_tokens, t.opening)
        assert e.cache.tiers.disk.stats().hits > 0  # from disk, not recomputed

# -- the server: files, crashes, two servers ------------------------------------------------------

def _chat(url: str, content: str, max_tokens: int = 4) -> dict:
    body = {"model": "m", "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            "temperature": 0}
    response = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def _flush(app) -> None:
    assert app.state.models.persistence.disk.flush(30)


def _pages(folder: Path) -> list[Path]:
    return sorted((folder / "pages").rglob("*.page"))


@pytest.mark.parametrize("damage", ["flip", "truncate", "swap", "foreign"])
def test_damaged_files_are_refused_and_counted(smollm2: Path, tmp_path: Path, tiny, damage: str) -> None:
    prompt = TEXT + " Which ship came in last?"
    with served(smollm2, prefix_disk_dir=tmp_path) as (url, app):
        first = _chat(url, prompt)
        _flush(app)
    files = _pages(tmp_path)
    assert len(files) >= 4
    if damage == "flip":
        data = bytearray(files[0].read_bytes())
        data[len(data) // 2] ^= 0x40
        files[0].write_bytes(bytes(data))
    elif damage == "truncate":
        files[0].write_bytes(files[0].read_bytes()[:-100])
    elif damage == "swap":
        a, b = files[0].read_bytes(), files[1].read_bytes()
        files[0].write_bytes(b)
        files[1].write_bytes(a)
    else:  # another model's file under one of these names
        foreign = tmp_path / "other"
        with served(tiny("llama"), prefix_disk_dir=foreign) as (other_url, other_app):
            _chat(other_url, prompt)
            _flush(other_app)
        for target, source in zip(files, _pages(foreign)):
            target.write_bytes(source.read_bytes())
    with served(smollm2, prefix_disk_dir=tmp_path) as (url, app):
        again = _chat(url, prompt)
        disk = app.state.models.persistence.disk.stats()
        assert disk.refused >= 1
        metrics = httpx.get(f"{url}/metrics").text
        assert "kvserve_prefix_disk_refused_total" in metrics
    assert again["choices"][0]["message"]["content"] == first["choices"][0]["message"]["content"]


def test_a_restart_maps_the_first_restores_buffer_while_the_model_loads(smollm2: Path, tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A server that starts on a folder holding a model's pages maps, while the model loads, a buffer
    as large as the longest run of them, and its first restore from disk writes into that buffer
    (a restore into fresh memory took 0.3-0.7 s more for 224 MB on this VM)."""
    prompt = TEXT + " Which ship came in last?"
    with served(smollm2, prefix_disk_dir=tmp_path) as (url, app):
        first = _chat(url, prompt)
        _flush(app)
    blobs: list[int] = []
    real = SeqState.restore
    monkeypatch.setattr(SeqState, "restore", lambda self, n: blobs.append((r := real(self, n)).blob.ctypes.data) or r)
    with served(smollm2, prefix_disk_dir=tmp_path) as (url, app):
        ahead = app.state.models.only.cache.rows.reserving
        assert ahead is not None, "nothing was mapped for the first restore"
        run = app.state.models.persistence.disk.run_bytes(app.state.models.only.settings.served_name)
        assert run > 0 and ahead.result().nbytes >= run
        again = _chat(url, prompt)
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        assert blobs == [ahead.result().ctypes.data]
    assert again["choices"][0]["message"]["content"] == first["choices"][0]["message"]["content"]


def test_only_the_engines_thread_outlives_a_decode(smollm2: Path, tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A load decodes (here the disk tier learns the state layout) on a thread that ends with the load;
    after it, only the engine's thread decodes. llama.cpp's OpenMP workers live as long as the thread
    that decoded: a second set beside the engine's made every step of the 1.5B 20% slower."""
    decoders: list[threading.Thread] = []
    real = Context.decode
    monkeypatch.setattr(Context, "decode", lambda self, batch: decoders.append(threading.current_thread()) or real(self, batch))
    with served(smollm2, prefix_disk_dir=tmp_path) as (url, app):
        loading = set(decoders)
        assert loading, "the load did not decode: nothing here is tested"
        for thread in loading:
            thread.join(timeout=10)
        assert not [t.name for t in loading if t.is_alive()]
        _chat(url, TEXT)
        assert len(set(decoders) - loading) == 1  # the engine's


def test_a_second_server_on_the_folder_refuses_to_start(smollm2: Path, tmp_path: Path) -> None:
    with ServerProcess.kvserve(tmp_path / "a.log", model=smollm2, prefix_disk_dir=tmp_path / "data", threads=1) as a:
        a.wait_healthy()
        b = ServerProcess.kvserve(tmp_path / "b.log", model=smollm2, prefix_disk_dir=tmp_path / "data", threads=1)
        status = b.wait(120)
        assert status != 0
        said = b.tail()
        assert "in use" in said and str(a.pid) in said and "Traceback" not in said
        assert httpx.get(f"{a.url}/health").status_code == 200


def test_sigkill_while_writing_loses_only_what_was_in_flight(smollm2: Path, tmp_path: Path) -> None:
    data = tmp_path / "data"
    with ServerProcess.kvserve(tmp_path / "a.log", model=smollm2, prefix_disk_dir=data, threads=1) as a:
        a.wait_healthy()
        prompts = [f"Ledger {i}: " + TEXT[: 300 + 7 * i] for i in range(6)]
        for p in prompts:
            _chat(a.url, p, max_tokens=1)
        os.killpg(a.pid, signal.SIGKILL)
        a.kill()
    leftovers = [p for p in data.rglob("*") if p.is_file() and not p.name.endswith(".page")
                 and p.name not in ("lock", "responses.sqlite3", "responses.sqlite3-wal", "responses.sqlite3-shm")]
    with ServerProcess.kvserve(tmp_path / "b.log", model=smollm2, prefix_disk_dir=data, threads=1) as b:
        b.wait_healthy()
        assert not any(p.exists() for p in leftovers if "tmp" in p.name)  # temporaries removed at start
        cache = httpx.get(f"{b.url}/v1/cache").json()["tiers"]["disk"]
        assert cache["pages"] == len(_pages(data))  # the index is the folder
        for p in prompts:
            _chat(b.url, p, max_tokens=1)
        after = httpx.get(f"{b.url}/v1/cache").json()["tiers"]["disk"]
        assert after["hits"] > 0 and after["refused"] == 0

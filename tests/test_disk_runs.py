"""Runs on real llama.cpp (run_store.py): a long chain of pages, once donated whole, is written again
as one file that llama.cpp reads itself; after a restart a prompt restored from it generates what it
generates from scratch, whether the run ends with the prompt's pages or goes on past them (then it
is cut). A run with a flipped byte, cut short, or another prompt's rows under a forged name and
checksum is refused, counted and removed, and the pages restore the prompt instead, equal to
scratch. A loader that took the file's word for its tokens would attach another prompt's rows: the
comparison catches that mutation."""

from __future__ import annotations

import contextlib
import struct
import threading
import time
from pathlib import Path
from typing import Iterator

import httpx
import llama_cpp
import numpy as np
import pytest
import xxhash

from conftest import engine, run_traced, served, settings
from equality import SMOLLM2_TOLERANCE, assert_like_alone
from kvserve.cache.disk_store import DiskStore
from kvserve.cache.prefix_key import PrefixKey
from kvserve.cache.run_store import KEY_BYTES, MAGIC, SETTLED_NS, SUFFIX, VERSION, Opened, RunStore
from kvserve.cache.tiers import Tiers
from kvserve.llama.context import Context
from kvserve.llama.seq_state import SeqState
from kvserve.scheduler.engine import Engine
from kvserve.testing import wait_until
from test_disk_tier import TEXT, _alone, traced

MIB = 1024 * 1024
OTHER = TEXT.replace("harbour master", "lighthouse keeper").replace("ship", "storm")


@contextlib.contextmanager
def run_engine(model: Path, folder: Path, stage: bool = False, **overrides) -> Iterator[Engine]:
    """An engine whose pages go to a disk store in `folder`, and whose chains of 32 tokens or more to
    runs in `folder/runs` (`stage`: the newest read into memory first, as a server's start does);
    closing it writes what is queued."""
    chosen = settings(model, **overrides)
    disk = DiskStore(folder, 256 * MIB)
    runs = RunStore(folder / "runs", 256 * MIB, min_tokens=32)
    if stage:
        time.sleep(SETTLED_NS / 1e9)  # a file changed since is checked when used, not taken as read
        runs.warm(256 * MIB, 256 * MIB).join()
        assert runs.staged_bytes > 0
    loaded = Engine.load(chosen.model_settings(), chosen, tiers=Tiers(disk=disk, tag="m", runs=runs))
    try:
        yield loaded
    finally:
        disk.flush(30)
        runs.flush(30)
        loaded.close()
        runs.close()
        disk.close()


def serve(model: Path, folder: Path, prompt: list[int], stage: bool = False, **overrides) -> tuple[list, int, Engine]:
    """Serve `prompt` on a fresh engine over `folder`: its trace, the tokens it attached, and the engine
    (closed by then: its stores' stats stay readable)."""
    with run_engine(model, folder, stage, **overrides) as e:
        request = traced(prompt)
        out = run_traced(e, [request])[request.id]
        return out, request.state.cached_tokens, e


def tokens_of(model: Path, *texts: str) -> list[list[int]]:
    with engine(model) as e:
        return [e.model.tokenize(text, add_special=True) for text in texts]


@pytest.mark.parametrize("which", ["smollm2", "tiny-llama"])
def test_a_run_file_lays_out_the_blob_a_restore_loads(smollm2: Path, tiny, tmp_path: Path, which: str) -> None:
    """Made a layer at a time, a run is llama.cpp's file head, the tokens, then the blob `assemble`
    makes of the same pages, less its header: with V as rows (flash attention) and transposed."""
    model, options = (smollm2, {}) if which == "smollm2" else (tiny("llama"), {"flash_attn": "off"})
    with run_engine(model, tmp_path, **options) as e:
        prompt = e.model.tokenize(TEXT, add_special=True)
        run_traced(e, [traced(prompt)])
        nodes = e.cache.tree.match(PrefixKey("", prompt), len(prompt) // 16)
        pages = [e.cache.store.peek(node) for node in nodes]
        size, parts = e.cache.rows.run_file(pages, prompt)
        data = b"".join(np.ascontiguousarray(part).tobytes() for part in parts)
        n = len(nodes) * 16
        blob = e.cache.rows.assemble(pages, n)
        transposed = any(block.n_embd for block in e.cache.rows._layout[0].blocks)
    assert transposed == (which == "tiny-llama")
    assert len(data) == size
    assert data[:12] == struct.pack("<III", llama_cpp.LLAMA_STATE_SEQ_MAGIC, llama_cpp.LLAMA_STATE_SEQ_VERSION, n)
    assert data[12 : 12 + 4 * n] == struct.pack(f"<{n}i", *prompt[:n])
    assert data[12 + 4 * n :] == blob[8:].tobytes()


def run_files(folder: Path) -> list[Path]:
    return sorted((folder / "runs").glob("*" + SUFFIX))


def test_a_restart_restores_the_prompt_from_its_run_and_equals_scratch(smollm2: Path, tmp_path: Path) -> None:
    prompt = tokens_of(smollm2, TEXT)[0]
    _, _, first = serve(smollm2, tmp_path, prompt)
    assert first.cache.tiers.runs.stats().writes == 1 and len(run_files(tmp_path)) == 1
    alone = _alone(smollm2, prompt)
    out, cached, again = serve(smollm2, tmp_path, prompt)
    runs, disk = again.cache.tiers.runs.stats(), again.cache.tiers.disk.stats()
    assert (runs.hits, runs.refused) == (1, 0)
    assert disk.hits == 0  # no page file was read before the first token: the run restored them all
    assert cached == min(len(prompt) // 16 * 16, len(prompt) - 1)
    assert_like_alone(alone, out, SMOLLM2_TOLERANCE)


def test_a_staged_run_restores_the_prompt_from_memory_and_equals_scratch(
        smollm2: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Staged at start, the run restores the prompt without llama.cpp reading its file, and is spent."""
    prompt = tokens_of(smollm2, TEXT)[0]
    serve(smollm2, tmp_path, prompt)
    alone = _alone(smollm2, prompt)
    read = Context.load_seq_file
    files: list[str] = []
    monkeypatch.setattr(Context, "load_seq_file", lambda self, *args: (files.append(args[1]), read(self, *args))[1])
    out, cached, again = serve(smollm2, tmp_path, prompt, stage=True)
    runs = again.cache.tiers.runs
    assert (runs.stats().hits, runs.stats().refused, again.cache.tiers.disk.stats().hits) == (1, 0, 0)
    assert files == [] and runs.staged_bytes == 0 and runs.stats().staged_hits == 1
    assert cached == min(len(prompt) // 16 * 16, len(prompt) - 1)
    assert_like_alone(alone, out, SMOLLM2_TOLERANCE)


def test_a_staged_run_gives_way_to_pages_host_memory_cannot_hold_beside_it(smollm2: Path, tmp_path: Path) -> None:
    """Pages donated past the host budget less the staged run drop the run from memory; its file
    still restores the prompt."""
    prompt, other = tokens_of(smollm2, TEXT, OTHER)
    serve(smollm2, tmp_path, prompt)
    with run_engine(smollm2, tmp_path, stage=True, prefix_state_mb=16) as e:
        staged = e.cache.tiers.runs.staged_bytes
        run_traced(e, [traced(other[: len(other) // 2])])
        assert e.cache.store.bytes_used + staged <= e.cache.store.budget_bytes  # room for both: kept
        assert e.cache.tiers.runs.staged_bytes == staged
        e.cache.store.budget_bytes = e.cache.store.bytes_used + staged  # as if the budget were that
        run_traced(e, [traced(other)])
        assert e.cache.tiers.runs.staged_bytes == 0
        request = traced(prompt)
        run_traced(e, [request])
        assert e.cache.tiers.runs.stats().hits == 1 and request.state.cached_tokens > 0


def test_a_run_a_kill_left_unwritten_is_written_once_its_pages_come_into_host_memory(
        smollm2: Path, tmp_path: Path) -> None:
    """A kill before the cold request's run was written leaves only page files. The restart attaches
    the pages, reads them into host memory as it idles, and writes the run then, so the restart
    after it restores from the run, equal to scratch (a mutation that writes runs only as a session
    ends reads the pages at every restart, and fails)."""
    prompt = tokens_of(smollm2, TEXT)[0]
    serve(smollm2, tmp_path, prompt)
    for run in run_files(tmp_path):
        run.unlink()  # what a kill before the run's write leaves
    with run_engine(smollm2, tmp_path) as e:
        request = traced(prompt)
        run_traced(e, [request])
        assert e.cache.tiers.runs.stats().hits == 0 and e.cache.tiers.disk.stats().hits > 0
        e.cache.settle(timeout=None)  # the engine's idle work
        assert e.cache.tiers.runs.flush(30)
    assert len(run_files(tmp_path)) == 1
    alone = _alone(smollm2, prompt)
    out, cached, again = serve(smollm2, tmp_path, prompt)
    assert (again.cache.tiers.runs.stats().hits, again.cache.tiers.disk.stats().hits) == (1, 0)
    assert cached == min(len(prompt) // 16 * 16, len(prompt) - 1)
    assert_like_alone(alone, out, SMOLLM2_TOLERANCE)


def test_a_restart_with_another_stream_count_leaves_the_run_alone(smollm2: Path, tmp_path: Path) -> None:
    """llama.cpp refuses a state of another stream count: a restart under another --parallel finds no
    run of its layout, restores the pages, equal to scratch, and neither refuses nor removes the run."""
    prompt = tokens_of(smollm2, TEXT)[0]
    serve(smollm2, tmp_path, prompt)
    alone = _alone(smollm2, prompt)
    out, cached, again = serve(smollm2, tmp_path, prompt, parallel=2)
    runs = again.cache.tiers.runs.stats()
    assert (runs.hits, runs.refused) == (0, 0) and again.cache.tiers.disk.stats().hits > 0
    assert cached == min(len(prompt) // 16 * 16, len(prompt) - 1)
    assert_like_alone(alone, out, SMOLLM2_TOLERANCE)
    assert len(run_files(tmp_path)) == 1
    _, _, back = serve(smollm2, tmp_path, prompt)
    assert back.cache.tiers.runs.stats().hits == 1  # the first settings find it again


def test_a_run_past_the_prompts_pages_is_cut_where_they_end(smollm2: Path, tmp_path: Path) -> None:
    """The same text then another question: its pages end inside the run of the first prompt, which
    is restored and cut there."""
    first_prompt, prompt = tokens_of(smollm2, TEXT + " Which ship came in first?",
                                     TEXT + " What did the crew eat on the way?")
    serve(smollm2, tmp_path, first_prompt)
    alone = _alone(smollm2, prompt)
    out, cached, again = serve(smollm2, tmp_path, prompt)
    shared = next(i for i, (a, b) in enumerate(zip(first_prompt, prompt)) if a != b) // 16 * 16
    assert again.cache.tiers.runs.stats().hits == 1 and again.cache.tiers.disk.stats().hits == 0
    assert cached == shared > 0
    assert_like_alone(alone, out, SMOLLM2_TOLERANCE)


TRAILER = struct.Struct("<8sI32s32sIQ")  # run_store's: magic, version, name, layout, pages, body bytes


def parts(run: Path) -> tuple[bytes, list[bytes]]:
    """A run file's body and the page keys it lists."""
    data = run.read_bytes()
    _, _, _, _, n_pages, body = TRAILER.unpack_from(data, len(data) - TRAILER.size - 8)
    listed = data[body : body + n_pages * KEY_BYTES]
    return data[:body], [listed[i : i + KEY_BYTES] for i in range(0, len(listed), KEY_BYTES)]


def forge(donor: Path, run: Path) -> None:
    """Replace `run` by the donor run's rows under `run`'s name and keys, trailer and checksum agreeing."""
    body, keys = parts(donor)[0], parts(run)[1]
    assert len(parts(donor)[1]) == len(keys)  # as many pages: the rows load whole
    data = run.read_bytes()
    layout = TRAILER.unpack_from(data, len(data) - TRAILER.size - 8)[3]
    out = body + b"".join(keys) + TRAILER.pack(MAGIC, VERSION, keys[-1], layout, len(keys), len(body))
    run.write_bytes(out + struct.pack("<Q", xxhash.xxh3_64_intdigest(out)))


def donor_and_prompt(smollm2: Path, folder: Path) -> tuple[list[int], Path, Path]:
    """Two prompts of as many tokens, each served for one token (so each has its pages and a run of as
    many pages on disk): the second, and the donor's run and its own."""
    donor, other = tokens_of(smollm2, TEXT, OTHER)
    n = min(len(donor), len(other)) // 16 * 16
    prompt = other[:n] + donor[n:]
    with run_engine(smollm2, folder) as e:
        for p in (donor, prompt):
            run_traced(e, [traced(p, max_tokens=1)])
        key = e.cache.tree.match(PrefixKey("", prompt), len(prompt) // 16)[-1].key
    name, = [p for p in run_files(folder) if key in parts(p)[1]]
    donor_run, = [p for p in run_files(folder) if p != name]
    return prompt, donor_run, name


@pytest.mark.parametrize("damage", ["flip", "truncate", "forged", "forged-staged"])
def test_a_damaged_run_is_refused_and_the_pages_restore_instead(smollm2: Path, tmp_path: Path, damage: str) -> None:
    prompt, donor_run, run = donor_and_prompt(smollm2, tmp_path)
    if damage == "flip":
        data = bytearray(run.read_bytes())
        data[len(data) // 2] ^= 0x40
        run.write_bytes(bytes(data))
    elif damage == "truncate":
        run.write_bytes(run.read_bytes()[:-100])
    else:
        forge(donor_run, run)  # the donor's rows under this prompt's name and keys
        run.touch()  # the newest: the one staged
    alone = _alone(smollm2, prompt)
    out, cached, again = serve(smollm2, tmp_path, prompt, stage=damage == "forged-staged")
    runs, disk = again.cache.tiers.runs.stats(), again.cache.tiers.disk.stats()
    assert (runs.refused, runs.hits) == (1, 0)  # found at start, or at open: refused, never a hit
    assert not run.exists()
    assert disk.hits >= len(prompt) // 16  # the pages restored it
    assert cached == min(len(prompt) // 16 * 16, len(prompt) - 1)
    assert_like_alone(alone, out, SMOLLM2_TOLERANCE)


@pytest.mark.parametrize("staged", [False, True])
def test_a_loader_that_trusts_the_runs_tokens_fails_the_comparison(
        smollm2: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, staged: bool) -> None:
    """The mutation: the run's tokens replaced by the prompt's, so a forged run's rows attach."""
    prompt, donor_run, run = donor_and_prompt(smollm2, tmp_path)
    forge(donor_run, run)
    run.touch()
    alone = _alone(smollm2, prompt)
    owner, name = (SeqState, "load_run") if staged else (Context, "load_seq_file")
    real = getattr(owner, name)

    def trusting(self, seq: int, body, capacity: int) -> list[int] | None:
        tokens = real(self, seq, body, capacity)
        return tokens and (list(prompt) + tokens[len(prompt):])[: len(tokens)]

    monkeypatch.setattr(owner, name, trusting)
    out, cached, again = serve(smollm2, tmp_path, prompt, stage=staged)
    assert again.cache.tiers.runs.stats().hits == 1 and again.cache.tiers.runs.stats().refused == 0
    assert cached > 0
    with pytest.raises(AssertionError):
        assert_like_alone(alone, out, SMOLLM2_TOLERANCE)


def test_a_served_restart_shows_its_runs(smollm2: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Through the server: `/v1/cache` and `/metrics` report the runs; the budget's quarter is theirs.
    (Nothing staged here: the restore reads the file; the next test stages.)"""
    monkeypatch.setattr("kvserve.cache.run_store.MIN_TOKENS", 32)
    monkeypatch.setattr("kvserve.server.persistence.STAGE_SHARE", 1 << 40)
    read_ahead, warmed = RunStore._read_ahead, []
    monkeypatch.setattr(RunStore, "_read_ahead",
                        lambda self, keys, stage=None: (warmed.append(keys), read_ahead(self, keys, stage)))
    verify, checks = Opened.verify, []
    monkeypatch.setattr(Opened, "verify", lambda self: (checks.append((self.read_right, threading.current_thread())),
                                                        verify(self))[1])
    body = {"model": "m", "prompt": TEXT, "max_tokens": 2, "temperature": 0}
    with served(smollm2, prefix_disk_dir=tmp_path, prefix_disk_mb=64) as (url, app):
        first = httpx.post(f"{url}/v1/completions", json=body, timeout=120).json()
        assert app.state.models.persistence.runs.flush(30)
    time.sleep(SETTLED_NS / 1e9)  # a file changed since is checked when used, not taken as read
    with served(smollm2, prefix_disk_dir=tmp_path, prefix_disk_mb=64) as (url, app):
        readers = {t for t in threading.enumerate() if t.name.startswith("kvserve-disk-read")}
        again = httpx.post(f"{url}/v1/completions", json=body, timeout=120).json()
        tiers = httpx.get(f"{url}/v1/cache").json()["tiers"]["disk"]
        metrics = httpx.get(f"{url}/metrics").text
    assert again["choices"][0]["text"] == first["choices"][0]["text"]
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert warmed == [[], [bytes.fromhex(run.stem) for run in (tmp_path / "runs").glob("*" + SUFFIX)]]  # at the restart
    # read ahead and found right, the run is not read again; its check runs on a thread started
    # with the cache (one started by the restore held the GIL while llama.cpp's read waited)
    assert len(checks) == 1 and checks[0][0] and checks[0][1] in readers
    assert tiers["runs"]["hits"] == 1 and tiers["runs"]["runs"] == 1
    assert tiers["runs"]["budget_bytes"] == 16 * MIB and tiers["budget_bytes"] == 48 * MIB
    assert "kvserve_prefix_disk_run_hits_total 1.0" in metrics


def test_a_served_restart_restores_its_newest_run_from_memory(smollm2: Path, tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """A restarted server stages its newest run while the model loads (a quarter of the host budget):
    the first prompt restores from memory, answers as before, and llama.cpp reads no file."""
    monkeypatch.setattr("kvserve.cache.run_store.MIN_TOKENS", 32)
    read = Context.load_seq_file
    files: list[str] = []
    monkeypatch.setattr(Context, "load_seq_file", lambda self, *args: (files.append(args[1]), read(self, *args))[1])
    body = {"model": "m", "prompt": TEXT, "max_tokens": 2, "temperature": 0}
    with served(smollm2, prefix_disk_dir=tmp_path, prefix_disk_mb=64) as (url, app):
        first = httpx.post(f"{url}/v1/completions", json=body, timeout=120).json()
        assert app.state.models.persistence.runs.flush(30)
    time.sleep(SETTLED_NS / 1e9)
    with served(smollm2, prefix_disk_dir=tmp_path, prefix_disk_mb=64) as (url, app):
        runs = app.state.models.persistence.runs
        wait_until(lambda: runs.staged_bytes > 0, 30, "the newest run staged")
        assert httpx.get(f"{url}/v1/cache").json()["tiers"]["disk"]["runs"]["staged_bytes"] > 0
        again = httpx.post(f"{url}/v1/completions", json=body, timeout=120).json()
        assert runs.staged_bytes == 0 and runs.stats().hits == 1
        metrics = httpx.get(f"{url}/metrics").text
    assert "kvserve_prefix_disk_run_staged_hits_total 1.0" in metrics
    assert "kvserve_prefix_disk_run_staged_bytes 0.0" in metrics
    assert again["choices"][0]["text"] == first["choices"][0]["text"]
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert files == []

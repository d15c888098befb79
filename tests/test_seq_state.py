"""KV rows cut into pages and restored, against llama.cpp at the pinned version (a stream per sequence).

The contract: rows restored from pages give bit-identical next-token logits to recomputing the same
tokens in the same batches (flash attention rounds by batch shape, so the recompute uses the donor's
chunks); `llama_memory_seq_pos_min/max` read 0..n-1. A page at the wrong offset, with the wrong
positions or the wrong rows, must make that comparison fail.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Iterator

import llama_cpp
import numpy as np
import pytest

from kvserve.llama.batch import Batch
from kvserve.llama.context import Context, ContextParams, DecodeError
from kvserve.llama.model import Model
from kvserve.llama.seq_state import KvPage, MissingRows, SeqState, StateFormatError, mapped

CHUNK = 32  # every prefill here runs in chunks of this many tokens, so the same tokens get the same rows
PAGE = 16


class Runner:
    def __init__(self, model: Model, flash_attn: str, n_ctx: int = 4096) -> None:
        self.ctx = Context(model, ContextParams(n_ctx_seq=n_ctx // 4, n_batch=512, n_seq_max=4, n_threads=2,
                                                flash_attn=flash_attn, unified=False))
        self.batch = Batch(512)
        self.state = SeqState(self.ctx)

    def eval(self, seq: int, tokens: list[int], start: int = 0, chunk: int = CHUNK) -> np.ndarray:
        """Evaluate `tokens` at positions start.. in chunks; the last token's logits."""
        for i in range(0, len(tokens), chunk):
            self.batch.clear()
            part = tokens[i : i + chunk]
            for j, token in enumerate(part):
                self.batch.add(token, start + i + j, seq, i + j == len(tokens) - 1)
            self.ctx.decode(self.batch)
        return self.ctx.logits(self.batch.n_tokens - 1).copy()

    def next_logits(self, seq: int, tokens: list[int], n: int) -> np.ndarray:
        """The logits after tokens[n], given that `seq` holds tokens[:n]."""
        return self.eval(seq, tokens[n : n + 1], n)

    def recomputed(self, seq: int, tokens: list[int], n: int, chunk: int = CHUNK) -> np.ndarray:
        self.ctx.seq_rm(seq)
        self.eval(seq, tokens[:n], chunk=chunk)
        return self.next_logits(seq, tokens, n)

    def restored(self, seq: int, tokens: list[int], pages: list[KvPage], n: int) -> np.ndarray:
        self.state.attach(seq, pages, n)
        first = max(0, n - self.state.n_swa) if self.state.n_swa else 0  # a window's rows, in SWA layers
        assert (self.ctx.seq_pos_min(seq), self.ctx.seq_pos_max(seq)) == (first, n - 1)
        return self.next_logits(seq, tokens, n)

    def close(self) -> None:
        self.batch.close()
        self.ctx.close()


def _tokens(n: int, seed: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(100, 20000, n)]


@pytest.fixture(scope="module")
def tiny_llama(tiny) -> Iterator[Model]:
    model = Model(tiny("llama"))
    yield model
    model.close()


@pytest.fixture(params=["on", "off"])  # off: llama.cpp stores V transposed
def runner(request: pytest.FixtureRequest, tiny_llama: Model) -> Iterator[Runner]:
    r = Runner(tiny_llama, request.param)
    yield r
    r.close()


def test_pages_restore_the_rows_recomputing_gives(runner: Runner) -> None:
    tokens = _tokens(100, seed=1)
    runner.eval(0, tokens[:96])
    pages = runner.state.donate(0, PAGE)
    assert [(p.start, p.n_rows) for p in pages] == [(i * PAGE, PAGE) for i in range(6)]
    for n in (64, 96):  # a prefix of the donor, and all of it
        np.testing.assert_array_equal(runner.restored(1, tokens, pages, n), runner.recomputed(2, tokens, n))
        runner.ctx.seq_rm(1)


def test_a_restore_from_page_bytes_gives_the_rows_recomputing_gives(runner: Runner) -> None:
    """Pages put into a blob from their bytes as the disk tier stores them (through one buffer, which
    the next page overwrites), in any order, or filled from memory, restore what recomputing gives;
    bytes of a page of another place are refused."""
    tokens = _tokens(100, seed=4)
    runner.eval(0, tokens[:96])
    pages = runner.state.donate(0, PAGE)
    buffer = np.empty(0, np.uint8)
    for n in (95, 96):  # the last page cut short (a prompt's last token is evaluated), and whole
        restore = runner.state.restore(n)
        for page in reversed(pages[1:]):
            data = np.concatenate(runner.state.page_bytes(page))
            buffer = buffer if buffer.size >= data.size else np.empty(data.size, np.uint8)
            buffer[: data.size] = data
            restore.put(buffer[: data.size], page.start, page.n_rows)
            buffer[:] = 0xA5
        restore.fill(pages[0])
        restore.load(1)
        assert (runner.ctx.seq_pos_min(1), runner.ctx.seq_pos_max(1)) == (0, n - 1)
        np.testing.assert_array_equal(runner.next_logits(1, tokens, n), runner.recomputed(2, tokens, n))
        runner.ctx.seq_rm(1)
    with pytest.raises(StateFormatError):
        runner.state.restore(96).put(np.concatenate(runner.state.page_bytes(pages[2])), PAGE, PAGE)


def test_a_restore_waits_for_the_buffer_mapped_for_it(runner: Runner) -> None:
    """A restore while a buffer is still being `mapped` for it on another thread waits for it and
    writes into it (mapped ahead, the point of reserving), not into fresh memory of its own."""
    runner.eval(0, _tokens(32, seed=5))
    runner.state.donate(0, PAGE)  # the layout is known
    gate = threading.Event()
    with ThreadPoolExecutor(1) as pool:
        pool.submit(gate.wait)  # the mapping waits behind this until the restore has asked for its blob
        ahead = runner.state.reserving = pool.submit(mapped, 16 << 20)
        threading.Timer(0.2, gate.set).start()
        restore = runner.state.restore(64)
    assert restore.blob.ctypes.data == ahead.result().ctypes.data and runner.state.reserving is None
    assert runner.state.restore(96).blob.ctypes.data == ahead.result().ctypes.data  # kept for the next


def test_a_prefix_from_two_donors(runner: Runner) -> None:
    """A's pages where A and B share tokens, then B's own: equal to recomputing B."""
    a = _tokens(64, seed=2)
    b = a[:32] + _tokens(68, seed=3)
    runner.eval(0, a)
    runner.eval(1, b[:96])
    pages = runner.state.donate(0, PAGE, 0, 2) + runner.state.donate(1, PAGE, 2)
    np.testing.assert_array_equal(runner.restored(2, b, pages, 96), runner.recomputed(3, b, 96))


def _shifted_positions(page: KvPage, by: int) -> KvPage:
    """The same rows moved `by` positions (a cell's metadata starts with its i32 position)."""
    tables = tuple(t.copy() for t in page.tables)
    for t in tables:
        positions = t[:, :4].copy().view(np.int32)
        t[:, :4] = (positions + by).view(np.uint8)
    return KvPage(page.start + by, page.n_rows, tables)


def _swapped_positions(page: KvPage, i: int, j: int) -> KvPage:
    """Cells i and j exchange their positions but keep their rows."""
    tables = tuple(t.copy() for t in page.tables)
    for t in tables:
        t[[i, j], :4] = t[[j, i], :4]
    return KvPage(page.start, page.n_rows, tables)


def _swapped_rows(page: KvPage, i: int, j: int) -> KvPage:
    """Cells i and j exchange their K and V rows but keep their positions."""
    tables = tuple(t.copy() for t in page.tables)
    for t in tables:
        t[[i, j]] = t[[j, i]]
        t[[i, j], :4] = t[[j, i], :4]
    return KvPage(page.start, page.n_rows, tables)


def test_cells_out_of_position_order_are_read_in_order(runner: Runner) -> None:
    """A stream may hold a sequence's cells in any order: restoring a page whose cells come
    backwards puts them so, and reading them back gives the donor's pages again."""
    runner.eval(0, _tokens(64, seed=8))
    pages = runner.state.donate(0, PAGE)
    backwards = KvPage(PAGE, PAGE, tuple(t[::-1].copy() for t in pages[1].tables))
    runner.state.attach(1, [pages[0], backwards, *pages[2:]], 64)
    for first_page in (0, 1, 2):
        again = runner.state.donate(1, PAGE, first_page)
        assert [p.start for p in again] == [p.start for p in pages[first_page:]]
        for mine, theirs in zip(again, pages[first_page:]):
            assert all(np.array_equal(a, b) for a, b in zip(mine.tables, theirs.tables))
    first_pos = pages[1].tables[0][:, :4].copy().view(np.int32)[:, 0]
    assert (np.diff(first_pos) == 1).all() and first_pos[0] == PAGE


def _probe(runner: Runner, seq: int, tokens: list[int], pages: list[KvPage], n: int, cut: int) -> np.ndarray | None:
    """The next-token logits with `pages` restored, then again after dropping positions from `cut`
    on (a cut inside a page reads the positions cells carry, which attention alone does not);
    None when llama.cpp refuses to continue at `cut` (positions are missing there)."""
    runner.ctx.seq_rm(seq)
    at_n = runner.restored(seq, tokens, pages, n)
    runner.ctx.seq_rm(seq, cut, -1)
    try:
        return np.concatenate([at_n, runner.next_logits(seq, tokens, cut)])
    except DecodeError:
        return None


def test_the_comparison_catches_misplaced_pages(runner: Runner) -> None:
    tokens = _tokens(100, seed=4)
    runner.eval(0, tokens[:64])
    pages = runner.state.donate(0, PAGE)
    runner.eval(1, tokens[PAGE : PAGE + 64])  # the same tokens one page early: rows at the wrong positions
    early = runner.state.donate(1, PAGE)
    mutants = {
        "wrong offset": KvPage(PAGE, PAGE, pages[2].tables),
        "rows computed at other positions": _shifted_positions(early[0], PAGE),
        "wrong positions": _swapped_positions(pages[1], 3, 5),
        "wrong row": _swapped_rows(pages[1], 2, 9),
    }
    cut = PAGE + 4  # between the cells those mutants exchange
    control = _probe(runner, 2, tokens, pages[:4], 64, cut)
    assert control is not None
    np.testing.assert_array_equal(control[: len(control) // 2], runner.recomputed(3, tokens, 64))
    for name, mutant in mutants.items():
        probed = _probe(runner, 2, tokens, [pages[0], mutant, pages[2], pages[3]], 64, cut)
        assert probed is None or not np.array_equal(probed, control), name


def test_refuses_what_is_not_a_prefix_from_zero(runner: Runner) -> None:
    runner.eval(0, _tokens(48, seed=5))
    pages = runner.state.donate(0, PAGE)
    with pytest.raises(ValueError, match="consecutive"):
        runner.state.assemble(pages[1:], 32)
    with pytest.raises(ValueError, match="cover"):
        runner.state.assemble(pages, 49)
    with pytest.raises(ValueError, match="whole pages"):
        runner.state.donate(0, PAGE, 2, 2)
    assert runner.state.donate(1, PAGE) == []  # an empty sequence has no page


@pytest.mark.parametrize("arch", ["lfm2", "mamba"])
def test_models_that_carry_state_are_refused(tiny, arch: str) -> None:
    model = Model(tiny(arch))
    ctx = Context(model, ContextParams(n_ctx_seq=256, n_batch=64, n_seq_max=2, n_threads=2))
    with pytest.raises(StateFormatError, match="checkpoints"):
        SeqState(ctx)
    ctx.close()
    model.close()


def test_smollm2_pages_cost_a_row_per_token(smollm2: Path) -> None:
    model = Model(smollm2)
    runner = Runner(model, "auto", n_ctx=2048)
    tokens = _tokens(200, seed=6)
    runner.eval(0, tokens[:192])
    pages = runner.state.donate(0, PAGE)
    n = 12 * PAGE
    per_token = sum(p.nbytes for p in pages) / n
    n_layer = llama_cpp.llama_model_n_layer(model.ptr)
    assert runner.state.row_bytes == n_layer * 2 * 2 * 192  # 3 KV heads of 64, K and V in f16
    assert per_token <= 1.1 * runner.state.row_bytes
    np.testing.assert_array_equal(runner.restored(1, tokens, pages, n), runner.recomputed(2, tokens, n))
    runner.close()
    model.close()


def test_sliding_window_pages_keep_their_window_or_refuse(gemma3: Path) -> None:
    """Gemma 3 (window 512): a restore needs the SWA rows of the window before it; pages donated
    far past a position lack them there, and restoring up to it is refused. Flash attention off:
    its rounding depends on where cells sit in the stream."""
    model = Model(gemma3)
    runner = Runner(model, "off", n_ctx=4096)
    n_swa = runner.state.n_swa
    assert n_swa == 512
    length = n_swa + 12 * PAGE
    tokens = _tokens(length + 8, seed=7)
    runner.eval(0, tokens[:length], chunk=256)
    pages = runner.state.donate(0, PAGE)
    assert len(pages[0].tables) == 2 and len(pages[0].tables[1]) == 0  # base rows only: past the window
    assert all(len(p.tables[1]) == PAGE for p in pages[-n_swa // PAGE :])
    assert runner.state.restorable(pages, length)
    np.testing.assert_array_equal(runner.restored(1, tokens, pages, length),
                                  runner.recomputed(2, tokens, length, chunk=256))
    assert not runner.state.restorable(pages, length - PAGE)
    with pytest.raises(MissingRows):
        runner.state.assemble(pages, length - PAGE)
    runner.close()
    model.close()

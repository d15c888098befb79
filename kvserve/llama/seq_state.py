"""A sequence's KV rows out of llama.cpp, cut into pages by position, and back into a sequence.

The only code that knows the per-sequence state format (`llama_kv_cache::state_write` at the pinned
llama.cpp) that `llama_state_seq_get_data` writes for a context whose memory is a KV cache:

    u32 magic, i32 seq id                                      the header, kept as it is
    one section per KV cache: one, or two for sliding-window (iSWA) models, full layers then SWA layers
      u32 n_stream; per stream: u32 n_cells and, where n_cells > 0 (one stream: this sequence's):
        per cell, in cell order: i32 pos, u32 n_seq (1), [12-byte ext: M-RoPE/PLE models], i32 seq (0 in pages)
        u32 v_trans, u32 n_layer
        per layer: i32 K type, u64 K row bytes, then every cell's K row
        per layer, V as rows: i32 type, u64 row bytes, then every cell's V row
        per layer, V transposed: i32 type, u32 element bytes, u32 n_embd_v, then per element, every cell's

Read, a section becomes a table with one row per cell in position order: its metadata, then every
layer's K row and V row (a transposed V gathered per cell). A `KvPage` holds, per section, the table
rows of one run of positions, so pages are stored apart and joined again by concatenation.

Invariants:
- `assemble` of pages covering [0, n) gives a blob that llama.cpp restores to exactly positions 0..n-1
  (`attach` checks it through `llama_memory_seq_pos_max`) holding the donor's rows byte for byte;
- a page owns its rows: nothing keeps the donor's blob alive;
- the layout (sections, metadata size, each layer's row sizes) is learned from the first blob read and
  checked by writing that blob back byte for byte; a blob that does not fit it raises StateFormatError.
- memory: a blob on its way into or out of llama.cpp passes through one buffer, kept and grown to
  the largest so far (at most one sequence's whole context, and 1 GiB), so a restore writes into
  memory already mapped. A buffer `mapped` on another thread ahead of need (`reserving`) becomes
  it; nothing else here leaves the context's thread, except a `Restore`'s pages, each written to
  its own rows.

Sliding-window models: for one sequence, `state_write` leaves out the cells its SWA layers no longer
attend, so a blob of L tokens holds SWA rows only for its last window (the base layers hold all L).
A page keeps the SWA rows its positions had (always a suffix of the page). Restoring [0, n) needs
the SWA rows of [n - n_swa + 1, n), the ones the next token attends (a chunked window needs fewer):
where a page lacks them, `restorable` is False and `assemble` raises MissingRows. So pages donated
from far past a prefix's end restore the full layers only; such a prefix is refused, not guessed.
The window's rows of a sequence standing at a page boundary come back alone with
`llama_state_seq_get_data_ext(..., LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY)` (the SWA section only:
`read_window`), and `with_window` puts them into the pages before that boundary: a position's rows
depend only on the tokens up to it, so they hold for every prompt through those pages.

Models that carry state (recurrent, hybrid) are refused: their checkpoints are whole opaque blobs
(`Context.save_state` / `load_state`) that a host store keeps as they are.
"""

from __future__ import annotations

import hashlib
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Iterator, Sequence

import llama_cpp
import numpy as np

from kvserve.llama.batch import Batch
from kvserve.llama.context import Context

_MAGIC = 0xAF143CD8
_HEADER_BYTES = 8  # u32 magic, i32 seq id
_CELL_BYTES = 12  # i32 pos, u32 n_seq, i32 seq
_EXT_BYTES = 12  # llama_kv_cell_ext: i32 x, i32 y, i32 token
_BLOCK_HEAD_BYTES = 12  # i32 type and u64 row bytes, or i32 type, u32 element bytes and u32 n_embd_v
_MAX_GGML_TYPE = 64
_KEPT_BYTES = 1 << 30  # the most the blob buffer kept between restores grows to
_BLOB_HEADS = 1 << 20  # more than a blob's heads beyond its pages' rows (12 bytes per layer's K and V)


class StateFormatError(ValueError):
    """A state blob this module cannot read: another llama.cpp version, memory kind or attention pattern."""


class MissingRows(LookupError):
    """The pages lack rows a restore needs (sliding-window rows past their window)."""


@dataclass(frozen=True)
class _Block:
    """One layer's K or V in a section: `row_bytes` per cell; `n_embd` > 0 for a transposed V."""

    head: bytes
    row_bytes: int
    n_embd: int = 0


@dataclass(frozen=True)
class _Section:
    n_stream: int
    meta_bytes: int
    data_head: bytes  # u32 v_trans, u32 n_layer
    blocks: tuple[_Block, ...]
    sliding: bool

    @property
    def width(self) -> int:
        return self.meta_bytes + sum(b.row_bytes for b in self.blocks)

    def columns(self) -> list[tuple[int, int]]:
        """A table's column ranges: the metadata, then each block's row."""
        edges = [0, self.meta_bytes]
        for block in self.blocks:
            edges.append(edges[-1] + block.row_bytes)
        return list(zip(edges, edges[1:]))

    def size(self, n_cells: int) -> int:
        if not n_cells:
            return 4 + 4 * self.n_stream
        return 4 + 4 * self.n_stream + len(self.data_head) + _BLOCK_HEAD_BYTES * len(self.blocks) + n_cells * self.width


@dataclass(frozen=True, eq=False)
class KvPage:
    """Rows of positions [start, start + n_rows), all layers: per section, a table whose rows are the
    last `len(table)` of those positions in order (all of them, except sliding-window rows gone)."""

    start: int
    n_rows: int
    tables: tuple[np.ndarray, ...]

    @property
    def end(self) -> int:
        return self.start + self.n_rows

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tables)

    def first_present(self, section: int) -> int:
        return self.end - len(self.tables[section])


@dataclass(frozen=True)
class SeqRows:
    """One sequence's cells as read: per section, (first position, table in position order)."""

    length: int
    tables: tuple[tuple[int, np.ndarray], ...]


class _Reader:
    def __init__(self, blob: np.ndarray) -> None:
        self.blob = blob
        self.at = 0

    def take(self, n: int) -> np.ndarray:
        if n < 0 or self.at + n > self.blob.size:
            raise StateFormatError("state blob ends early")
        out = self.blob[self.at : self.at + n]
        self.at += n
        return out

    def u32(self) -> int:
        return int(self.take(4).view(np.uint32)[0])


class SeqState:
    """Reads, cuts, joins and loads the KV rows of `ctx`'s sequences: keep one per context (it learns the
    layout from the first sequence it reads, and joins only pages it cut). One thread, like the context."""

    def __init__(self, ctx: Context) -> None:
        if ctx.model.info.carries_state:
            raise StateFormatError("a recurrent or hybrid model's state is not paged: keep whole checkpoints")
        self.ctx = ctx
        self.n_swa = int(llama_cpp.llama_model_n_swa(ctx.model.ptr))
        self._layout: tuple[_Section, ...] | None = None
        self._header = b""
        self._scratch = np.empty(0, np.uint8)
        self.reserving: Future[np.ndarray] | None = None  # a buffer `mapped` on another thread, for `_blob`

    @property
    def row_bytes(self) -> int:
        """K and V bytes of one token over every layer (0 until a sequence was read)."""
        return sum(b.row_bytes for s in self._layout or () for b in s.blocks)

    @property
    def knows_layout(self) -> bool:
        return self._layout is not None

    def learn_layout(self, seq: int, token: int) -> None:
        """Learn the layout from one `token` decoded alone at position 0 of the empty stream `seq`
        (left empty again): what a restored page needs when no sequence was read since start."""
        if self._layout is not None:
            return
        if self.ctx.seq_pos_max(seq) >= 0:
            raise ValueError("learn_layout needs an empty stream")
        batch = Batch(1)
        try:
            batch.add(token, 0, seq, False)
            self.ctx.decode(batch)
            self.parse(self.ctx.read_seq_state(seq))
        finally:
            batch.close()
            self.ctx.seq_rm(seq)
        if self._layout is None:
            raise StateFormatError("one token's state did not show the layout")

    # -- pages as bytes (the disk tier's payload) ----------------------------------------------------

    def page_bytes(self, page: KvPage) -> list[np.ndarray]:
        """`page` as bytes `page_from_bytes` reads back: u32 start, n_rows, n_tables, per table its
        row count and width, then each table's columns in turn: its rows' metadata, then each
        layer's K or V rows (laid out as a blob lays them, so a page read from disk goes straight
        into a blob: `Restore.put`). Safe on any thread once the layout is known. Pages are
        named by this layout too: a change bumps `page_key.FORMAT`."""
        if self._layout is None:
            raise StateFormatError("no layout learned yet")
        head = [page.start, page.n_rows, len(page.tables)]
        for table in page.tables:
            head += [len(table), table.shape[1] if table.ndim == 2 else 0]
        out = [np.asarray(head, dtype="<u4").view(np.uint8)]
        for section, table in zip(self._layout, page.tables):
            out += [np.ascontiguousarray(table[:, lo:hi]).reshape(-1) for lo, hi in section.columns()]
        return out

    def page_from_bytes(self, data: bytes | memoryview, start: int, n_rows: int) -> KvPage:
        """The page `page_bytes` wrote, in tables of its own, checked against the layout this context
        reads (each section's row width, every full-attention row present, sliding-window rows a
        suffix) and against the place it is to fill; StateFormatError for anything else."""
        if self._layout is None:
            raise StateFormatError("no layout learned yet")
        raw = np.frombuffer(data, np.uint8)
        n_head = self.page_head_bytes
        if raw.size < n_head:
            raise StateFormatError("a page shorter than its header")
        counts = self._page_head(raw[:n_head], start, n_rows)
        tables, at = [], n_head
        for section, rows in zip(self._layout, counts):
            table = np.empty((rows, section.width), np.uint8)
            for lo, hi in section.columns():
                part = raw[at : at + rows * (hi - lo)]
                if part.size != rows * (hi - lo):
                    raise StateFormatError("a page that ends early")
                table[:, lo:hi] = part.reshape(rows, hi - lo)
                at += part.size
            tables.append(table)
        if at != raw.size:
            raise StateFormatError("a page with bytes past its tables")
        return KvPage(start, n_rows, tuple(tables))

    @property
    def page_head_bytes(self) -> int:
        """The bytes of a page's head as `page_bytes` writes it: u32 start, n_rows, n_tables, then
        each table's row count and width."""
        assert self._layout is not None
        return 4 * (3 + 2 * len(self._layout))

    def _page_head(self, head: np.ndarray, start: int, n_rows: int) -> list[int]:
        """The row count of each table a page's head announces; StateFormatError unless it is a page
        of this layout, of `n_rows` positions from `start`."""
        assert self._layout is not None
        words = head.view("<u4").astype(np.int64)
        if (int(words[0]), int(words[1]), int(words[2])) != (start, n_rows, len(self._layout)):
            raise StateFormatError("a page of another place or another section count")
        counts = []
        for i, section in enumerate(self._layout):
            rows, width = int(words[3 + 2 * i]), int(words[4 + 2 * i])
            if width != section.width or rows > n_rows or (rows != n_rows and not section.sliding):
                raise StateFormatError("a page whose rows do not fit this context's layout")
            counts.append(rows)
        return counts

    def page_outline(self, nbytes: int, start: int, n_rows: int) -> KvPage:
        """A page of `nbytes` as `page_bytes` wrote it, without its rows: the row count of each section
        (tables of width 0), enough for `restorable` to say whether it restores a prefix."""
        if self._layout is None:
            raise StateFormatError("no layout learned yet")
        body = nbytes - self.page_head_bytes
        counts = [n_rows] * len(self._layout)
        if len(self._layout) == 2:
            rest = body - n_rows * self._layout[0].width
            counts[1] = rest // self._layout[1].width if self._layout[1].width else 0
        return KvPage(start, n_rows, tuple(np.empty((max(0, min(c, n_rows)), 0), np.uint8) for c in counts))

    # -- out of a sequence --------------------------------------------------------------------------

    def read(self, seq: int, first: int = 0) -> SeqRows:
        """The cells `seq` holds from position `first` on, as tables in position order."""
        return self.parse(self.ctx.read_seq_state(seq, buffer=self._blob), first)

    def donate(self, seq: int, page_rows: int, first_page: int = 0, n_pages: int | None = None) -> list[KvPage]:
        """Pages `first_page ..` of `seq` (as many whole pages as it holds, or `n_pages`); only
        their rows are copied out of the blob."""
        return self.cut(self.read(seq, first_page * page_rows), page_rows, first_page, n_pages)

    def cut(self, rows: SeqRows, page_rows: int, first_page: int = 0, n_pages: int | None = None) -> list[KvPage]:
        if page_rows < 1:
            raise ValueError("page_rows must be >= 1")
        whole = rows.length // page_rows
        last = whole if n_pages is None else first_page + n_pages
        if not 0 <= first_page <= last <= whole:
            raise ValueError(f"pages {first_page}..{last} exceed the {whole} whole pages held")
        if rows.tables and first_page * page_rows < rows.tables[0][0]:
            raise ValueError("those rows were not read")
        return [self._page(rows, i * page_rows, page_rows) for i in range(first_page, last)]

    @staticmethod
    def _page(rows: SeqRows, start: int, n: int) -> KvPage:
        tables = []
        for first, table in rows.tables:
            lo = min(max(start - first, 0), len(table))
            hi = min(max(start + n - first, 0), len(table))
            tables.append(table[lo:hi].copy())
        return KvPage(start, n, tuple(tables))

    def read_window(self, seq: int) -> tuple[int, np.ndarray]:
        """The sliding-window rows `seq` holds for its next token, read alone (llama.cpp's
        PARTIAL_ONLY state: the SWA section, no full-attention rows): (first position, table in
        position order, ending at the sequence's last position)."""
        if not self.n_swa or self._layout is None or len(self._layout) != 2:
            raise StateFormatError("no sliding-window section known: read a whole sequence first")
        blob = self.ctx.read_seq_state(seq, llama_cpp.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY)
        reader = _Reader(blob)
        if int(reader.take(_HEADER_BYTES)[:4].view(np.uint32)[0]) != _MAGIC:
            raise StateFormatError("not a sequence state blob (magic)")
        section, found = self._read_section(reader, self._layout[1], 1, 0)
        if reader.at != blob.size or section.blocks != self._layout[1].blocks:
            raise StateFormatError("a partial state that is not one sliding-window section")
        found.table[:, section.meta_bytes - 4 : section.meta_bytes] = 0
        if found.span[1] != self.ctx.seq_pos_max(seq) + 1:
            raise StateFormatError("sliding-window rows that do not end where the sequence does")
        return found.span[0], found.table

    @staticmethod
    def with_window(pages: list[KvPage], first: int, window: np.ndarray) -> list[KvPage]:
        """`pages` (consecutive, ending where `window` does) with the sliding-window rows of
        positions `first` on taken from `window` wherever a page lacks them; a page that needs none
        is returned as it was."""
        if not pages or first + len(window) != pages[-1].end:
            raise ValueError("the window must end where the pages do")
        out = []
        for page in pages:
            lo = max(page.start, first)
            if lo >= page.end or page.first_present(1) <= lo:
                out.append(page)
                continue
            rows = window[lo - first : page.end - first].copy()
            out.append(KvPage(page.start, page.n_rows, (page.tables[0], rows)))
        return out

    def parse(self, blob: np.ndarray, first: int = 0) -> SeqRows:
        """A blob's cells from position `first` on (all of them while the layout is being learned)."""
        learning = self._layout is None
        reader = _Reader(blob)
        header = reader.take(_HEADER_BYTES)
        if int(header[:4].view(np.uint32)[0]) != _MAGIC:
            raise StateFormatError("not a sequence state blob (magic)")
        sections: list[_Section] = []
        cells: list[_Cells] = []
        while reader.at < blob.size:
            index = len(sections)
            known = self._layout[index] if self._layout and index < len(self._layout) else None
            section, found = self._read_section(reader, known, index, 0 if learning else first)
            sections.append(section)
            cells.append(found)
        self._check_sections(sections)
        if learning and all(len(c.table) for c in cells):
            self._learn(tuple(sections), header.tobytes(), blob, cells)
        for section, found in zip(sections, cells):  # llama.cpp reads the donor's id and ignores it
            found.table[:, section.meta_bytes - 4 : section.meta_bytes] = 0
        return self._checked(sections, cells)

    def _learn(self, layout: tuple[_Section, ...], header: bytes, blob: np.ndarray, cells: list[_Cells]) -> None:
        """Take `layout` once writing the cells back in their order gives the blob byte for byte."""
        self._layout, self._header = layout, header
        if not np.array_equal(self._write([(c.stream, [c.as_written()]) for c in cells], header), blob):
            self._layout = None
            raise StateFormatError("the state layout read does not write back byte for byte")

    def _check_sections(self, sections: list[_Section]) -> None:
        if len(sections) not in (1, 2) or (len(sections) == 2 and not self.n_swa):
            raise StateFormatError(f"{len(sections)} KV sections: not a KV cache this module knows")
        if self._layout is not None and len(sections) != len(self._layout):
            raise StateFormatError("the section count changed")

    def _read_section(self, reader: _Reader, known: _Section | None, index: int, first: int) -> tuple[_Section, _Cells]:
        n_stream = reader.u32()
        found, section, seen = _Cells.empty(), known, False
        for s in range(n_stream):
            n = reader.u32()
            if n:
                if seen:
                    raise StateFormatError("a sequence's cells in two streams")
                seen = True
                section = known if known is not None and known.blocks else self._read_layout(reader, n, n_stream, index)
                found = _read_cells(reader, n, section, s, first)
        if section is None:  # no cell to learn the layout from
            section = _Section(n_stream, 0, b"", (), sliding=index == 1)
        if section.n_stream != n_stream:
            raise StateFormatError("the stream count changed")
        return section, found

    @staticmethod
    def _read_layout(reader: _Reader, n: int, n_stream: int, index: int) -> _Section:
        """The layout of the cells at the reader (which stays where it was), trying each metadata size."""
        start = reader.at
        for meta_bytes in (_CELL_BYTES, _CELL_BYTES + _EXT_BYTES):
            reader.at = start
            try:
                return _read_blocks(reader, n, n_stream, meta_bytes, index)
            except StateFormatError:
                continue
            finally:
                reader.at = start
        raise StateFormatError("unrecognized cell layout")

    def _checked(self, sections: list[_Section], cells: list[_Cells]) -> SeqRows:
        """Check what a sequence holds: full layers 0..L-1, sliding-window layers a run ending at L-1."""
        tables, length = [], 0
        for section, found in zip(sections, cells):
            lo, hi = found.span
            if not section.sliding:
                if hi > lo and lo != 0:
                    raise StateFormatError("a sequence that does not start at position 0")
                length = hi
            elif hi > lo and hi != length:
                raise StateFormatError("sliding-window rows that are not the sequence's last ones")
            tables.append((found.first if len(found.table) else max(found.first, length), found.table))
        return SeqRows(length, tuple(tables))

    # -- into a sequence ----------------------------------------------------------------------------

    def restorable(self, pages: list[KvPage], n: int) -> bool:
        """Whether `assemble(pages, n)` has every row it needs."""
        try:
            self._spans(pages, n)
        except MissingRows:
            return False
        return True

    def attach(self, seq: int, pages: list[KvPage], n: int) -> None:
        """Load positions [0, n) from `pages` into `seq`, replacing whatever it held."""
        self.ctx.write_seq_state(seq, self._assemble(pages, n, into_scratch=True))
        self._check_restored(seq, n)

    def restore(self, n: int) -> "Restore":
        """A blob of positions [0, n) to be filled page by page, then loaded (`Restore`). A model
        with one KV section only (no sliding window)."""
        layout = self._layout
        if layout is None or len(layout) != 1:
            raise StateFormatError("a restore page by page needs one known KV section")
        if n < 1:
            raise ValueError("nothing to restore")
        out = self._blob(_HEADER_BYTES + layout[0].size(n))
        out[:_HEADER_BYTES] = np.frombuffer(self._header, np.uint8)
        slots, end = _lay_section(out, _HEADER_BYTES, layout[0], 0, n)
        assert end == out.size
        return Restore(self, n, out, slots)

    def load_run(self, seq: int, body: np.ndarray, capacity: int) -> list[int] | None:
        """What `Context.load_seq_file` does with a run's file, for its body already in memory (`run_file`'s
        layout): the tokens it names, at most `capacity`, with its state loaded into `seq` in one copy; None
        where it is not a run of this context's format (`seq` is empty then). `body` is spent: the state's
        header goes over the last two tokens' bytes."""
        if not self._header or body.size < 12:
            return None
        magic, version, n = (int(x) for x in body[:12].view("<u4"))
        start = 12 + 4 * n - _HEADER_BYTES
        if magic != llama_cpp.LLAMA_STATE_SEQ_MAGIC or version != llama_cpp.LLAMA_STATE_SEQ_VERSION \
                or not 2 <= n <= capacity or body.size <= 12 + 4 * n:
            return None
        tokens = body[12 : 12 + 4 * n].view("<i4").tolist()
        body[start : start + _HEADER_BYTES] = np.frombuffer(self._header, np.uint8)
        try:
            self.ctx.write_seq_state(seq, body[start:])
        except RuntimeError:
            self.ctx.seq_rm(seq)
            return None
        return tokens

    def run_layout(self) -> bytes:
        """What `run_file`'s state depends on beyond its pages: the context's stream count, the metadata
        size and every layer's head (V as rows or transposed), as 32 bytes. llama.cpp refuses a file
        of another (a restart with another `--parallel` or flash attention)."""
        if self._layout is None:
            raise StateFormatError("no layout learned yet")
        section = self._layout[0]
        heads = [section.n_stream.to_bytes(4, "little"), section.meta_bytes.to_bytes(4, "little"), section.data_head]
        return hashlib.sha256(b"".join(heads + [block.head for block in section.blocks])).digest()

    def run_file(self, pages: list[KvPage], tokens: Sequence[int]) -> tuple[int, Iterator[np.ndarray]]:
        """`pages` (consecutive from position 0, one KV section) as the file `llama_state_seq_save_file`
        writes, which `Context.load_seq_file` restores: u32 magic, u32 version, u32 n_tokens, the
        tokens (`tokens`' first n), then the state `llama_state_seq_get_data` writes (what `assemble`
        lays out), less its own header. Its size, and its bytes in parts, one layer's K or V at a time:
        a run costs no more memory than one layer's rows beside its pages. Safe on any thread once
        the layout is known."""
        layout = self._layout
        if layout is None or len(layout) != 1 or layout[0].sliding:
            raise StateFormatError("a run needs one known KV section")
        section, n = layout[0], pages[-1].end if pages else 0
        self._spans(pages, n)  # consecutive from position 0
        if len(tokens) < n:
            raise ValueError(f"{len(tokens)} tokens for a run of {n} positions")
        tables = [page.tables[0] for page in pages]

        def parts() -> Iterator[np.ndarray]:
            yield np.asarray([llama_cpp.LLAMA_STATE_SEQ_MAGIC, llama_cpp.LLAMA_STATE_SEQ_VERSION, n], "<u4")
            yield np.asarray(tokens[:n], "<i4")
            counts = np.zeros(1 + section.n_stream, np.uint32)
            counts[:2] = section.n_stream, n
            yield counts[:2]
            yield np.concatenate([table[:, : section.meta_bytes] for table in tables])
            yield np.frombuffer(section.data_head, np.uint8)
            for block, (lo, hi) in zip(section.blocks, section.columns()[1:]):
                yield np.frombuffer(block.head, np.uint8)
                cells = np.concatenate([table[:, lo:hi] for table in tables])
                yield cells.reshape(n, block.n_embd, -1).transpose(1, 0, 2).copy() if block.n_embd else cells
            yield counts[2:]

        return 12 + 4 * n + section.size(n), parts()

    def _blob(self, nbytes: int) -> np.ndarray:
        """`nbytes` of the one buffer every blob on its way into or out of llama.cpp passes through,
        kept and grown to the largest up to `_KEPT_BYTES`: a restore writes into memory already
        mapped, not into pages the kernel must first find and zero (a fresh 224 MB blob took 0.25-0.5
        s on a VM). A larger blob gets a buffer of its own, let go after it."""
        if self._scratch.size < nbytes and self.reserving is not None:
            ahead = self.reserving  # mapped on another thread: wait for the rest of it
            self.reserving = None
            if ahead.exception() is None and ahead.result().size > self._scratch.size:
                self._scratch = ahead.result()
        if self._scratch.size >= nbytes:
            return self._scratch[:nbytes]
        if nbytes > _KEPT_BYTES:
            return np.empty(nbytes, np.uint8)
        self._scratch = np.empty(0, np.uint8)  # let go of the old one before taking the new
        self._scratch = np.empty(nbytes, np.uint8)
        return self._scratch

    def _check_restored(self, seq: int, n: int) -> None:
        last = self.ctx.seq_pos_max(seq)
        if last != n - 1:
            self.ctx.seq_rm(seq)
            raise RuntimeError(f"restored positions end at {last}, not {n - 1}")

    def assemble(self, pages: list[KvPage], n: int) -> np.ndarray:
        """The state blob of positions [0, n) of `pages` (consecutive from position 0), in a buffer of its own."""
        return self._assemble(pages, n, into_scratch=False)

    def _assemble(self, pages: list[KvPage], n: int, into_scratch: bool) -> np.ndarray:
        if self._layout is None:
            raise StateFormatError("no sequence read yet: the layout is unknown")
        spans = enumerate(self._spans(pages, n))
        found = [(0, [_page_rows(p, s, first, n) for p in used]) for s, (first, used) in spans]
        return self._write(found, self._header, into_scratch)

    def _spans(self, pages: list[KvPage], n: int) -> list[tuple[int, list[KvPage]]]:
        """Per section: the first position restored and the pages it comes from."""
        if n < 1:
            raise ValueError("nothing to restore")
        covered = 0
        for page in pages:
            if page.start != covered:
                raise ValueError(f"pages must be consecutive from position 0: one starts at {page.start}, not {covered}")
            covered = page.end
        if covered < n:
            raise ValueError(f"pages cover {covered} positions, not {n}")
        used = [p for p in pages if p.start < n]
        return [self._sliding_span(used, n, s) if section.sliding else (0, used)
                for s, section in enumerate(self._layout or ())]

    def _sliding_span(self, used: list[KvPage], n: int, s: int) -> tuple[int, list[KvPage]]:
        """The run of SWA rows ending at n: back to the window's start, or where rows stop."""
        want = max(0, n - self.n_swa)
        first = n
        for page in reversed(used):
            present = page.first_present(s)
            if present >= first or page.start >= first or first > page.end:
                break
            first = max(present, want)
            if first == want or present > page.start:
                break
        if first > max(0, n - self.n_swa + 1):
            raise MissingRows(f"sliding-window rows of positions {max(0, n - self.n_swa + 1)}..{first - 1} are gone")
        return first, [p for p in used if p.end > first]

    def _write(self, found: list[tuple[int, list[np.ndarray]]], header: bytes, into_scratch: bool = False) -> np.ndarray:
        """A blob of `found`: per section, (stream index, its rows in the order to write, as tables
        one after another: each page's rows, copied straight into place), in the scratch buffer or
        in one of its own."""
        layout = self._layout
        assert layout is not None
        size = _HEADER_BYTES + sum(s.size(sum(map(len, t))) for s, (_, t) in zip(layout, found))
        out = self._blob(size) if into_scratch else np.empty(size, np.uint8)
        out[:_HEADER_BYTES] = np.frombuffer(header, np.uint8)
        at = _HEADER_BYTES
        for section, (stream, tables) in zip(layout, found):
            at = _write_section(out, at, section, stream, tables)
        assert at == out.size
        return out


def mapped(page_bytes: int) -> np.ndarray:
    """A buffer for the blob that restores pages of `page_bytes` in all (`page_bytes` as written; no
    more than a state keeps between restores), each of its memory pages touched: made on another
    thread while a model loads, it saves the first restore from disk the time fresh memory takes
    (0.3-0.7 s for 224 MB on a VM whose freed memory goes back to its host), as `SeqState.reserving`."""
    buffer = np.empty(min(page_bytes + _BLOB_HEADS, _KEPT_BYTES), np.uint8)
    buffer[::4096] = 0
    return buffer


class Restore:
    """A blob of positions [0, n) being filled, then loaded into a sequence. Each page fills its own
    rows (`fill` from a page in memory, `put` from its bytes as read from disk), in any order and
    from any thread; `load` runs on the context's thread once every page is in."""

    def __init__(self, state: SeqState, n: int, blob: np.ndarray, slots: "_Slots") -> None:
        self.state, self.n, self.blob, self.slots = state, n, blob, slots

    def fill(self, page: KvPage) -> None:
        """Copy the rows of `page` below `n` into place."""
        if page.start < self.n:
            self.slots.fill(slice(page.start, min(page.end, self.n)), page.tables[0][: self.n - page.start])

    def put(self, data: bytes | memoryview | np.ndarray, start: int, n_rows: int) -> None:
        """Copy the rows below `n` of the page `page_bytes` wrote as `data` (of `n_rows` positions
        from `start`) into place; StateFormatError, nothing copied, where it is not such a page."""
        raw = np.frombuffer(data, np.uint8)
        section = self.slots.section
        n_head = self.state.page_head_bytes
        if raw.size != n_head + n_rows * section.width:
            raise StateFormatError("a page whose size does not fit this context's layout")
        self.state._page_head(raw[:n_head], start, n_rows)
        if start < self.n:
            self.slots.put(slice(start, min(start + n_rows, self.n)), raw[n_head:], n_rows)

    def load(self, seq: int) -> None:
        """Replace `seq`'s memory with positions [0, n)."""
        self.state.ctx.write_seq_state(seq, self.blob)
        self.state._check_restored(seq, self.n)


def _write_section(out: np.ndarray, at: int, section: _Section, stream: int, tables: list[np.ndarray]) -> int:
    slots, at = _lay_section(out, at, section, stream, sum(map(len, tables)))
    for rows, table in _row_ranges(tables):
        slots.fill(rows, table)
    return at


@dataclass(frozen=True)
class _Slots:
    """Where a section's `n` cells go in a blob being written: metadata, then each block's rows."""

    section: _Section
    meta: np.ndarray  # (n, meta bytes)
    blocks: tuple[np.ndarray, ...]  # per block: (n, row bytes), or (n_embd, n, element bytes) transposed
    every_block: np.ndarray | None  # (blocks, n, row bytes) over all of them, where they are alike

    def fill(self, rows: slice, table: np.ndarray) -> None:
        """Write `table` (rows as a page holds them) into the cells `rows`."""
        self.meta[rows] = table[:, : self.section.meta_bytes]
        col = self.section.meta_bytes
        if self.every_block is not None:  # one copy for the page, not one per block
            shape = (len(table), len(self.blocks), self.every_block.shape[2])
            self.every_block[:, rows] = table[:, col:].reshape(shape).transpose(1, 0, 2)
            return
        for block, dest in zip(self.section.blocks, self.blocks):
            self._put_block(block, dest, rows, table[:, col : col + block.row_bytes])
            col += block.row_bytes

    def put(self, rows: slice, columns: np.ndarray, n_rows: int) -> None:
        """Write the first rows of a page's `columns` (`page_bytes`' layout: each column of its
        `n_rows` rows in turn) into the cells `rows`."""
        k = rows.stop - rows.start
        self.meta[rows] = columns[: n_rows * self.section.meta_bytes].reshape(n_rows, -1)[:k]
        at = n_rows * self.section.meta_bytes
        if self.every_block is not None:  # one copy for the page, not one per block
            self.every_block[:, rows] = columns[at:].reshape(len(self.blocks), n_rows, -1)[:, :k]
            return
        for block, dest in zip(self.section.blocks, self.blocks):
            self._put_block(block, dest, rows, columns[at : at + n_rows * block.row_bytes].reshape(n_rows, -1)[:k])
            at += n_rows * block.row_bytes

    @staticmethod
    def _put_block(block: _Block, dest: np.ndarray, rows: slice, cells: np.ndarray) -> None:
        """Write one block's rows of the cells `rows` (`cells`: one row of bytes each) into `dest`,
        gathered per element where V is stored transposed."""
        if block.n_embd:
            dest[:, rows] = cells.reshape(len(cells), block.n_embd, -1).transpose(1, 0, 2)
        else:
            dest[rows] = cells


def _lay_section(out: np.ndarray, at: int, section: _Section, stream: int, n: int) -> tuple[_Slots, int]:
    """Write a section's heads for `n` cells in `stream` at `at`: where its rows go, and where it ends."""
    counts = np.zeros(1 + section.n_stream, np.uint32)
    counts[0] = section.n_stream
    counts[1 + stream] = n
    at = _put(out, at, counts[: 2 + stream].view(np.uint8))
    meta, blocks, every = out[at:at].reshape(0, section.meta_bytes), [], None
    if n:
        meta = out[at : at + n * section.meta_bytes].reshape(n, section.meta_bytes)
        at = _put(out, at + meta.size, np.frombuffer(section.data_head, np.uint8))
        first = at + _BLOCK_HEAD_BYTES
        for block in section.blocks:
            at = _put(out, at, np.frombuffer(block.head, np.uint8))
            dest = out[at : at + n * block.row_bytes]
            blocks.append(dest.reshape(block.n_embd, n, -1) if block.n_embd else dest.reshape(n, -1))
            at += n * block.row_bytes
        sizes = {(b.row_bytes, b.n_embd) for b in section.blocks}
        if len(sizes) == 1 and not section.blocks[0].n_embd:  # evenly spaced: one strided view over all
            row = section.blocks[0].row_bytes
            every = np.lib.stride_tricks.as_strided(
                out[first:at], shape=(len(blocks), n, row), strides=(_BLOCK_HEAD_BYTES + n * row, row, 1))
    at = _put(out, at, counts[2 + stream :].view(np.uint8))
    return _Slots(section, meta, tuple(blocks), every), at


def _row_ranges(tables: list[np.ndarray]) -> list[tuple[slice, np.ndarray]]:
    """Each table with the rows of the whole section it fills."""
    out, at = [], 0
    for table in tables:
        out.append((slice(at, at + len(table)), table))
        at += len(table)
    return out


@dataclass(frozen=True)
class _Cells:
    """One section's cells as read: `table` holds those from position `first` on, in position order;
    `span` is [lowest, highest + 1) of all of them; `order` sorted the cells as written."""

    stream: int
    span: tuple[int, int]
    first: int
    table: np.ndarray
    order: np.ndarray

    @staticmethod
    def empty() -> "_Cells":
        return _Cells(0, (0, 0), 0, np.empty((0, 0), np.uint8), np.empty(0, np.intp))

    def as_written(self) -> np.ndarray:
        return self.table[np.argsort(self.order)]


def _read_blocks(reader: _Reader, n: int, n_stream: int, meta_bytes: int, index: int) -> _Section:
    meta = reader.take(n * meta_bytes).view(np.int32).reshape(n, meta_bytes // 4)
    if not (meta[:, 1] == 1).all():
        raise StateFormatError("a cell with other than one sequence")
    data_head = reader.take(8)
    v_trans, n_layer = (int(x) for x in data_head.view(np.uint32))
    if v_trans > 1 or not 0 <= n_layer <= 4096:
        raise StateFormatError("bad layer header")
    blocks = []
    for i in range(2 * n_layer):
        head = reader.take(_BLOCK_HEAD_BYTES)
        kind = int(head[:4].view(np.int32)[0])
        if v_trans and i >= n_layer:
            el, n_embd = (int(x) for x in head[4:].view(np.uint32))
            block = _Block(head.tobytes(), el * n_embd, n_embd)
        else:
            block = _Block(head.tobytes(), int(head[4:].view(np.uint64)[0]))
        if not 0 <= kind < _MAX_GGML_TYPE or block.row_bytes <= 0:
            raise StateFormatError("bad K/V block header")
        reader.take(n * block.row_bytes)
        blocks.append(block)
    return _Section(n_stream, meta_bytes, data_head.tobytes(), tuple(blocks), sliding=index == 1)


def _read_cells(reader: _Reader, n: int, section: _Section, stream: int, first: int) -> _Cells:
    """The cells at the reader, those from position `first` on copied into a table in position order."""
    meta = reader.take(n * section.meta_bytes).reshape(n, section.meta_bytes)
    positions = meta.view(np.int32)[:, 0]
    order = np.argsort(positions, kind="stable")
    ranked = positions[order]
    span = (int(ranked[0]), int(ranked[-1]) + 1)
    if span[1] - span[0] != n or (n > 1 and not (ranked[1:] > ranked[:-1]).all()):
        raise StateFormatError("a sequence with a hole in its positions")
    skip = min(max(first - span[0], 0), n)
    keep: slice | np.ndarray = slice(skip, n) if (order[skip:] == np.arange(skip, n)).all() else order[skip:]
    table = np.empty((n - skip, section.width), np.uint8)
    table[:, : section.meta_bytes] = meta[keep]
    if reader.take(len(section.data_head)).tobytes() != section.data_head:
        raise StateFormatError("the layer header changed")
    col = section.meta_bytes
    for block in section.blocks:
        if reader.take(_BLOCK_HEAD_BYTES).tobytes() != block.head:
            raise StateFormatError("a K/V type or row size changed")
        _block_view(table, col, block)[...] = _as_cells(reader.take(n * block.row_bytes), n, block)[keep]
        col += block.row_bytes
    return _Cells(stream, span, span[0] + skip, table, order[skip:])


def _page_rows(page: KvPage, section: int, first: int, n: int) -> np.ndarray:
    """The page's rows of positions [first, n) in `section`."""
    present = page.first_present(section)
    return page.tables[section][max(first, present) - present : min(page.end, n) - present]


def _put(out: np.ndarray, at: int, data: np.ndarray) -> int:
    out[at : at + data.size].reshape(data.shape)[...] = data
    return at + data.size


def _block_view(table: np.ndarray, col: int, block: _Block) -> np.ndarray:
    """The table's columns of `block`: (cells, row bytes), or (cells, n_embd, element bytes) if transposed."""
    view = table[:, col : col + block.row_bytes]
    if block.n_embd:
        view = view.view()
        view.shape = (len(table), block.n_embd, block.row_bytes // block.n_embd)  # a view, never a copy
    return view


def _as_cells(data: np.ndarray, n: int, block: _Block) -> np.ndarray:
    """A block's bytes as written, arranged like `_block_view`."""
    if block.n_embd:
        return data.reshape(block.n_embd, n, -1).transpose(1, 0, 2)
    return data.reshape(n, block.row_bytes)

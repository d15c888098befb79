"""The page cache: finished sessions donate whole pages, new sessions attach them without recompute.

A page's KV rows live in host memory, in a `HostStore` keyed by its tree node: donate copies the
rows of the new pages out of the session's stream (`SeqState.donate`), attach sets the matched
pages into the new session's empty stream (`SeqState.attach`), then only the tail is evaluated.
Matches are page-granular, but the attach stops one token short of the prompt, because the model
needs at least one evaluated token to produce the next logits: a prompt whose last page is cached
attaches that page but its last row, and evaluates one token, not a page. Each namespace has a tree
of its own: a prefix sent under two namespaces is two chains, stored twice.

Invariants:
- every node of the forest has its page in the store, and every page in the store is a node's: a
  prefix shared by many donations is stored once;
- the store's bytes never exceed its budget, not even between a donation and an eviction: a page
  that cannot fit is not kept (nor any after it);
- each node locks its parent's page in the store once, so only leaves are evicted and chains
  shrink from the tail; a session locks the pages it attached or donated until it ends: those are
  never evicted; otherwise cold pages (never attached) go first, then the least recently used;
- a session that attached `n` tokens has exactly positions `0 .. n-1` in its stream;
- sliding-window models: a prefix is attached only where its pages hold the window's rows before
  its end. The prefill of a chat prompt stops at the page boundary at or before each useful mark
  (`checkpoint_at`), and `insert` there keeps the window with the pages: new pages carry it as
  read, pages already cached get it from a PARTIAL_ONLY read (`SeqState.read_window`). Those rows
  are part of the pages' bytes, within the same budget.

With a disk tier (`Tiers.disk`), every page donated is also written behind to disk, named by its
key (page_key.py), those the host budget cannot take included, and a window that fills a page later
rewrites it there. A prompt
matches the tree's pages, then the run of keys that follow them on disk; each file is checked by the
store, then against this context's layout (a page that fails either is discarded and ends the run,
never attached). Attach reads each file of the run straight into its rows' places in the state
blob (`SeqState.restore`). Nothing read from disk is copied into host memory before
the first token: the session's last insert, as it ends, donates only the pages after the run, and
leaves the run to read into host memory while the engine idles (`_promote`, `settle`: a slice at a
time, a request waiting for no more than one), then takes them into the tree and the host store,
as if donated, then the pages after them. Those the host budget cannot take stay on disk only; a
run whose pages before it left host memory meanwhile stays on disk. A sliding-window model reads
them into the tree and the host store at attach, its window checked first.
Pages evicted from host memory stay on disk. Each page entering or leaving host memory is an event
(`Tiers.events`); the disk store announces its own.

With runs (`Tiers.runs`, run_store.py; one KV section only), a session that ends with its whole
chain in host memory, `min_tokens` or longer, has the chain written again as one run, and so does a
chain read from disk into host memory whole (`_store_promoted`); an attach
from disk whose pages a run holds (one at most `RUN_WASTE` times as long) restores the run instead
of reading the pages, checked as it loads (or from memory, where the run store staged it at start),
and cut after the prompt's pages (`_load_run`). A staged run gives way to pages when host memory's
budget cannot hold both. Runs are never announced and never lengthen a match: they only restore
pages the match found.
"""

from __future__ import annotations

import math
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field

import numpy as np

from kvserve.cache.cache_stats import CacheStats
from kvserve.cache.chat_marks import MarkKind
from kvserve.cache.host_store import HostStore
from kvserve.cache.kv_pool import Session
from kvserve.cache.page_events import page_tag
from kvserve.cache.page_key import page_key, row_format
from kvserve.cache.page_tree import PageNode, PageTree
from kvserve.cache.prefix_cache import InsertAt, PrefixCache
from kvserve.cache.prefix_key import PrefixKey
from kvserve.llama.context import Context
from kvserve.cache.tiers import Tiers
from kvserve.llama.seq_state import KvPage, Restore, SeqState, StateFormatError


@dataclass(eq=False)
class Chain:
    """One donation: the path of pages it covered, as a dashboard sees it."""

    id: int
    path: list[PageNode]
    preview: str
    namespace: str = ""
    hits: int = 0

    def snapshot(self, page_rows: int, store: HostStore[PageNode, KvPage]) -> dict:
        """`bytes`: host memory of the pages on its path still held (a shared page counts in every
        chain through it)."""
        alive = [node for node in self.path if node.alive]
        return {
            "id": self.id,
            "tokens": len(self.path) * page_rows,
            "pages_alive": len(alive),
            "bytes": sum(map(store.size, alive)),
            "hits": self.hits,
            "preview": self.preview,
        }


# Runs waiting to be read into host memory at most: each holds its tail's pages (on disk too) until then
MAX_PROMOTIONS = 16
RUN_WASTE = 2  # the most a run may be longer than the pages it restores


@dataclass
class _Promotion:
    """A run of pages to read from disk into host memory while the engine idles, as a session ending
    asked: the pages of `keys`, page `first` on of `key`, then `tail` (donated from the session)."""
    preview: str
    key: PrefixKey
    first: int
    keys: list[bytes]
    tail: list[KvPage]
    pages: list[KvPage] = field(default_factory=list)  # read so far, from the first


class PageCache(PrefixCache):
    """Pages of donated prefixes in host memory, within the store's byte budget."""

    keeps = "pages"
    donates_prompt = True

    def __init__(self, ctx: Context, page_rows: int, store: HostStore[PageNode, KvPage], tiers: Tiers = Tiers(),
                 scratch: Future[np.ndarray] | None = None) -> None:
        """`scratch`: the buffer a first restore from disk needs, being mapped (`seq_state.mapped`)."""
        if ctx.model.info.carries_state:
            raise ValueError("KV pages cannot restore a recurrent state; this model needs checkpoints")
        if page_rows < 1:
            raise ValueError("page_rows must be >= 1")
        self.ctx = ctx
        self.rows = SeqState(ctx)
        self.page_rows = page_rows
        self.tree = PageTree(page_rows, row_format(ctx, page_rows).digest())
        self.chains: dict[int, Chain] = {}
        self.store = store
        store.on_evict = self._evicted
        self._locks: dict[object, list[PageNode]] = {}  # by session (or a settle's own while it stores)
        self._queried_tokens = 0
        self._hit_tokens = 0
        self._evicted_pages = 0
        self._next_chain = 1
        self._reader = ThreadPoolExecutor(2, thread_name_prefix="kvserve-disk-read")
        self._thread = threading.local()  # each reading thread's buffer for the pages it reads
        self._promotions: list[_Promotion] = []  # runs to read from disk by `settle`, in order
        self.windows_filled = 0  # windows read alone into pages already cached (PARTIAL_ONLY)
        self.tiers = tiers
        # with a disk tier, a long prompt's pages go behind to disk while it is evaluated; a sliding
        # window is kept only at the marks its prefill stops at, so its pages in between attach nothing
        self.donates_prefill = tiers.disk is not None and not self.rows.n_swa
        self.disk_refused = 0  # pages read from disk that did not fit this context's layout
        self._last_chain: tuple[str, list[int], list[bytes]] = ("", [], [])  # `_chain`'s: namespace, tokens, keys
        if tiers.disk is not None:
            self.rows.learn_layout(0, max(ctx.model.bos, 0))  # disk pages restore before any donation
            self.rows.reserving = scratch
            # started now: a thread started by the first restore held the GIL while the engine
            # thread waited to begin llama.cpp's read (1.5-3 ms of a 2,048-token restart)
            self._reader.submit(lambda: None)

    @property
    def held_pages(self) -> int:
        return self.tree.n_nodes

    @property
    def bytes_used(self) -> int:
        return self.store.bytes_used

    @property
    def budget_bytes(self) -> int:
        return self.store.budget_bytes

    def caps(self) -> dict:
        return {"prefix_state_bytes": self.store.budget_bytes}

    # -- lookup -------------------------------------------------------------------------------------

    def _match(self, key: PrefixKey) -> tuple[list[PageNode], list[bytes]]:
        """The longest run of whole pages of `key` `attach` can restore (a sliding-window model's pages
        may lack the window before a shorter run's end): the tree's path, then the keys of the pages
        after it on disk."""
        most = len(key.tokens) // self.page_rows
        path = self.tree.match(key, most)
        on_disk = self._disk_run(key, path, most)
        if self.rows.n_swa:
            pages = [self.store.peek(node) for node in path] + self._disk_outlines(on_disk, len(path))
            n = self._restorable(key, pages)
            del on_disk[max(n - len(path), 0):]
            del path[n:]
        return path, on_disk

    def _restorable(self, key: PrefixKey, pages: list[KvPage]) -> int:
        """How many of `pages` (from the start) a sliding-window model can restore for `key`: the
        longest run whose pages hold the window before the positions it restores."""
        n = len(pages)
        while n and not self.rows.restorable(pages[:n], self._rows_of(key, n)):
            n -= 1
        return n

    def _rows_of(self, key: PrefixKey, n_pages: int) -> int:
        """The positions `n_pages` pages of `key` restore: all their rows, leaving one token to evaluate."""
        return min(n_pages * self.page_rows, max(len(key.tokens) - 1, 0))

    def _disk_run(self, key: PrefixKey, path: list[PageNode], most: int) -> list[bytes]:
        """The keys of the pages of `key` after `path` that the disk holds, in a run."""
        disk, rows = self.tiers.disk, self.page_rows
        if disk is None or len(path) >= most:
            return []
        keys = self._chain(key, path)
        found: list[bytes] = []
        for i in range(len(path), most):
            if i == len(keys):
                parent = keys[-1] if keys else self.tree.root(key.namespace).key
                keys.append(page_key(parent, key.tokens[i * rows : (i + 1) * rows]))
            if not disk.contains(keys[i]):
                break
            found.append(keys[i])
        return found

    def _chain(self, key: PrefixKey, path: list[PageNode]) -> list[bytes]:
        """The keys known of `key`'s first pages (at least `path`'s), for `_disk_run` to extend: kept
        for the last prompt asked, which admission and the attach each match, up to four times in a
        step (its 512 keys took 0.55 ms at 8,192 tokens)."""
        namespace, tokens, keys = self._last_chain
        if namespace != key.namespace or tokens != key.tokens:
            tokens, keys = list(key.tokens), []
            self._last_chain = (key.namespace, tokens, keys)
        if len(keys) < len(path):
            keys[:] = [node.key for node in path]
        return keys

    def _disk_outlines(self, keys: list[bytes], first_page: int) -> list[KvPage]:
        """The pages of `keys` as row counts (from their sizes), for `restorable`."""
        outlines = []
        for i, key in enumerate(keys):
            entry = self.tiers.disk.entry(key) if self.tiers.disk is not None else None
            if entry is None:
                break
            outlines.append(self.rows.page_outline(entry.nbytes, (first_page + i) * self.page_rows, self.page_rows))
        return outlines

    def match_len(self, key: PrefixKey) -> int:
        """Tokens `attach` would attach right now, from host memory and disk. Changes no hit count
        and no recency."""
        path, on_disk = self._match(key)
        return self._rows_of(key, len(path) + len(on_disk))

    def matched_keys(self, key: PrefixKey) -> list[bytes]:
        """The keys of the pages `attach` would attach now, in order. Touches nothing."""
        path, on_disk = self._match(key)
        return [node.key for node in path] + on_disk

    def attach(self, session: Session, key: PrefixKey) -> list[int]:
        """Set the longest cached run of whole pages of `key` into an empty session's stream, all but
        the prompt's last token."""
        self.check_attachable(session, key)
        path, on_disk = self._match(key)
        self._queried_tokens += len(key.tokens)
        if on_disk and not self.rows.n_swa:
            return self._attach_streamed(session, key, path, on_disk)
        unkept: list[KvPage] = []  # pages read from disk that host memory could not take
        if on_disk:
            self._lock(session, path)  # keep them while storing the pages read evicts
            added, unkept = self._read_disk(session, key, path, on_disk)
            path = path + added
        pages = [self.store.get(node) for node in path] + unkept
        if self.rows.n_swa:
            del pages[self._restorable(key, pages):]
            del path[len(pages):]
        return self._attach_pages(session, key, path, pages)

    def _attach_streamed(self, session: Session, key: PrefixKey, path: list[PageNode], keys: list[bytes]) -> list[int]:
        """Attach `path`'s pages and then the run of `keys` read from disk, each file read straight
        into its place in the state blob: nothing read from disk is copied into host memory before
        the first token (as the session ends, `_promote` leaves them to the engine's idle time). A
        file that fails a check ends the run before it."""
        pages = [self.store.get(node) for node in path]
        n_pages = len(path) + len(keys)
        if self._load_run(session, key, [node.key for node in path] + keys):
            return self._attached(session, key, path, self._rows_of(key, n_pages))
        while n_pages > len(path):
            n = self._rows_of(key, n_pages)
            restore = self.rows.restore(n)
            for page in pages:
                restore.fill(page)
            taken = len(path) + self._read_into(restore, keys[: n_pages - len(path)], len(path))
            if taken == n_pages:
                restore.load(session.seq)
                return self._attached(session, key, path, n)
            n_pages = taken
        return self._attach_pages(session, key, path, pages)

    def _load_run(self, session: Session, key: PrefixKey, keys: list[bytes]) -> bool:
        """Restore the pages of `keys` (all of them, from the first) from a run that holds them, where
        the run store has one no more than twice as long: llama.cpp reads the file into the stream
        while a reading thread checks its checksum (or, staged, its body is copied from memory), the
        tokens it names must be the prompt's, and what follows the prompt's pages is cut. Whether it
        did; a run found wrong leaves the stream empty, is removed, and the pages are read instead."""
        found = self._run_for(keys[-1], len(keys)) if keys else None
        if found is None:
            return False
        runs, (name, n_pages) = self.tiers.runs, found
        assert runs is not None
        opened = runs.open(name)
        if opened is None:
            return False
        whole, matched, seq = n_pages * self.page_rows, len(keys) * self.page_rows, session.seq
        staged = runs.take_staged(name)  # read and checked at start
        with opened:
            if staged is not None:
                tokens, right = self.rows.load_run(seq, staged, whole), True
            else:
                checked = self._reader.submit(opened.verify)
                tokens = self.ctx.load_seq_file(seq, opened.path, whole)
                right = checked.result()
        n = self._rows_of(key, len(keys))
        if tokens is None:
            problem = "llama.cpp refused it"
        elif not right:
            problem = "checksum mismatch"
        elif len(tokens) != whole or tokens[:matched] != list(key.tokens[:matched]) or self.ctx.seq_pos_max(seq) != whole - 1:
            problem = "it holds other tokens or positions than its pages' keys say"
        elif n < whole and not self.ctx.seq_rm(seq, n, -1):
            problem = "it could not be cut to the prompt's pages"
        else:
            runs.restored(name, staged is not None)
            return True
        self.ctx.seq_rm(seq)
        runs.refuse(name, problem)
        return False

    def _run_for(self, page: bytes, n_pages: int) -> tuple[bytes, int] | None:
        """The shortest run holding the page keyed `page` (page `n_pages - 1` of its chain), where it
        is at most `RUN_WASTE` times as long (past that, reading the pages costs less than reading the
        whole run): its name and page count."""
        runs = self.tiers.runs
        found = runs.find(page, self.rows.run_layout()) if runs is not None else None
        return found if found is not None and found[1] <= RUN_WASTE * n_pages else None

    def _read_into(self, restore: Restore, keys: list[bytes], first: int) -> int:
        """Read the pages of `keys` (page `first` on) from disk into `restore`, on this thread and a
        reading thread, each taking the next page not taken and reading it through a buffer of its
        own; how many, from the first, came in whole (a file missing, or refused by the store or by
        the layout, ends the count; a refused one is removed). Each page's work outside its system
        calls, hash and copy is a few microseconds, so the two overlap: inside a served restart, 512
        pages of a 1.5B took 34-45 ms where one thread took 71-100 ms (the store's earlier read, 45 us
        of Python a page, made two threads slower than one). The reading thread may be busy (the
        blob's mapping at start): this thread then reads every page, and the other, once it starts,
        none."""
        taking, pages = threading.Lock(), iter(range(len(keys)))
        ended = [len(keys)]  # the first page that did not come in whole
        refused: list[bytes] = []  # removed here, on the engine thread, once both threads are done

        def read() -> None:
            while True:
                with taking:
                    i = next(pages, None)
                if i is None or i > ended[0]:
                    return
                if (outcome := self._read_page(restore, keys[i], first + i)) != "read":
                    with taking:
                        ended[0] = min(ended[0], i)
                        if outcome == "refused":
                            refused.append(keys[i])

        helper = self._reader.submit(read) if len(keys) > 1 else None
        try:
            read()
        finally:
            if helper is not None and not helper.cancel():
                helper.result()  # no read may still write into a blob the next restore reuses
        for page_key_ in refused:
            self._refused(page_key_)
        return ended[0]

    def _read_page(self, restore: Restore, page_key_: bytes, page: int) -> str:
        """Page number `page`, `page_key_` on disk, read into its rows of `restore`: "read", "missing",
        or "refused" by the layout. Safe on any thread."""
        # its promotion reads it again, and touches it (or only touches it, past the host budget)
        data = self._read_file(page_key_, touch=False)
        if data is None:
            return "missing"
        try:
            restore.put(data, page * self.page_rows, self.page_rows)
        except StateFormatError:
            return "refused"
        return "read"

    def _read_file(self, page_key_: bytes, touch: bool = True) -> memoryview | None:
        """A page file's checked bytes, read through this thread's own buffer (valid until its next
        read), or None: missing, or refused by the store."""
        disk = self.tiers.disk
        assert disk is not None
        buffer = getattr(self._thread, "buffer", None)
        nbytes = entry.nbytes if (entry := disk.entry(page_key_)) else 0
        if buffer is None or buffer.size < nbytes:
            buffer = self._thread.buffer = np.empty(nbytes, np.uint8)
        return disk.get(page_key_, into=buffer, touch=touch)

    def _refused(self, page_key_: bytes) -> None:
        assert self.tiers.disk is not None
        self.tiers.disk.discard(page_key_)
        self.disk_refused += 1

    def _attach_pages(self, session: Session, key: PrefixKey, path: list[PageNode], pages: list[KvPage]) -> list[int]:
        """Set `pages` (those of `path`, then any read from disk) into the session's stream."""
        n = self._rows_of(key, len(pages))
        if not n:
            return []
        self.rows.attach(session.seq, pages, n)
        return self._attached(session, key, path, n)

    def _attached(self, session: Session, key: PrefixKey, path: list[PageNode], n: int) -> list[int]:
        self._lock(session, path)
        if path:
            self.chains[path[-1].chain_id].hits += 1
        self.tree.hit(path)
        self._hit_tokens += n
        return list(key.tokens[:n])

    def gains_from_waiting(self, shared: int, cached: int) -> bool:
        """At least one more whole page to attach (for a sliding-window model, once the running
        prefill keeps a window at one of its marks in between)."""
        return shared >= cached + 2 * self.page_rows

    def checkpoint_at(self, session: Session, tokens: list[int], matched: int, mark: int) -> int:
        """For a sliding-window model: the page boundary at or before `mark`, where `insert` keeps the
        window's rows with the pages, unless the cache can already restore that prefix."""
        if not self.rows.n_swa:
            return 0
        stop = mark // self.page_rows * self.page_rows
        if not matched < stop < len(tokens):
            return 0
        return 0 if self.match_len(PrefixKey(session.namespace, tokens[: stop + 1])) == stop else stop

    # -- donation -----------------------------------------------------------------------------------

    def insert(self, session: Session, tokens: list[int], preview: str = "",
               kind: MarkKind = MarkKind.CONVERSATION, at: InsertAt = InsertAt.EVALUATED) -> Chain | None:
        """Donate every full page of `tokens`, the session's evaluated history (or a prefix of it),
        under the session's namespace.

        Pages already cached are not stored twice: only the rows of the new pages are copied out of
        the stream. The donated pages stay locked while the session lives. Every page goes least
        recently used first, whatever its `kind`. Pages that do not fit the budget are not kept.
        Where pages after those in host memory are on disk, the pages after them go to disk only
        while a long prompt is evaluated (`at` PREFILL) and as the session ends, never as a prompt is
        just evaluated (a prompt attached from disk pays no copy of its rows before its first token);
        as it ends, the run is left to read into host memory while the engine idles (`_promote`,
        `settle`).
        """
        if session.tokens[: len(tokens)] != tuple(tokens):
            raise ValueError("insert takes tokens the session has evaluated, in order")
        chain = self._donate(session, tokens, preview, at)
        if self.rows.n_swa and len(tokens) == session.n_past and len(tokens) % self.page_rows == 0:
            self._keep_window(session, len(tokens))
        return chain

    def _donate(self, session: Session, tokens: list[int], preview: str, at: InsertAt) -> Chain | None:
        n_pages = len(tokens) // self.page_rows
        key = PrefixKey(session.namespace, tokens)
        path = self.tree.match(key, n_pages)
        self._lock(session, path)  # keep them while storing new pages evicts
        for node in path:
            self.store.touch(node)
        on_disk = [] if self.rows.n_swa else self._disk_run(key, path, n_pages)
        if on_disk:
            if at is not InsertAt.EVALUATED:
                start = len(path) + len(on_disk)
                tail = self.rows.donate(session.seq, self.page_rows, start, n_pages - start) if start < n_pages else []
                self._write_unkept(session.namespace, on_disk[-1], tokens, tail)
                if at is InsertAt.ENDING:
                    self._promote(preview, key, len(path), on_disk, tail)
            return None
        if len(path) == n_pages:
            if at is InsertAt.ENDING:
                self._write_run(path, tokens)
            return None
        pages = self.rows.donate(session.seq, self.page_rows, len(path), n_pages - len(path))
        chain, added = self._add_chain(session, key, path, pages, preview)
        last = (path + added)[-1] if path or added else self.tree.root(session.namespace)
        self._write_unkept(session.namespace, last.key, tokens, pages[len(added):])
        if at is InsertAt.ENDING and len(added) == len(pages):
            self._write_run(path + added, tokens)
        return chain if added else None

    def _write_run(self, nodes: list[PageNode], tokens: list[int]) -> None:
        """As a session ends, where a run store takes runs this long: the whole chain of `nodes` (pages
        0.. of `tokens`, all in host memory) as one run, unless it is there already. Built and written
        on the store's writer thread, from the pages as they are now."""
        runs = self.tiers.runs
        if (runs is None or self.rows.n_swa or not nodes or len(nodes) * self.page_rows < runs.min_tokens
                or self._run_for(nodes[-1].key, len(nodes)) is not None):
            return
        nbytes, parts = self.rows.run_file([self.store.peek(node) for node in nodes], tokens)
        runs.put([node.key for node in nodes], self.rows.run_layout(), nbytes, lambda: parts)

    def _keep_window(self, session: Session, n: int) -> None:
        """Make the pages before `n`, where the session stands, hold the window's rows for position
        `n` (read alone from the stream) unless they do, or the budget cannot take them."""
        path = self.tree.match(PrefixKey(session.namespace, list(session.tokens)), n // self.page_rows)  # `insert` locked it
        pages = [self.store.peek(node) for node in path]
        if len(path) * self.page_rows != n or self.rows.restorable(pages, n):
            return
        first, window = self.rows.read_window(session.seq)
        filled = self.rows.with_window(pages, first, window)
        if not self.store.fits(sum(new.nbytes - old.nbytes for old, new in zip(pages, filled))):
            return
        for node, old, new in zip(path, pages, filled):
            if new is not old:
                self.store.replace(node, new)
                self._write_behind(node, new, replace=True)
        self.windows_filled += 1

    def _read_disk(self, session: Session, key: PrefixKey, path: list[PageNode],
                   keys: list[bytes]) -> tuple[list[PageNode], list[KvPage]]:
        """Read the pages of `keys` (the run after `path`) from disk, until one is missing or refused:
        the nodes of those the tree and the host store took (locked for the session), then the pages
        after them that host memory could not take (attached all the same; they stay on disk)."""
        pages: list[KvPage] = []
        self._read_run(keys, len(path), pages)
        if not pages:
            return [], []
        _, added = self._add_chain(session, key, path, pages, "(from disk)", write=False)
        return added, pages[len(added):]

    def _promote(self, preview: str, key: PrefixKey, first: int, keys: list[bytes], tail: list[KvPage]) -> None:
        """Have `settle` read the run of `keys` (page `first` on of `key`) into host memory while the
        engine idles, no more than the host budget, and store them, then `tail`. A run already
        waiting is not read twice."""
        if any(job.keys[0] == keys[0] for job in self._promotions):
            return
        if len(self._promotions) >= MAX_PROMOTIONS:  # a server never idle: the oldest run stays on disk
            self._promotions.pop(0)
        self._promotions.append(_Promotion(preview[:80], key, first, keys, tail))

    def _read_run(self, keys: list[bytes], first: int, pages: list[KvPage], budget: float = math.inf,
                  deadline: float = math.inf) -> bool:
        """Read the pages of `keys` (page `first` on) that follow `pages` into `pages`, each checked
        against this context's layout, until `deadline`; whether the run is read: whole, or ended by
        a page missing, refused (and removed) or past `budget` bytes in all (those after it stay on
        disk only: their recency, which a restart reads, is set here, for the attach read them
        untouched)."""
        nbytes = sum(page.nbytes for page in pages)
        while (i := len(pages)) < len(keys):
            if time.perf_counter() >= deadline:
                return False
            data = self._read_file(keys[i])
            if data is None:
                return True
            try:
                page = self.rows.page_from_bytes(data, (first + i) * self.page_rows, self.page_rows)
            except StateFormatError:
                self._refused(keys[i])
                return True
            nbytes += page.nbytes
            if nbytes > budget:
                assert self.tiers.disk is not None
                self.tiers.disk.touch(keys[i:])
                return True
            pages.append(page)
        return True

    def pending(self) -> bool:
        """Runs wait to be read from disk into host memory, or the blob's buffer is still being
        mapped: the engine's idle work does them rather than timing ubatches beside them (on 2 cores
        each slows the other, and a restarted server's first restore wants that buffer)."""
        return bool(self._promotions) or (self.rows.reserving is not None and not self.rows.reserving.done())

    def settle(self, timeout: float | None = 0) -> None:
        """Up to `timeout` seconds (None: until done) of reading the runs waiting, on this thread (the
        engine's, while it idles: a reading thread beside a step's decode made the decode of the
        request after a restart at 8,192 tokens take 254 ms instead of 85); each run, once read, is
        stored under the pages before it, as if donated, then its tail. With none, wait up to
        `timeout` for the blob's buffer being mapped."""
        if not self._promotions:
            if self.rows.reserving is not None:
                wait([self.rows.reserving], timeout)
            return
        deadline = math.inf if timeout is None else time.perf_counter() + timeout
        while self._promotions and time.perf_counter() < deadline:
            job = self._promotions[0]
            if self._read_run(job.keys, job.first, job.pages, self.store.budget_bytes, deadline):
                self._promotions.pop(0)
                self._store_promoted(job, job.pages + (job.tail if len(job.pages) == len(job.keys) else []))

    def _store_promoted(self, job: _Promotion, pages: list[KvPage]) -> None:
        """Store `pages` (page `job.first` on) under the tree's path before them, those not there yet;
        nothing if that path is shorter now (its pages left host memory meanwhile). Where the whole
        chain is then in host memory, it is written as a run, as a session ending with it would: a
        kill before the cold request's run was written leaves only page files, and without this every
        restart after it would read those (16,384 tokens of the 1.5B: 0.42-0.99 s against 0.36 s)."""
        n_pages = job.first + len(pages)
        path = self.tree.match(job.key, n_pages)
        if len(path) < job.first:
            return
        owner = object()  # locks the path while storing evicts, as a session's would
        self._lock(owner, path)
        try:
            if len(path) < n_pages:
                _, added = self._add_chain(owner, job.key, path, pages[len(path) - job.first:], job.preview,
                                           write=False)
                path = path + added
            if len(path) == n_pages:
                self._write_run(path, list(job.key.tokens))
        finally:
            self._unlock(owner)

    def _add_chain(self, owner: object, key: PrefixKey, path: list[PageNode], pages: list[KvPage], preview: str,
                   write: bool = True) -> tuple[Chain, list[PageNode]]:
        """Store `pages` after `path` (pages of `key`) as a new chain, locked for `owner`, until one
        does not fit; the chain is kept where a page was stored. The chain and the nodes stored."""
        chain = Chain(id=self._next_chain, path=list(path), preview=preview[:80], namespace=key.namespace)
        added = self._add_pages(owner, list(key.tokens), chain, pages, write)
        if added:
            self._next_chain += 1
            self.chains[chain.id] = chain
            chain.path = path + added
        return chain, added

    def _add_pages(self, owner: object, tokens: list[int], chain: Chain, pages: list[KvPage],
                   write: bool = True) -> list[PageNode]:
        """Store `pages` under the end of `chain.path`, locked for `owner` (a session), until one does not fit."""
        parent = chain.path[-1] if chain.path else self.tree.root(chain.namespace)
        added: list[PageNode] = []
        for page in pages:
            tokens_of_page = tuple(tokens[page.start : page.end])
            if not self.store.fits(page.nbytes):
                break
            node = self.tree.add_child(parent, tokens_of_page, chain.id)
            if not self.store.put(node, page, lock=True):
                self.tree.remove_leaf(node)
                break
            if not parent.is_root:
                self.store.lock(parent)  # a parent goes only after its children
            self._locks.setdefault(owner, []).append(node)
            added.append(node)
            if write:
                self._write_behind(node, page)
            parent = node
        if self.tiers.events is not None:
            self.tiers.events.stored(added)
        runs = self.tiers.runs
        if runs is not None and self.store.bytes_used + runs.staged_bytes > self.store.budget_bytes:
            runs.drop_staged()  # host memory's budget holds pages first
        return added

    def _write_unkept(self, namespace: str, parent: bytes, tokens: list[int], pages: list[KvPage]) -> None:
        """Queue for the disk the pages after the page keyed `parent` that host memory could not take:
        every page donated reaches the disk, whatever the host budget."""
        disk = self.tiers.disk
        if disk is None or not pages:
            return
        seed, key = self.tree.root(namespace).key, parent
        for page in pages:
            page_tokens = tuple(tokens[page.start : page.end])
            child = page_key(key, page_tokens)
            disk.put(child, key, seed, page_tokens, lambda page=page: self.rows.page_bytes(page),
                     tag=self._tag(namespace), nbytes=page.nbytes)
            key = child

    def _write_behind(self, node: PageNode, page: KvPage, replace: bool = False) -> None:
        """Queue `node`'s page for the disk (serialized on the disk's writer thread); host memory holds
        it, so the queue does not count it until it leaves (`_left_host`)."""
        disk = self.tiers.disk
        if disk is None or node.parent is None:
            return
        seed = self.tree.root(node.namespace).key
        disk.put(node.key, node.parent.key, seed, node.tokens, lambda: self.rows.page_bytes(page),
                 tag=self._tag(node.namespace), replace=replace, nbytes=page.nbytes, held=True)  # till `_left_host`

    def _tag(self, namespace: str) -> str:
        return page_tag(self.tiers.tag, self.tiers.lora_of(namespace))

    # -- locks ----------------------------------------------------------------------------------------

    def _lock(self, owner: object, nodes: list[PageNode]) -> None:
        for node in nodes:
            self.store.lock(node)
        self._locks.setdefault(owner, []).extend(nodes)

    def unlock(self, session: Session) -> None:
        self._unlock(session)

    def _unlock(self, owner: object) -> None:
        for node in self._locks.pop(owner, []):
            if node.alive:
                self.store.unlock(node)

    # -- eviction -------------------------------------------------------------------------------------

    def _evicted(self, node: PageNode) -> None:
        """The store evicted `node`'s page (an unlocked leaf's): drop the node, free its parent."""
        self._left_host(node)
        self._drop(node)
        self._evicted_pages += 1
        if self.tiers.events is not None:
            self.tiers.events.removed([node.key])

    def _drop(self, node: PageNode) -> None:
        self.tree.remove_leaf(node)
        parent = node.parent
        if parent.is_root or parent.chain_id != node.chain_id:
            self.chains.pop(node.chain_id, None)  # tail-first: that was the chain's last page of its own
        if not parent.is_root:
            self.store.unlock(parent)

    def _left_host(self, node: PageNode) -> None:
        """`node`'s page left host memory: a write of it still queued is now the queue's to keep."""
        if self.tiers.disk is not None:
            self.tiers.disk.release(node.key)

    def rebind(self, ctx: Context) -> bool:
        if any(self._locks.values()):
            raise RuntimeError("sessions still read cached pages: end them first")
        if row_format(ctx, self.page_rows).digest() != self.tree.rows:
            return False
        self.ctx = self.rows.ctx = ctx
        return True

    def release(self) -> None:
        """Drop every page; no session may still hold one."""
        if any(self._locks.values()):
            raise RuntimeError("sessions still read cached pages: end them first")
        self._promotions = []  # their pages stay on disk
        nodes = self.tree.leaves_first()
        for node in nodes:
            self.store.discard(node)
            self._left_host(node)
            self._drop(node)
        if self.tiers.events is not None:
            if self.tiers.disk is None:
                self.tiers.events.cleared()
            else:
                self.tiers.events.removed([node.key for node in nodes])

    # -- what metrics and dashboards read -------------------------------------------------------------

    def namespaces(self) -> set[str]:
        return set(self.tree.roots)

    def stats(self) -> CacheStats:
        return CacheStats(queried_tokens=self._queried_tokens, hit_tokens=self._hit_tokens,
                          evicted_pages=self._evicted_pages, held_pages=self.held_pages,
                          held_bytes=self.store.bytes_used, locked_entries=self._locked())

    def _locked(self) -> int:
        """Pages a live session reads (a parent locked only by its children is not counted)."""
        return len({node for nodes in self._locks.values() for node in nodes})

    def _window_bytes(self, nodes: list[PageNode]) -> int:
        """Of the pages of `nodes`, the bytes of sliding-window rows (0 for a model without a window)."""
        if not self.rows.n_swa:
            return 0
        return sum(page.tables[1].nbytes for node in nodes if (page := self.store.peek(node)) is not None)

    def view(self, namespace: str) -> dict:
        """The chains of `namespace` and the pages and bytes they hold; the budget is everyone's."""
        nodes = self.tree.leaves_first(namespace)
        return {"enabled": True, "held_pages": len(nodes),
                "held_bytes": sum(map(self.store.size, nodes)),
                "budget_bytes": self.store.budget_bytes, "window_bytes": self._window_bytes(nodes),
                "chains": [chain.snapshot(self.page_rows, self.store) for chain in self.chains.values()
                           if chain.namespace == namespace]}

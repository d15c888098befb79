"""The page cache: finished sessions donate whole pages, new sessions attach them without recompute.

Attaching is `llama_memory_seq_cp` in a unified KV cache: the session's id joins the cells' seq
sets, so nothing is copied. Matches are page-granular and stop one token short of the prompt,
because the model needs at least one evaluated token to produce the next logits.

Invariant (checked by tests through llama.cpp's own positions): the cells under the holders'
sequence ids are exactly `held_pages * page_rows`.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Callable

from kvserve.cache.cache_stats import CacheStats
from kvserve.cache.chat_marks import MarkKind
from kvserve.cache.kv_pool import SeqIds, Session
from kvserve.cache.page_tree import Holder, PageNode, PageTree, evictable, eviction_key, tick
from kvserve.cache.prefix_cache import PrefixCache
from kvserve.llama.context import Context


def cold_cap(max_cells: int) -> int:
    """The cells pages nobody has reused may fill of a `max_cells` cache: a quarter, room for every
    running conversation's newest turn until its next one, too little for one-off prompts to
    stretch every step's attention."""
    return max_cells // 4


@dataclass(eq=False)
class Chain:
    """One donation: the path of pages it covered, as a dashboard sees it."""

    id: int
    path: list[PageNode]
    preview: str
    hits: int = 0

    def snapshot(self, page_rows: int) -> dict:
        return {
            "id": self.id,
            "tokens": len(self.path) * page_rows,
            "pages_alive": sum(node.alive for node in self.path),
            "hits": self.hits,
            "preview": self.preview,
        }


class PageCache(PrefixCache):
    """Pages of donated prefixes. Held cells are not free: every token evaluated in a unified cache
    pays for each cell in the used extent, masked or not (all of attention without flash attention, a
    mask check per row, head and layer with it), so `max_cells` bounds what the cache costs running
    sequences. Most donations are never reused: pages no attach has hit yet (cold) may fill only
    `max_cold_cells` of it and go first; past either cap, least recently used pages go first."""

    keeps = "pages"
    donates_prompt = True

    def __init__(self, ctx: Context, ids: SeqIds, page_rows: int, max_cells: int | None = None,
                 max_cold_cells: int | None = None) -> None:
        if ctx.model.info.carries_state:
            raise ValueError("KV pages cannot restore a recurrent state; this model needs checkpoints")
        if page_rows < 1:
            raise ValueError("page_rows must be >= 1")
        self.ctx = ctx
        self.ids = ids
        self.page_rows = page_rows
        self.tree = PageTree(page_rows)
        self.chains: dict[int, Chain] = {}
        self.max_cells = ctx.n_ctx if max_cells is None else max_cells
        self.max_cold_cells = cold_cap(self.max_cells) if max_cold_cells is None else max_cold_cells
        self._locks: dict[Session, list[PageNode]] = {}
        self._queried_tokens = 0
        self._hit_tokens = 0
        self._evicted_pages = 0
        self._next_chain = 1

    @property
    def held_pages(self) -> int:
        return self.tree.n_nodes

    @property
    def held_cells(self) -> int:
        return self.tree.n_nodes * self.page_rows

    # -- lookup -------------------------------------------------------------------------------------

    def _cap(self, tokens: list[int]) -> int:
        """At most this many pages may attach: one token of the prompt must stay to be evaluated."""
        return max(len(tokens) - 1, 0) // self.page_rows

    def match_len(self, tokens: list[int]) -> int:
        """Tokens `attach` would attach right now. Changes no hit count and no recency."""
        return len(self.tree.match(tokens, self._cap(tokens))) * self.page_rows

    def attach(self, session: Session, tokens: list[int]) -> int:
        """Share the longest cached run of whole pages of `tokens` with an empty session."""
        if session.tokens:
            raise ValueError("attach needs an empty session")
        path = self.tree.match(tokens, self._cap(tokens))
        self._queried_tokens += len(tokens)
        if not path:
            return 0
        self._copy_pages(path, session.seq)
        self._lock(session, path)
        n = len(path) * self.page_rows
        session.tokens = list(tokens[:n])
        session.shared = n
        self.chains[path[-1].chain_id].hits += 1
        self.tree.hit(path)
        self._hit_tokens += n
        return n

    def gains_from_waiting(self, shared: int, cached: int) -> bool:
        return shared >= cached + 2 * self.page_rows  # at least one more whole page to attach

    # -- donation -----------------------------------------------------------------------------------

    def insert(self, session: Session, tokens: list[int], preview: str = "",
               kind: MarkKind = MarkKind.CONVERSATION) -> Chain | None:
        """Donate every full page of `tokens`, the session's evaluated history (or a prefix of it).

        Pages already cached are not stored twice; where the session computed them itself, it
        switches to the cached cells. The donated pages stay locked while the session lives. Every
        page goes least recently used first, whatever its `kind`.
        """
        if session.tokens[: len(tokens)] != list(tokens):
            raise ValueError("insert takes tokens the session has evaluated, in order")
        if session.shared % self.page_rows:
            raise ValueError("a forked session cannot donate: its prefix belongs to its sibling")
        n_pages = len(tokens) // self.page_rows
        path = self.tree.match(tokens, n_pages)
        self._lock(session, path)  # keep them while taking a holder's id may evict
        chain: Chain | None = None
        n_cached = len(path)
        if n_cached < n_pages:
            chain = self._new_chain(preview)
            path += self._add_pages(session, tokens, path, n_pages, chain)
            chain.path = path
        self._share_duplicates(session, path, n_cached)
        self._evict_past_caps()
        return chain if chain is None or chain.id in self.chains else None

    def _new_chain(self, preview: str) -> Chain:
        chain = Chain(id=self._next_chain, path=[], preview=preview[:80])
        self._next_chain += 1
        self.chains[chain.id] = chain
        return chain

    def _add_pages(
        self, session: Session, tokens: list[int], path: list[PageNode], n_pages: int, chain: Chain
    ) -> list[PageNode]:
        holder = Holder(seq=self.ids.take(self.free_a_seq_id))
        start = len(path) * self.page_rows
        self.ctx.seq_cp(session.seq, holder.seq, start, n_pages * self.page_rows)
        parent = path[-1] if path else self.tree.root
        added = []
        for key in list(self.tree.pages_of(tokens, n_pages))[len(path) :]:
            parent = self.tree.add_child(parent, key, holder, chain.id)
            added.append(parent)
        self._lock(session, added)
        return added

    def _share_duplicates(self, session: Session, path: list[PageNode], n_cached: int) -> None:
        """Swap the session's own copies of already-cached pages for the cached cells, so none is held twice."""
        duplicates = path[session.shared // self.page_rows : n_cached]
        if duplicates:
            p0 = duplicates[0].depth * self.page_rows
            p1 = (duplicates[-1].depth + 1) * self.page_rows
            self.ctx.seq_rm(session.seq, p0, p1)
            self._copy_pages(duplicates, session.seq)
        session.shared = max(session.shared, len(path) * self.page_rows)

    # -- locks ----------------------------------------------------------------------------------------

    def _lock(self, session: Session, nodes: list[PageNode]) -> None:
        now = tick()
        for node in nodes:
            node.lock_ref += 1
            node.last_access = now
        self._locks.setdefault(session, []).extend(nodes)

    def unlock(self, session: Session) -> None:
        for node in self._locks.pop(session, []):
            node.lock_ref -= 1

    # -- eviction -------------------------------------------------------------------------------------

    def evict(self, cells: int) -> int:
        """Give back the pages covering `cells`: unlocked leaves, cold first, least recently used first."""
        n_pages = -(-cells // self.page_rows)
        return self._evict_lru(lambda evicted: evicted >= n_pages) * self.page_rows

    def _evict_past_caps(self) -> None:
        """Down to `max_cold_cells` of cold pages, then to `max_cells` in all, as far as locks allow."""
        cold_pages = self.tree.n_cold - self.max_cold_cells // self.page_rows
        if cold_pages > 0:
            self._evict_lru(lambda evicted: evicted >= cold_pages, cold_only=True)
        excess = self.held_cells - self.max_cells
        if excess > 0:
            self.evict(excess)

    def free_a_seq_id(self) -> None:
        """Evict pages, LRU tail first, until one holder's sequence id is free again."""
        ids_before = self.ids.free
        self._evict_lru(lambda _: self.ids.free > ids_before)

    def _evict_lru(self, done: Callable[[int], bool], cold_only: bool = False) -> int:
        heap = self.tree.evictable_leaves(cold_only)
        evicted = 0
        while heap and not done(evicted):
            node = heapq.heappop(heap)[-1]
            parent = self._evict(node)
            evicted += 1
            if parent is not None and evictable(parent, cold_only):
                heapq.heappush(heap, eviction_key(parent))
        return evicted

    def _evict(self, node: PageNode) -> PageNode | None:
        holder = node.holder
        p0 = node.depth * self.page_rows
        self.ctx.seq_rm(holder.seq, p0, p0 + self.page_rows)
        self.tree.remove_leaf(node)
        self._evicted_pages += 1
        parent = node.parent
        if parent is self.tree.root or parent.chain_id != node.chain_id:
            del self.chains[node.chain_id]  # tail-first: that was the chain's last page of its own
        if holder.n_nodes == 0:
            self.ctx.seq_rm(holder.seq)
            self.ids.give_back(holder.seq)
        return parent if parent is not self.tree.root else None

    def release(self) -> None:
        if any(self._locks.values()):
            raise RuntimeError("sessions still read cached pages: end them first")
        self.evict(self.held_cells)

    # -- copying ------------------------------------------------------------------------------------

    def _copy_pages(self, nodes: list[PageNode], dst: int) -> None:
        """seq_cp each run of consecutive pages that one holder owns, in one call."""
        run_start = 0
        for i in range(1, len(nodes) + 1):
            if i == len(nodes) or nodes[i].holder is not nodes[run_start].holder:
                p0 = nodes[run_start].depth * self.page_rows
                p1 = (nodes[i - 1].depth + 1) * self.page_rows
                self.ctx.seq_cp(nodes[run_start].holder.seq, dst, p0, p1)
                run_start = i

    # -- what metrics and dashboards read -------------------------------------------------------------

    def stats(self) -> CacheStats:
        return CacheStats(queried_tokens=self._queried_tokens, hit_tokens=self._hit_tokens,
                          evicted_pages=self._evicted_pages, held_pages=self.held_pages)

    def view(self) -> dict:
        return {"enabled": True, "held_pages": self.held_pages,
                "chains": [chain.snapshot(self.page_rows) for chain in self.chains.values()]}

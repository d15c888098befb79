"""The page cache: finished sessions donate whole pages, new sessions attach them without recompute.

A page's rows live in host memory, saved from the donor's stream (`llama_state_seq_get_data`);
attach sets the matched rows into the new session's empty stream, then only the tail is
evaluated. Matches are page-granular and stop one token short of the prompt, because the model
needs at least one evaluated token to produce the next logits.

Invariants:
- the saved bytes never exceed `budget_bytes`, not even between a save and an eviction: room is
  made before rows are saved, and a donation that cannot fit saves nothing;
- a session that attached rows has exactly the matched positions `0 .. n-1` in its stream.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Callable

from kvserve.cache.cache_stats import CacheStats
from kvserve.cache.chat_marks import MarkKind
from kvserve.cache.kv_pool import Session
from kvserve.cache.page_tree import Holder, PageNode, PageTree, evictable, eviction_key, tick
from kvserve.cache.prefix_cache import PrefixCache
from kvserve.llama.context import Context


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
    """Pages of donated prefixes in host memory, within `budget_bytes`. Most donations are never
    reused: pages no attach has hit yet (cold) go first, then the least recently used."""

    keeps = "pages"
    donates_prompt = True

    def __init__(self, ctx: Context, page_rows: int, budget_bytes: int) -> None:
        if ctx.model.info.carries_state:
            raise ValueError("KV pages cannot restore a recurrent state; this model needs checkpoints")
        if ctx.n_swa:
            raise ValueError("a sliding-window stream keeps only its last window: its pages cannot be cut")
        if page_rows < 1:
            raise ValueError("page_rows must be >= 1")
        self.ctx = ctx
        self.page_rows = page_rows
        self.tree = PageTree(page_rows)
        self.chains: dict[int, Chain] = {}
        self.budget_bytes = budget_bytes
        self.bytes_used = 0
        self._locks: dict[Session, list[PageNode]] = {}
        self._queried_tokens = 0
        self._hit_tokens = 0
        self._evicted_pages = 0
        self._next_chain = 1

    @property
    def held_pages(self) -> int:
        return self.tree.n_nodes

    @property
    def held_tokens(self) -> int:
        return self.tree.n_nodes * self.page_rows

    def caps(self) -> dict:
        return {"prefix_cache_bytes": self.budget_bytes}

    # -- lookup -------------------------------------------------------------------------------------

    def _cap(self, tokens: list[int]) -> int:
        """At most this many pages may attach: one token of the prompt must stay to be evaluated."""
        return max(len(tokens) - 1, 0) // self.page_rows

    def match_len(self, tokens: list[int]) -> int:
        """Tokens `attach` would attach right now. Changes no hit count and no recency."""
        return len(self.tree.match(tokens, self._cap(tokens))) * self.page_rows

    def attach(self, session: Session, tokens: list[int]) -> int:
        """Set the longest cached run of whole pages of `tokens` into an empty session's stream."""
        if session.tokens:
            raise ValueError("attach needs an empty session")
        path = self.tree.match(tokens, self._cap(tokens))
        self._queried_tokens += len(tokens)
        if not path:
            return 0
        n = len(path) * self.page_rows
        self._restore(path, session.seq, n)
        self._lock(session, path)
        session.tokens = list(tokens[:n])
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

        Pages already cached are not stored twice. The donated pages stay locked while the session
        lives. Every page goes least recently used first, whatever its `kind`. Nothing new is kept
        when its rows do not fit the budget.
        """
        if session.tokens[: len(tokens)] != list(tokens):
            raise ValueError("insert takes tokens the session has evaluated, in order")
        n_pages = len(tokens) // self.page_rows
        path = self.tree.match(tokens, n_pages)
        self._lock(session, path)  # keep them while making room evicts
        if len(path) == n_pages:
            return None
        holder = self._save(session)
        if holder is None:
            return None
        chain = self._new_chain(preview)
        chain.path = path + self._add_pages(session, tokens, path, n_pages, chain, holder)
        return chain

    def _new_chain(self, preview: str) -> Chain:
        chain = Chain(id=self._next_chain, path=[], preview=preview[:80])
        self._next_chain += 1
        self.chains[chain.id] = chain
        return chain

    def _add_pages(self, session: Session, tokens: list[int], path: list[PageNode], n_pages: int, chain: Chain,
                   holder: Holder) -> list[PageNode]:
        parent = path[-1] if path else self.tree.root
        added = []
        for key in list(self.tree.pages_of(tokens, n_pages))[len(path) :]:
            parent = self.tree.add_child(parent, key, holder, chain.id)
            added.append(parent)
        self._lock(session, added)
        return added

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

    # -- host memory ----------------------------------------------------------------------------------

    def _save(self, session: Session) -> Holder | None:
        """The session's rows, saved once room is made for them; None when they cannot fit."""
        size = self.ctx.state_size(session.seq)
        if not self._make_room(size):
            return None
        holder = Holder(blob=self.ctx.save_state(session.seq), n_tokens=session.n_past)
        self.bytes_used += len(holder.blob)
        return holder

    def _restore(self, path: list[PageNode], seq: int, n: int) -> None:
        """Positions [0, n) of `path` into `seq`'s empty stream: its last page's donation holds them all."""
        holder = path[-1].holder
        self.ctx.load_state(seq, holder.blob)
        if holder.n_tokens > n:
            self.ctx.seq_rm(seq, n, -1)

    # -- eviction -------------------------------------------------------------------------------------

    def _make_room(self, size: int) -> bool:
        if size > self.budget_bytes:
            return False
        self._evict_lru(lambda _: self.bytes_used + size <= self.budget_bytes)
        return self.bytes_used + size <= self.budget_bytes

    def evict_pages(self, n_pages: int) -> int:
        """Give back up to `n_pages` unlocked pages, cold first, least recently used first."""
        return self._evict_lru(lambda evicted: evicted >= n_pages)

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
        self.tree.remove_leaf(node)
        self._evicted_pages += 1
        parent = node.parent
        if parent is self.tree.root or parent.chain_id != node.chain_id:
            del self.chains[node.chain_id]  # tail-first: that was the chain's last page of its own
        if holder.n_nodes == 0:
            self.bytes_used -= len(holder.blob)
            holder.blob = b""
        return parent if parent is not self.tree.root else None

    def release(self) -> None:
        if any(self._locks.values()):
            raise RuntimeError("sessions still read cached pages: end them first")
        self.evict_pages(self.held_pages)

    # -- what metrics and dashboards read -------------------------------------------------------------

    def stats(self) -> CacheStats:
        return CacheStats(queried_tokens=self._queried_tokens, hit_tokens=self._hit_tokens,
                          evicted_pages=self._evicted_pages, held_pages=self.held_pages, held_bytes=self.bytes_used)

    def view(self) -> dict:
        return {"enabled": True, "held_pages": self.held_pages, "held_bytes": self.bytes_used,
                "budget_bytes": self.budget_bytes,
                "chains": [chain.snapshot(self.page_rows) for chain in self.chains.values()]}

"""A radix tree of KV pages: each node is one full page of `page_rows` tokens under its parent's prefix.

Invariants:
- a node's page covers positions [depth*page_rows, (depth+1)*page_rows) of every prompt that reaches it;
- a node's rows are kept by exactly one holder; a page shared by many donations is one node;
- `lock_ref` counts live sessions reading the page; a locked node and its ancestors are never evicted;
- eviction takes unlocked leaves, never-attached (cold) before attached (hot), least recently used
  first within each, so chains shrink from the tail;
- a hot node's ancestors are hot (they were attached with it), so cold nodes hang below hot ones
  and every cold node can go without touching a hot one.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field
from typing import Iterator

_clock = itertools.count(1)


def tick() -> int:
    """A monotonic logical time for recency (cheaper and steadier than wall-clock time)."""
    return next(_clock)


@dataclass(eq=False)
class Holder:
    """The saved rows of positions [0, n_tokens) of one donation (host memory); it lives while any
    node still keeps a page in it."""

    blob: bytes
    n_tokens: int
    n_nodes: int = 0


@dataclass(eq=False)
class PageNode:
    key: tuple[int, ...]
    parent: "PageNode | None"
    depth: int
    holder: Holder | None = None
    chain_id: int = 0  # the donation that created this page
    children: dict[tuple[int, ...], "PageNode"] = field(default_factory=dict)
    lock_ref: int = 0
    last_access: int = 0
    hits: int = 0  # attaches that reused this page
    alive: bool = True

    @property
    def is_leaf(self) -> bool:
        return not self.children


def evictable(node: PageNode, cold_only: bool = False) -> bool:
    """An unlocked leaf (a cold one, if `cold_only`)."""
    return node.is_leaf and node.lock_ref == 0 and not (cold_only and node.hits)


def eviction_key(node: PageNode) -> tuple[bool, int, int, PageNode]:
    """Cold before hot, then least recently used first."""
    return node.hits > 0, node.last_access, id(node), node


class PageTree:
    def __init__(self, page_rows: int) -> None:
        self.page_rows = page_rows
        self.root = PageNode(key=(), parent=None, depth=-1)
        self.n_nodes = 0
        self.n_cold = 0  # nodes no attach has hit

    def pages_of(self, tokens: list[int], n_pages: int) -> Iterator[tuple[int, ...]]:
        rows = self.page_rows
        for i in range(n_pages):
            yield tuple(tokens[i * rows : (i + 1) * rows])

    def match(self, tokens: list[int], max_pages: int | None = None) -> list[PageNode]:
        """The longest path of whole pages that `tokens` starts with. Touches nothing."""
        n_pages = len(tokens) // self.page_rows
        if max_pages is not None:
            n_pages = min(n_pages, max_pages)
        path: list[PageNode] = []
        node = self.root
        for key in self.pages_of(tokens, n_pages):
            node = node.children.get(key)
            if node is None:
                break
            path.append(node)
        return path

    def add_child(self, parent: PageNode, key: tuple[int, ...], holder: Holder, chain_id: int) -> PageNode:
        node = PageNode(key=key, parent=parent, depth=parent.depth + 1, holder=holder, chain_id=chain_id)
        node.last_access = tick()
        parent.children[key] = node
        holder.n_nodes += 1
        self.n_nodes += 1
        self.n_cold += 1
        return node

    def hit(self, path: list[PageNode]) -> None:
        for node in path:
            self.n_cold -= node.hits == 0
            node.hits += 1

    def remove_leaf(self, node: PageNode) -> None:
        assert node.is_leaf and node.lock_ref == 0 and node.parent is not None
        del node.parent.children[node.key]
        node.alive = False
        node.holder.n_nodes -= 1
        self.n_nodes -= 1
        self.n_cold -= node.hits == 0

    def evictable_leaves(self, cold_only: bool = False) -> list[tuple[bool, int, int, PageNode]]:
        """A heap of the unlocked leaves (only the cold ones, if asked) in `eviction_key` order."""
        heap = [eviction_key(n) for n in self._all_nodes() if evictable(n, cold_only)]
        heapq.heapify(heap)
        return heap

    def _all_nodes(self) -> Iterator[PageNode]:
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

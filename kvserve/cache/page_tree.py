"""A radix tree of KV pages: each node is one full page of `page_rows` tokens under its parent's prefix.

Invariants:
- a node's page covers positions [depth*page_rows, (depth+1)*page_rows) of every prompt that reaches it;
- a page shared by many donations is one node, whose rows are stored once (the host store keys
  them by node);
- a hot node's ancestors are hot (they were attached with it).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Iterator

_clock = itertools.count(1)


def tick() -> int:
    """A monotonic logical time for recency (cheaper and steadier than wall-clock time)."""
    return next(_clock)


@dataclass(eq=False)
class PageNode:
    key: tuple[int, ...]
    parent: "PageNode | None"
    depth: int
    chain_id: int = 0  # the donation that created this page
    children: dict[tuple[int, ...], "PageNode"] = field(default_factory=dict)
    hits: int = 0  # attaches that reused this page
    alive: bool = True

    @property
    def is_leaf(self) -> bool:
        return not self.children


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

    def continuation(self, tokens: list[int], k: int) -> list[int]:
        """Up to `k` tokens that followed `tokens` in a donated sequence: the rest of the page that
        `tokens` ends inside, then whole pages, taking the most reused child where donations went
        different ways. Empty when no page holds `tokens`' partial last page. Touches nothing."""
        rows = self.page_rows
        path = self.match(tokens)
        node = path[-1] if path else self.root
        if len(path) < len(tokens) // rows:
            return []
        partial = tuple(tokens[len(path) * rows :])
        out: list[int] = []
        while len(out) < k:
            children = [c for key, c in node.children.items() if key[: len(partial)] == partial]
            if not children:
                break
            node = max(children, key=lambda c: c.hits)
            out.extend(node.key[len(partial) :])
            partial = ()
        return out[:k]

    def add_child(self, parent: PageNode, key: tuple[int, ...], chain_id: int) -> PageNode:
        node = PageNode(key=key, parent=parent, depth=parent.depth + 1, chain_id=chain_id)
        parent.children[key] = node
        self.n_nodes += 1
        self.n_cold += 1
        return node

    def hit(self, path: list[PageNode]) -> None:
        for node in path:
            self.n_cold -= node.hits == 0
            node.hits += 1

    def remove_leaf(self, node: PageNode) -> None:
        assert node.is_leaf and node.parent is not None
        del node.parent.children[node.key]
        node.alive = False
        self.n_nodes -= 1
        self.n_cold -= node.hits == 0

    def leaves_first(self) -> list[PageNode]:
        """Every node, each after all of its descendants."""
        order: list[PageNode] = []
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            order.append(node)
            stack.extend(node.children.values())
        return order[::-1]

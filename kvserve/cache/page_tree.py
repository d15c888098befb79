"""A radix forest of KV pages: a tree per namespace, each node one full page of `page_rows` tokens
under its parent's prefix.

Invariants:
- a namespace has a root exactly while it has pages, and a match starts at its key's namespace's
  root only: no path crosses namespaces;
- a node's page covers positions [depth*page_rows, (depth+1)*page_rows) of every prompt that reaches it;
- a page shared by many donations is one node, whose rows are stored once (the host store keys
  them by node);
- a hot node's ancestors are hot (they were attached with it);
- a node's `key` is `page_key(parent's key, its tokens)`, a root's the seed of its namespace under the
  tree's row format (kvserve/cache/page_key.py), and `by_key` finds every node by it.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Iterator

from kvserve.cache.page_key import namespace_seed, page_key
from kvserve.cache.prefix_key import PrefixKey

_clock = itertools.count(1)


def tick() -> int:
    """A monotonic logical time for recency (cheaper and steadier than wall-clock time)."""
    return next(_clock)


@dataclass(eq=False)
class PageNode:
    tokens: tuple[int, ...]
    parent: "PageNode | None"
    depth: int
    key: bytes = b""  # the page's name (page_key.py)
    namespace: str = ""
    chain_id: int = 0  # the donation that created this page
    children: dict[tuple[int, ...], "PageNode"] = field(default_factory=dict)
    hits: int = 0  # attaches that reused this page
    alive: bool = True

    @property
    def is_leaf(self) -> bool:
        return not self.children

    @property
    def is_root(self) -> bool:
        return self.parent is None


class PageTree:
    def __init__(self, page_rows: int, rows: bytes = b"") -> None:
        self.page_rows = page_rows
        self.rows = rows  # the digest of the row format (`RowFormat.digest`) that seeds every key
        self.roots: dict[str, PageNode] = {}  # by namespace
        self.by_key: dict[bytes, PageNode] = {}
        self.n_nodes = 0
        self.n_cold = 0  # nodes no attach has hit

    def root(self, namespace: str) -> PageNode:
        """The root of `namespace`'s tree (a new, empty one is kept once a page is added under it)."""
        return self.roots.get(namespace) or PageNode(tokens=(), parent=None, depth=-1, namespace=namespace,
                                                     key=namespace_seed(self.rows, namespace))

    def pages_of(self, tokens: list[int], n_pages: int) -> Iterator[tuple[int, ...]]:
        rows = self.page_rows
        for i in range(n_pages):
            yield tuple(tokens[i * rows : (i + 1) * rows])

    def match(self, key: PrefixKey, max_pages: int | None = None) -> list[PageNode]:
        """The longest path of whole pages under `key`'s namespace that its tokens start with. Touches nothing."""
        n_pages = len(key.tokens) // self.page_rows
        if max_pages is not None:
            n_pages = min(n_pages, max_pages)
        path: list[PageNode] = []
        node = self.roots.get(key.namespace)
        if node is None:
            return path
        for page in self.pages_of(key.tokens, n_pages):
            node = node.children.get(page)
            if node is None:
                break
            path.append(node)
        return path

    def continuation(self, key: PrefixKey, k: int) -> list[int]:
        """Up to `k` tokens that followed `key`'s tokens in a sequence donated under its namespace:
        the rest of the page the tokens end inside, then whole pages, taking the most reused child
        where donations went different ways. Empty when no page holds the tokens' partial last page.
        Touches nothing."""
        rows, tokens = self.page_rows, key.tokens
        path = self.match(key)
        node = path[-1] if path else self.roots.get(key.namespace)
        if node is None or len(path) < len(tokens) // rows:
            return []
        partial = tuple(tokens[len(path) * rows :])
        out: list[int] = []
        while len(out) < k:
            children = [c for tokens, c in node.children.items() if tokens[: len(partial)] == partial]
            if not children:
                break
            node = max(children, key=lambda c: c.hits)
            out.extend(node.tokens[len(partial) :])
            partial = ()
        return out[:k]

    def add_child(self, parent: PageNode, tokens: tuple[int, ...], chain_id: int) -> PageNode:
        node = PageNode(tokens=tokens, parent=parent, depth=parent.depth + 1, namespace=parent.namespace,
                        chain_id=chain_id, key=page_key(parent.key, tokens))
        if parent.is_root:
            self.roots.setdefault(parent.namespace, parent)
        parent.children[tokens] = node
        self.by_key[node.key] = node
        self.n_nodes += 1
        self.n_cold += 1
        return node

    def hit(self, path: list[PageNode]) -> None:
        for node in path:
            self.n_cold -= node.hits == 0
            node.hits += 1

    def remove_leaf(self, node: PageNode) -> None:
        assert node.is_leaf and node.parent is not None
        parent = node.parent
        del parent.children[node.tokens]
        del self.by_key[node.key]
        if parent.is_root and not parent.children:
            del self.roots[parent.namespace]
        node.alive = False
        self.n_nodes -= 1
        self.n_cold -= node.hits == 0

    def leaves_first(self, namespace: str | None = None) -> list[PageNode]:
        """Every node (of `namespace` only, if given), each after all of its descendants."""
        roots = self.roots.values() if namespace is None else [self.roots[namespace]] if namespace in self.roots else []
        order: list[PageNode] = []
        stack = [child for root in roots for child in root.children.values()]
        while stack:
            node = stack.pop()
            order.append(node)
            stack.extend(node.children.values())
        return order[::-1]

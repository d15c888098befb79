"""What a router hears of one model's pages: each page that enters or leaves a tier, as KV events
(kvserve/cache/kv_events.py publishes them in vLLM's format).

Invariants:
- a page is announced by its key (page_key.py), its parent's key (None for a namespace's first page)
  and its exact tokens, so a router rebuilds the chain from the events alone;
- every page stored in a tier is announced once per tier (`cpu` for host memory, `disk`), and every
  page that leaves a tier is announced removed from it; a page is gone for a router once every tier
  it entered removed it;
- `AllBlocksCleared` only when nothing of the model is left anywhere (no disk tier, host cleared),
  and as the server starts, before what its disk holds is announced again: a router that followed
  the process before it forgets what died with that process.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterable

from kvserve.cache.disk_store import MAX_TAG_BYTES, TAG_PARTS
from kvserve.cache.page_tree import PageNode

if TYPE_CHECKING:
    from kvserve.cache.disk_store import DiskEntry, DiskStore
    from kvserve.cache.kv_events import KvEventPublisher

HOST, DISK = "cpu", "disk"
_LORA = TAG_PARTS  # in a page file's tag, between its model's name and its adapter set


def page_tag(model: str, lora: str | None) -> str:
    """The tag a page file carries: its model's name, then its adapter set where it has one (and
    both fit a tag), so the disk's events name the adapters after a restart too."""
    tag = f"{model}{_LORA}{lora}" if lora else model
    return tag if len(tag.encode()) <= MAX_TAG_BYTES else model


def tag_parts(tag: str) -> tuple[str, str | None]:
    """A page file's model and adapter set (None: the base model), from its tag."""
    model, _, lora = tag.partition(_LORA)
    return model, lora or None


@dataclass(frozen=True)
class ModelEvents:
    """One model's page events on the server's publisher."""

    publisher: "KvEventPublisher"
    model: str
    page_rows: int
    lora_of: Callable[[str], str | None] = lambda namespace: None  # a namespace's adapter names

    def stored(self, nodes: list[PageNode], medium: str = HOST) -> None:
        """`nodes`, a chain from parent to child, entered `medium`."""
        if not nodes:
            return
        first = nodes[0].parent
        parent = None if first is None or first.is_root else first.key
        tokens = [t for node in nodes for t in node.tokens]
        self.publisher.stored(self.model, [node.key for node in nodes], parent, tokens, self.page_rows,
                              self.lora_of(nodes[0].namespace), medium)

    def removed(self, keys: list[bytes], medium: str = HOST) -> None:
        if keys:
            self.publisher.removed(self.model, keys, medium)

    def cleared(self) -> None:
        self.publisher.cleared(self.model)


def disk_listeners(publisher: "KvEventPublisher") -> tuple[Callable[["DiskEntry"], None], Callable[["DiskEntry"], None]]:
    """The disk store's `on_stored` and `on_removed`: each file's page, on the topic of the model that
    wrote it (its tag), a first page (parent = its namespace's seed) without a parent. Checkpoints
    (a tag ending in `#state`) are whole sequences, not pages: a router's index has no place for them."""

    def on_stored(entry: "DiskEntry") -> None:
        if entry.tag.endswith("#state"):
            return
        parent = None if entry.parent == entry.seed else entry.parent
        model, lora = tag_parts(entry.tag)
        publisher.stored(model, [entry.key], parent, list(entry.tokens), len(entry.tokens), lora, DISK)

    def on_removed(entry: "DiskEntry") -> None:
        if entry.tag.endswith("#state"):
            return
        publisher.removed(tag_parts(entry.tag)[0], [entry.key], DISK)

    return on_stored, on_removed


def announce_start(publisher: "KvEventPublisher", store: "DiskStore | None", models: Iterable[str]) -> None:
    """What a router hears as the server starts: `AllBlocksCleared` for each model it may have heard
    of from the process before this one (`models`, and those with pages on disk), whose pages in host
    memory died with it unannounced (a crash announces nothing); then every page the disk holds,
    parents before children (`entries`' order)."""
    entries = store.entries() if store is not None else []
    on_disk = {tag_parts(e.tag)[0] for e in entries if e.tag and not e.tag.endswith("#state")}
    for model in sorted(set(models) | on_disk):
        publisher.cleared(model)
    if store is not None and store.on_stored is not None:
        for entry in entries:
            store.on_stored(entry)

"""Checkpoints for models that carry state between tokens (Mamba, LFM2 and other hybrids).

KV pages cannot restore a recurrent state, so this cache keeps checkpoints: the tokens and the
whole sequence at exactly that position (its recurrent state and, for hybrids, its attention rows),
a blob from `llama_state_seq_get_data`, kept whole in the host store. A prompt can attach a
checkpoint only when it is of the checkpoint's namespace and starts with all of its tokens;
attaching sets the blob into the session's empty stream.

Invariants:
- the blobs' bytes never exceed the store's budget, not even between insert and evict: the store
  makes room before it keeps a state; the number of checkpoints never exceeds `max_states`;
- eviction takes conversation checkpoints before opening ones, then cold before hot, least
  recently used first, and never one a live session restored or saved;
- a checkpoint is of the namespace of the session that saved it, and only keys of that namespace
  match it.

With a disk tier (`Tiers.disk`) every checkpoint kept is also written behind, named by `state_key`
of its namespace's seed and its tokens (page_key.py), under the model's tag with `#state`. A prompt
matches the deepest checkpoint in host memory or on disk; one read from disk (checked by the store,
then by llama.cpp taking the blob whole, else discarded) is kept in host memory like a saved one.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvserve.cache.cache_stats import CacheStats
from kvserve.cache.chat_marks import MarkKind
from kvserve.cache.disk_store import DiskEntry
from kvserve.cache.host_store import HostStore
from kvserve.cache.kv_pool import Session
from kvserve.cache.prefix_cache import InsertAt, PrefixCache
from kvserve.cache.page_key import namespace_seed, row_format, state_key
from kvserve.cache.prefix_key import PrefixKey
from kvserve.cache.tiers import Tiers
from kvserve.llama.context import Context


@dataclass(eq=False)
class Checkpoint:
    tokens: list[int]
    kind: MarkKind
    nbytes: int
    namespace: str = ""
    preview: str = ""  # a label for dashboards
    hits: int = 0

    @property
    def position(self) -> int:
        return len(self.tokens)

    def snapshot(self) -> dict:
        return {"position": self.position, "kind": self.kind.value, "bytes": self.nbytes, "hits": self.hits,
                "preview": self.preview}


STATE_TAG = "#state"  # a checkpoint file's tag: its model's, then this


def _rank(kind: MarkKind) -> int:
    """Lower goes first: conversation checkpoints before openings."""
    return 1 if kind is MarkKind.OPENING else 0


class StateCache(PrefixCache):
    keeps = "checkpoints"
    donates_prompt = False  # the prompt's end is the `close` mark plus a generation prompt: not worth a state

    def __init__(self, ctx: Context, page_rows: int, store: HostStore[Checkpoint, np.ndarray], max_states: int = 16,
                 min_gap: int | None = None, tiers: Tiers = Tiers()) -> None:
        if not ctx.model.info.carries_state:
            raise ValueError("attention-only models need no checkpoints: use the page cache")
        self.ctx = ctx
        self.page_rows = page_rows
        self.store = store
        store.on_evict = self._evicted
        self.max_states = max_states
        self.min_gap = page_rows if min_gap is None else min_gap
        self.checkpoints: list[Checkpoint] = []
        self._locks: dict[Session, list[Checkpoint]] = {}
        self._state_size = 0  # of the last state saved: the estimate `checkpoint_at` decides by
        self._queried_tokens = 0
        self._hit_tokens = 0
        self._restores = 0
        self._evictions = 0
        self.tiers = tiers
        self.disk_refused = 0  # checkpoints read from disk that llama.cpp did not take
        self._rows = row_format(ctx, page_rows).digest()
        self._tag = tiers.tag + STATE_TAG
        # the checkpoints on disk of this model, by key (disk evictions show when a read finds none)
        self._on_disk = {e.key: e for e in tiers.disk.entries() if e.tag.endswith(STATE_TAG)} if tiers.disk else {}

    @property
    def bytes_used(self) -> int:
        return self.store.bytes_used

    @property
    def budget_bytes(self) -> int:
        return self.store.budget_bytes

    def caps(self) -> dict:
        return {"prefix_state_bytes": self.store.budget_bytes, "prefix_states": self.max_states}

    # -- lookup -------------------------------------------------------------------------------------

    def _match(self, key: PrefixKey) -> Checkpoint | None:
        """The deepest checkpoint of `key`'s namespace that its tokens fully contain, leaving at least
        one token to evaluate."""
        best = None
        for c in self.checkpoints:
            if c.namespace == key.namespace and c.position < len(key.tokens):
                if (best is None or c.position > best.position) and key.tokens[: c.position] == c.tokens:
                    best = c
        return best

    def _held(self, namespace: str, tokens: list[int]) -> Checkpoint | None:
        """The checkpoint of `namespace` at exactly `tokens`, if one is kept."""
        return next((c for c in self.checkpoints if c.namespace == namespace and c.tokens == tokens), None)

    def _disk_match(self, key: PrefixKey, deeper_than: int) -> "DiskEntry | None":
        """The deepest checkpoint of `key`'s namespace on disk, deeper than `deeper_than` tokens, that
        its tokens fully contain, leaving one to evaluate."""
        disk, best = self.tiers.disk, None
        if disk is None:
            return None
        seed = namespace_seed(self._rows, key.namespace)
        for entry in self._on_disk.values():
            n = len(entry.tokens)
            if entry.seed == seed and deeper_than < n < len(key.tokens) and (best is None or n > len(best.tokens)):
                if tuple(key.tokens[:n]) == entry.tokens and disk.contains(entry.key):
                    best = entry
        return best

    def match_len(self, key: PrefixKey) -> int:
        found = self._match(key)
        position = found.position if found else 0
        on_disk = self._disk_match(key, position)
        return len(on_disk.tokens) if on_disk else position

    def attach(self, session: Session, key: PrefixKey) -> list[int]:
        """Set the deepest checkpoint (from host memory, or read from disk) into an empty session's stream."""
        self.check_attachable(session, key)
        self._queried_tokens += len(key.tokens)
        found = self._match(key)
        on_disk = self._disk_match(key, found.position if found else 0)
        if on_disk is not None:
            found = self._read_disk(session, on_disk) or found
        if found is None:
            return []
        self.ctx.write_seq_state(session.seq, self.store.get(found))
        self._lock(session, found)
        found.hits += 1
        self._restores += 1
        self._hit_tokens += found.position
        return list(found.tokens)

    def _read_disk(self, session: Session, entry: "DiskEntry") -> Checkpoint | None:
        """The checkpoint of `entry` read from disk into host memory (None where it is gone, refused,
        or cannot be kept): a file llama.cpp does not take whole is discarded."""
        disk = self.tiers.disk
        assert disk is not None
        data = disk.get(entry.key)
        if data is None:
            self._on_disk.pop(entry.key, None)
            return None
        blob = np.frombuffer(data, np.uint8).copy()
        try:
            self.ctx.write_seq_state(session.seq, blob)
        except RuntimeError:
            disk.discard(entry.key)
            self._on_disk.pop(entry.key, None)
            self.disk_refused += 1
            return None
        finally:
            self.ctx.seq_rm(session.seq)
        checkpoint = Checkpoint(tokens=list(entry.tokens), kind=MarkKind.CONVERSATION, nbytes=blob.nbytes,
                                preview="(from disk)", namespace=session.namespace)
        if not self._below_max_states() or not self.store.put(checkpoint, blob, rank=_rank(checkpoint.kind)):
            return None
        self.checkpoints.append(checkpoint)
        return checkpoint

    def gains_from_waiting(self, shared: int, cached: int) -> bool:
        return shared >= cached + 2 * self.page_rows  # the running prefill may checkpoint a mark in between

    # -- taking checkpoints -------------------------------------------------------------------------

    def checkpoint_at(self, session: Session, tokens: list[int], matched: int, mark: int) -> int:
        if not matched + self.min_gap <= mark < len(tokens):
            return 0  # too close to what is already restored, or no token left to evaluate
        if self._held(session.namespace, tokens[:mark]):
            return 0  # already cached there
        if not self.store.fits(self._state_size):
            return 0  # the last state saved would not fit even after every eviction
        return mark

    def insert(self, session: Session, tokens: list[int], preview: str = "",
               kind: MarkKind = MarkKind.CONVERSATION, at: InsertAt = InsertAt.EVALUATED) -> Checkpoint | None:
        """Record a checkpoint where the session stands (call it between two evals): `tokens` must be
        its whole history; the checkpoint is of the session's namespace. An opening one is evicted
        after every conversation one."""
        if tuple(tokens) != session.tokens:
            raise ValueError("a checkpoint is taken where the session stands: tokens must be its history")
        held = self._held(session.namespace, list(session.tokens))
        if held is not None:
            self.store.touch(held)
            if kind is MarkKind.OPENING and held.kind is not kind:
                held.kind = kind
                self.store.rerank(held, _rank(kind))
            return held
        self._state_size = self.ctx.state_size(session.seq)
        if not self.store.fits(self._state_size) or not self._below_max_states():
            return None
        blob = self.ctx.read_seq_state(session.seq)
        checkpoint = Checkpoint(tokens=list(session.tokens), kind=kind, nbytes=blob.nbytes, preview=preview[:80],
                                namespace=session.namespace)
        if not self.store.put(checkpoint, blob, rank=_rank(kind)):
            return None
        self.checkpoints.append(checkpoint)
        self._lock(session, checkpoint)
        self._write_behind(checkpoint, blob)
        return checkpoint

    def _write_behind(self, checkpoint: Checkpoint, blob: np.ndarray) -> None:
        disk = self.tiers.disk
        if disk is None:
            return
        seed = namespace_seed(self._rows, checkpoint.namespace)
        key = state_key(seed, checkpoint.tokens)
        if disk.put(key, seed, seed, tuple(checkpoint.tokens), lambda: [blob], tag=self._tag, nbytes=blob.nbytes):
            self._on_disk[key] = DiskEntry(key=key, parent=seed, seed=seed, tokens=tuple(checkpoint.tokens),
                                           tag=self._tag, nbytes=blob.nbytes)

    def _below_max_states(self) -> bool:
        """Fewer than `max_states` checkpoints, once the store evicted what it may for that."""
        while len(self.checkpoints) >= self.max_states:
            if not self.store.evict(1):
                return False
        return True

    # -- locks and eviction -------------------------------------------------------------------------

    def _lock(self, session: Session, checkpoint: Checkpoint) -> None:
        self.store.lock(checkpoint)
        self._locks.setdefault(session, []).append(checkpoint)

    def unlock(self, session: Session) -> None:
        for checkpoint in self._locks.pop(session, []):
            self.store.unlock(checkpoint)

    def _evicted(self, checkpoint: Checkpoint) -> None:
        self.checkpoints.remove(checkpoint)
        self._evictions += 1

    def rebind(self, ctx: Context) -> bool:
        if any(self._locks.values()):
            raise RuntimeError("sessions still use checkpoints: end them first")
        if row_format(ctx, self.page_rows).digest() != self._rows:
            return False
        self.ctx = ctx
        return True

    def release(self) -> None:
        if any(self._locks.values()):
            raise RuntimeError("sessions still use checkpoints: end them first")
        for checkpoint in self.checkpoints:
            self.store.discard(checkpoint)
        self.checkpoints.clear()

    # -- what metrics and dashboards read -------------------------------------------------------------

    def namespaces(self) -> set[str]:
        return {c.namespace for c in self.checkpoints}

    def stats(self) -> CacheStats:
        openings = sum(c.kind is MarkKind.OPENING for c in self.checkpoints)
        return CacheStats(
            queried_tokens=self._queried_tokens, hit_tokens=self._hit_tokens, state_hits=self._restores,
            state_evictions=self._evictions, state_bytes=self.bytes_used, held_bytes=self.bytes_used,
            locked_entries=self.store.stats().locked_entries,
            opening_checkpoints=openings, conversation_checkpoints=len(self.checkpoints) - openings,
        )

    def view(self, namespace: str) -> dict:
        """The checkpoints of `namespace` and the bytes they hold; the budget is everyone's."""
        mine = [c for c in self.checkpoints if c.namespace == namespace]
        held = sum(c.nbytes for c in mine)
        return {"enabled": True, "held_pages": 0, "state_bytes": held, "held_bytes": held,
                "state_budget_bytes": self.budget_bytes, "budget_bytes": self.budget_bytes,
                "checkpoints": [c.snapshot() for c in mine]}

"""The one name of a cached page: a SHA-256 chained over its parent page's key and its own tokens,
seeded by its namespace and by everything that makes KV rows incompatible (SGLang HiCache's and
vLLM's chained block hashes, with their extra keys).

    seed(ns)  = sha256("kvserve-rows" | row format | ns)       the key of a namespace's root
    key(page) = sha256(key(parent) | page's token ids as int32 LE)

Invariants:
- two pages have the same key exactly when they hold the same tokens after the same prefix, under
  the same namespace, for rows of the same format (model, K/V types, V layout, llama.cpp's state
  format, page size), up to a SHA-256 collision: a key names the rows, wherever they are kept;
- keys are the same in every process on every machine (nothing random, no Python `hash`), so a
  page written to disk or announced to a router is found again after a restart or elsewhere;
- the page tree, the disk tier, KV events and `/v1/prefix/match` all name pages by this key, and
  only by it.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import numpy as np

if TYPE_CHECKING:
    from kvserve.llama.context import Context

KEY_BYTES = 32
FORMAT = 2  # of this module's hashing and of a page's bytes (`SeqState.page_bytes`): bump when either changes


@dataclass(frozen=True)
class RowFormat:
    """What two contexts must share to read each other's rows."""

    model: str  # the model file's fingerprint (`Model.fingerprint`)
    type_k: str
    type_v: str
    v_transposed: bool  # without flash attention llama.cpp stores V transposed
    state_version: str  # llama.cpp's state format: LLAMA_STATE_SEQ_VERSION and the pinned library's version
    page_rows: int

    def digest(self) -> bytes:
        text = "\0".join(map(str, (FORMAT, self.model, self.type_k, self.type_v, int(self.v_transposed),
                                   self.state_version, self.page_rows)))
        return hashlib.sha256(text.encode()).digest()


def namespace_seed(rows: bytes, namespace: str) -> bytes:
    """The key of `namespace`'s root for rows of format digest `rows` (`RowFormat.digest`)."""
    return hashlib.sha256(b"kvserve-rows\0" + rows + b"\0" + namespace.encode()).digest()


def page_key(parent: bytes, tokens: Sequence[int]) -> bytes:
    """The key of the page holding `tokens` right after the page (or root) keyed `parent`."""
    return hashlib.sha256(parent + np.asarray(tokens, dtype="<i4").tobytes()).digest()


def row_format(ctx: "Context", page_rows: int) -> RowFormat:
    """The format of the rows `ctx` reads out, cut into pages of `page_rows`."""
    return RowFormat(model=ctx.model.fingerprint, type_k=ctx.params.type_k, type_v=ctx.params.type_v,
                     v_transposed=not ctx.flash_attn, state_version=ctx.state_version, page_rows=page_rows)


def state_key(seed: bytes, tokens: Sequence[int]) -> bytes:
    """The name of a checkpoint (a whole sequence's state at the end of `tokens`) under the namespace
    seeded `seed`: never a page's key, since it is domain-separated."""
    return hashlib.sha256(b"kvserve-state\0" + seed + np.asarray(tokens, dtype="<i4").tobytes()).digest()

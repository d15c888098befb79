"""What the prefix cache knows a cached row by: the namespace it was computed under and the tokens
before it (SGLang's `RadixKey(token_ids, extra_key)`, vLLM's block hash with its extra keys).

Invariants:
- two keys share cached rows only when their namespaces are equal: a namespace selects a root of the
  page tree, the checkpoints and the resident streams a key may match, and nothing else does;
- "" is the shared default namespace; any other is opaque here (the server builds it, by digest,
  from a tenant, a `cache_salt` and an adapter set: kvserve/server/namespace.py);
- a namespace is a `+`-joined list of `part:digest` items, so `namespace_kind` can name its parts
  (a bounded set) without naming whose they are.
"""

from __future__ import annotations

from dataclasses import dataclass, field

SHARED = ""


@dataclass(frozen=True)
class PrefixKey:
    """A prompt as the cache looks it up: its tokens under its namespace (an empty key: a namespace alone)."""

    namespace: str
    tokens: list[int] = field(default_factory=list)


def namespace_kind(namespace: str) -> str:
    """Which parts `namespace` has, e.g. "tenant+salt"; "shared" for the default namespace."""
    if namespace == SHARED:
        return "shared"
    return "+".join(item.split(":", 1)[0] for item in namespace.split("+"))

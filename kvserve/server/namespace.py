"""Cache namespaces: which requests may share cached rows.

A namespace is part of every prefix-cache key (`PrefixKey`): rows computed under one namespace are
never attached, kept in place or shown under another. "" is the shared default namespace.

Invariants:
- a namespace names its parts only by digest (sha256, domain-separated per part), so neither an API
  key nor a salt can be read back from it, nor from anything the cache shows;
- the same parts give the same namespace in every process (replicas agree), and different parts
  give different namespaces (up to a 128-bit digest collision);
- `namespace_kind` reveals which parts a namespace has, never their values: the only label a
  namespace may give a metric.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict

from kvserve.cache.prefix_key import SHARED, namespace_kind

_PARTS = ("tenant", "salt", "lora")


def _digest(part: str, value: str) -> str:
    return hashlib.sha256(f"kvserve-namespace\0{part}\0{value}".encode()).hexdigest()[:32]


def tenant_id(api_key: str) -> str:
    """A tenant's id, derived from its API key (the key itself is never kept past authentication)."""
    return _digest("key", api_key)


def request_namespace(*, tenant: str | None, cache_salt: str | None, adapters: str = "",
                      adapter_files: str = "") -> str:
    """The namespace a request's rows belong to: its tenant (None: shared, as without keys or under
    `--cache-isolation none`), its `cache_salt` (None: none) and its adapter set (a canonical string
    of the request's LoRA adapters, "" for the base model, with the digests of their files). No part
    at all: the shared namespace."""
    lora = f"{adapters}\0{adapter_files}" if adapters else ""
    values = dict(zip(_PARTS, (tenant, cache_salt, lora)))
    namespace = "+".join(f"{part}:{_digest(part, value)}" for part, value in values.items() if value)
    if adapters:
        _ADAPTERS[namespace] = adapters
        _ADAPTERS.move_to_end(namespace)
        while len(_ADAPTERS) > _ADAPTERS_KEPT:
            _ADAPTERS.popitem(last=False)
    return namespace


# The adapter set of namespaces seen lately: what a KV event names as its `lora_name` (adapter
# names are the server's own, not secrets; tenants and salts stay digests).
_ADAPTERS: OrderedDict[str, str] = OrderedDict()
_ADAPTERS_KEPT = 4096


def adapters_of(namespace: str) -> str | None:
    """The adapter set (`name*scale`, comma-joined) a namespace was built with lately, None for none."""
    return _ADAPTERS.get(namespace)


NAMESPACE_KINDS = [namespace_kind(SHARED)] + [
    "+".join(p for i, p in enumerate(_PARTS) if mask >> i & 1) for mask in range(1, 1 << len(_PARTS))
]

__all__ = ["NAMESPACE_KINDS", "SHARED", "adapters_of", "namespace_kind", "request_namespace", "tenant_id"]

"""Cache namespaces: which requests may share cached rows (kvserve/server/namespace.py)."""

from __future__ import annotations

from kvserve.server.namespace import NAMESPACE_KINDS, namespace_kind, request_namespace, tenant_id


def test_no_part_is_the_shared_namespace() -> None:
    assert request_namespace(tenant=None, cache_salt=None) == ""
    assert request_namespace(tenant=None, cache_salt=None, adapters="") == ""
    assert namespace_kind("") == "shared"


def test_each_part_splits_namespaces_and_none_is_readable() -> None:
    a, b = tenant_id("sk-alpha"), tenant_id("sk-beta")
    spaces = {
        request_namespace(tenant=a, cache_salt=None),
        request_namespace(tenant=b, cache_salt=None),
        request_namespace(tenant=a, cache_salt="s1"),
        request_namespace(tenant=a, cache_salt="s2"),
        request_namespace(tenant=None, cache_salt="s1"),
        request_namespace(tenant=a, cache_salt="s1", adapters="x=1.0"),
        request_namespace(tenant=None, cache_salt=None, adapters="x=1.0"),
    }
    assert len(spaces) == 7 and "" not in spaces
    for space in spaces:
        assert "sk-alpha" not in space and "sk-beta" not in space and "s1" not in space.split(":")
        assert namespace_kind(space) in NAMESPACE_KINDS
    assert request_namespace(tenant=a, cache_salt="s1") == request_namespace(tenant=a, cache_salt="s1")


def test_kinds_name_parts_never_values() -> None:
    space = request_namespace(tenant=tenant_id("sk-alpha"), cache_salt="secret", adapters="x=1.0")
    assert namespace_kind(space) == "tenant+salt+lora"
    assert namespace_kind(request_namespace(tenant=None, cache_salt="secret")) == "salt"
    assert len(NAMESPACE_KINDS) == len(set(NAMESPACE_KINDS)) == 8

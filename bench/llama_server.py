"""Build llama-server from the llama.cpp that the installed llama-cpp-python vendors, once per version.

The PyPI sdist of llama-cpp-python carries the whole llama.cpp tree (tools/server included), so
the reference server runs exactly the kernels kvserve runs. The binary lands in
~/.cache/kvserve/llama-server/<version>/, outside any checkout, and later calls reuse it.

CMAKE_ARGS='<the Makefile's portable flags>' python -m bench.llama_server   (what `make bench-setup` runs)
"""

from __future__ import annotations

import importlib.metadata
import os
import shlex
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

CACHE = Path.home() / ".cache" / "kvserve" / "llama-server"
PACKAGE = "llama-cpp-python"
# The server alone: no HTTPS, no model downloads, no web UI (its assets would be fetched online).
SERVER_ONLY = ["-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF",
               "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_UI=OFF",
               "-DLLAMA_USE_PREBUILT_UI=OFF"]


def version() -> str:
    return importlib.metadata.version(PACKAGE)


def binary() -> Path:
    return CACHE / version() / "llama-server"


def require() -> Path:
    """The built binary; SystemExit saying how to build it where it is missing."""
    target = binary()
    if not target.is_file():
        raise SystemExit(f"{target} is missing: build it once with `make bench-setup`")
    return target


def build(cmake_args: list[str]) -> Path:
    target = binary()
    if target.is_file():
        return target
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:",
                        "--dest", str(work), f"{PACKAGE}=={version()}"], check=True)
        sdist = next(work.glob("*.tar.gz"))
        with tarfile.open(sdist) as archive:
            archive.extractall(work, filter="data")
        source = next(work.glob("*/vendor/llama.cpp"))
        build_dir = work / "build"
        subprocess.run(["cmake", "-S", str(source), "-B", str(build_dir), *cmake_args, *SERVER_ONLY], check=True)
        subprocess.run(["cmake", "--build", str(build_dir), "--target", "llama-server",
                        "-j", str(os.cpu_count() or 1)], check=True)
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_suffix(".partial")  # a killed copy never passes for a built binary
        shutil.copy2(build_dir / "bin" / "llama-server", partial)
        (target.parent / "cmake-args.txt").write_text(shlex.join([*cmake_args, *SERVER_ONLY]) + "\n")
        partial.rename(target)
    return target


def main() -> None:
    if "CMAKE_ARGS" not in os.environ:
        # llama.cpp's default native build turns on AMX kernels that crash on our machines
        raise SystemExit("set CMAKE_ARGS to the CPU flags to build with (`make bench-setup` passes the Makefile's)")
    print(build(shlex.split(os.environ["CMAKE_ARGS"])))


if __name__ == "__main__":
    main()

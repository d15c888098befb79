"""The Dockerfile, checked without a Docker engine: its structure, its pins against pyproject, and
that the command and settings it names are real in this environment."""

from __future__ import annotations

import fnmatch
import json
import re
import tomllib
from pathlib import Path

import pytest

from conftest import kvserve_help, names_flag
from kvserve.config import Settings

ROOT = Path(__file__).resolve().parent.parent
DOCKERFILE = ROOT / "Dockerfile"


def parse_dockerfile(text: str) -> list[tuple[str, str]]:
    """[(INSTRUCTION, arguments)]: continuation lines joined, comments and blank lines dropped
    (Docker drops comment lines inside a continuation too)."""
    instructions, pending = [], ""
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        full, pending = pending + line, ""
        keyword, _, args = full.partition(" ")
        instructions.append((keyword.upper(), args.strip()))
    assert not pending, "the Dockerfile ends inside a continuation"
    return instructions


def stages(instructions: list[tuple[str, str]]) -> list[list[tuple[str, str]]]:
    """The instructions split at each FROM; each stage starts with its FROM."""
    out: list[list[tuple[str, str]]] = []
    for keyword, args in instructions:
        if keyword == "FROM":
            out.append([])
        elif not out:
            assert keyword == "ARG", f"{keyword} before the first FROM"
            continue
        out[-1].append((keyword, args))
    return out


def exec_form(args: str) -> list[str]:
    assert args.startswith("["), f"not exec (JSON) form: {args}"
    return json.loads(args)


def last(stage: list[tuple[str, str]], keyword: str) -> str | None:
    found = [args for kw, args in stage if kw == keyword]
    return found[-1] if found else None


@pytest.fixture(scope="module")
def text() -> str:
    return DOCKERFILE.read_text()


@pytest.fixture(scope="module")
def all_stages(text: str) -> list[list[tuple[str, str]]]:
    return stages(parse_dockerfile(text))


@pytest.fixture(scope="module")
def runtime(all_stages) -> list[tuple[str, str]]:
    return all_stages[-1]


@pytest.fixture(scope="module")
def argv(runtime) -> list[str]:
    """What the container runs by default: ENTRYPOINT + CMD."""
    entrypoint, cmd = last(runtime, "ENTRYPOINT"), last(runtime, "CMD")
    assert entrypoint is not None, "no ENTRYPOINT in the runtime stage"
    return exec_form(entrypoint) + (exec_form(cmd) if cmd else [])


def test_parser_joins_continuations_and_skips_comments():
    parsed = parse_dockerfile("# c\nFROM a AS b\nRUN x \\\n  # inside\n  && y\n\nUSER 1\n")
    assert parsed == [("FROM", "a AS b"), ("RUN", "x  && y"), ("USER", "1")]


def test_multi_stage(all_stages):
    assert len(all_stages) >= 2


def test_runtime_runs_as_non_root(runtime):
    user = last(runtime, "USER")
    assert user is not None, "the runtime stage has no USER: it would run as root"
    name = user.split(":")[0].strip()
    assert name not in {"root", "0", ""}


def test_runtime_has_no_compiler(runtime):
    runs = " ".join(args for kw, args in runtime if kw == "RUN")
    assert not re.search(r"\b(build-essential|gcc|g\+\+|cmake)\b", runs)


def test_expose_8000(runtime):
    ports = {p.split("/")[0] for kw, args in runtime if kw == "EXPOSE" for p in args.split()}
    assert "8000" in ports


def test_healthcheck_targets_health(runtime):
    check = last(runtime, "HEALTHCHECK")
    assert check is not None and check.upper() != "NONE"
    assert "CMD" in check and "127.0.0.1:8000/health" in check
    cmd = exec_form(check[check.index("CMD") + 3:].strip())
    if cmd[:2] == ["python", "-c"]:
        compile(cmd[2], "<HEALTHCHECK>", "exec")  # the one-liner is valid Python


def test_entrypoint_is_kvserve_on_all_interfaces(argv):
    assert argv[0] == "kvserve"
    assert "--host" in argv and argv[argv.index("--host") + 1] == "0.0.0.0"


def test_build_stage_is_portable(all_stages):
    build = " ".join(args for stage in all_stages[:-1] for kw, args in stage if kw in {"ENV", "ARG", "RUN"})
    cmake_args = re.findall(r"CMAKE_ARGS=\"([^\"]*)\"", build)
    assert cmake_args, "the build stage sets no CMAKE_ARGS"
    for value in cmake_args:
        native = re.findall(r"-DGGML_NATIVE=(\w+)", value)
        assert native and all(v.upper() in {"OFF", "0", "FALSE", "NO"} for v in native), value


def _normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def test_llama_cpp_python_pin_matches_pyproject(text):
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    pins = {}
    for dep in pyproject["project"]["dependencies"]:
        m = re.fullmatch(r"\s*([A-Za-z0-9_.-]+)\s*==\s*(\S+)\s*", dep)
        if m:
            pins[_normalise(m[1])] = m[2]
    assert "llama-cpp-python" in pins, "pyproject no longer pins llama-cpp-python exactly"
    in_dockerfile = set(re.findall(r"llama[-_]cpp[-_]python==([^\s\"']+)", text))
    assert in_dockerfile == {pins["llama-cpp-python"]}


def test_entrypoint_runs_here_and_knows_its_flags(argv):
    help_text = kvserve_help()
    for flag in (a.split("=")[0] for a in argv[1:] if a.startswith("--")):
        assert names_flag(help_text, flag), flag


def test_kvserve_env_vars_are_settings(text):
    assert Settings.model_config["env_prefix"] == "KVSERVE_"
    assert "model" in Settings.model_fields
    named = set(re.findall(r"\bKVSERVE_([A-Z0-9_]+)", text))  # in instructions and comments alike
    assert "MODEL" in named, "the Dockerfile no longer documents KVSERVE_MODEL"
    for var in named:
        assert var.lower() in Settings.model_fields, f"KVSERVE_{var} is no setting"


def test_copied_sources_exist_and_are_not_dockerignored(all_stages):
    ignored = [p.strip().rstrip("/") for p in (ROOT / ".dockerignore").read_text().splitlines()
               if p.strip() and not p.startswith("#")]
    assert {".venv", ".git"} <= set(ignored)
    for stage in all_stages:
        for kw, args in stage:
            if kw != "COPY" or "--from" in args:
                continue
            for src in [a for a in args.split() if not a.startswith("--")][:-1]:
                assert (ROOT / src).exists(), src
                assert not any(fnmatch.fnmatch(src, p) for p in ignored), src

"""Only `KvManager` writes what a stream holds (`Session._in_stream`): the pool and the caches move rows
and return what they kept, restored or copied. The structure says so (a session's tokens read as a
tuple, with no setter), a source check keeps it so, and the invariant tests elsewhere
(test_prefix_cache, test_state_cache, test_sliding_window, test_speculation) compare what sessions
hold with llama.cpp's own positions after every operation."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from kvserve.cache import PrefixKey, create_kv_pool
from kvserve.scheduler.kv_manager import KvManager

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "kvserve"
WRITER = PACKAGE / "scheduler" / "kv_manager.py"
DEFINITION = PACKAGE / "cache" / "kv_pool.py"


def _uses_of_in_stream(path: Path) -> list[int]:
    tree = ast.parse(path.read_text())
    return [node.lineno for node in ast.walk(tree) if isinstance(node, ast.Attribute) and node.attr == "_in_stream"]


def test_only_the_kv_manager_touches_what_a_session_holds() -> None:
    """Outside kv_pool.py's `Session` (which reads it) and KvManager, no module of the package, the
    bench or the examples names `_in_stream`."""
    sources = [p for folder in ("kvserve", "bench", "examples") for p in (ROOT / folder).rglob("*.py")]
    touched = {str(p.relative_to(ROOT)): lines for p in sources
               if p not in (WRITER, DEFINITION) and (lines := _uses_of_in_stream(p))}
    assert touched == {}
    assert _uses_of_in_stream(WRITER), "the writer is where the check looks"


def test_the_check_sees_a_write_from_another_module(tmp_path: Path) -> None:
    bad = tmp_path / "page_cache.py"
    bad.write_text("def attach(session, tokens):\n    session._in_stream[:] = tokens\n")
    assert _uses_of_in_stream(bad) == [2]


def test_a_session_cannot_be_written_but_by_the_kv_manager(tiny) -> None:
    """Its tokens are a fresh tuple: no setter, no mutation reaches the session; KvManager's
    `new_session`, `eval`, `attach` and `fork` record exactly what the stream holds, position by
    position, as llama.cpp reports it."""
    from kvserve.llama.model import Model

    model = Model(tiny("llama"))
    pool, cache = create_kv_pool(model, 16, n_ctx_seq=256, n_streams=3)
    kv = KvManager(pool, cache)
    prompt = list(range(100, 140))

    def holds(session) -> None:
        assert pool.ctx.seq_pos_max(session.seq) == session.n_past - 1
        assert pool.ctx.seq_pos_min(session.seq) == (0 if session.n_past else -1)
    try:
        a = kv.new_session()
        kv.eval(a, prompt)
        assert a.tokens == tuple(prompt)
        holds(a)
        with pytest.raises(AttributeError):
            a.tokens = []  # type: ignore[misc]
        with pytest.raises(AttributeError):
            a.tokens.append(1)  # type: ignore[attr-defined]
        cache.insert(a, list(a.tokens))
        b = kv.new_session()
        assert kv.attach(b, PrefixKey("", prompt + [7])) == 32 and b.tokens == tuple(prompt[:32])
        holds(b)
        c = kv.new_session()
        kv.fork(a, c)
        kv.eval(c, [5])  # the copy lands with the next decode
        assert c.tokens == tuple(prompt + [5])
        holds(c)
        for s in (a, b, c):
            pool.end_session(s)
        d = kv.new_session(PrefixKey("", prompt[:30] + [9, 9]))
        assert d.tokens == tuple(prompt[:30])  # kept in place: the stream was cut back to them
        holds(d)
        pool.end_session(d)
    finally:
        cache.release()
        pool.close()
        model.close()

"""Quantized KV (`--cache-type-k/-v`): the streams and the pages in host memory keep llama.cpp's type,
the prefix cache stays exact under it, and a quantized V without flash attention is refused at start.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import llama_cpp
import numpy as np
import pytest

import kvserve.scheduler.engine as engine_module
from conftest import engine, greedy, run_traced
from kvserve.cache import create_kv_pool
from kvserve.scheduler.kv_manager import KvManager
from kvserve.llama.context import Context, ContextParams
from kvserve.llama.kv_types import KV_TYPES
from kvserve.llama.model import Model
from kvserve.llama.seq_state import SeqState
from kvserve.testing import free_port

PAGE = 16
# bytes per element of each type: ggml's block bytes over block elements (ggml.c's type traits)
BYTES_PER_ELEMENT = {"f16": 2, "q8_0": 34 / 32, "q4_0": 18 / 32}
SYSTEM = "You are a careful assistant. Answer briefly and precisely, citing facts only. " * 3


def test_kv_types_are_ggmls_enum_values() -> None:
    assert {name: KV_TYPES[name] for name in ("f32", "f16", "q8_0", "q4_0", "q4_1", "iq4_nl", "q5_0", "q5_1")} == {
        "f32": llama_cpp.GGML_TYPE_F32, "f16": llama_cpp.GGML_TYPE_F16, "q8_0": llama_cpp.GGML_TYPE_Q8_0,
        "q4_0": llama_cpp.GGML_TYPE_Q4_0, "q4_1": llama_cpp.GGML_TYPE_Q4_1, "iq4_nl": llama_cpp.GGML_TYPE_IQ4_NL,
        "q5_0": llama_cpp.GGML_TYPE_Q5_0, "q5_1": llama_cpp.GGML_TYPE_Q5_1}


@pytest.fixture(scope="module")
def smol(smollm2: Path):
    model = Model(smollm2)
    yield model
    model.close()


def _donated(model: Model, kv_type: str, prompt: list[int], budget_bytes: int) -> tuple[int, int, int]:
    """Donate `prompt` under `kv_type` into a cache of `budget_bytes`: (bytes of one page, K+V bytes of
    a token as the state reads them, pages held)."""
    pool, cache = create_kv_pool(model, PAGE, n_ctx_seq=512, n_streams=1, flash_attn="on",
                                 kv_types=(kv_type, kv_type), budget_bytes=budget_bytes)
    kv = KvManager(pool, cache)
    try:
        session = kv.new_session()
        kv.eval(session, prompt)
        state = SeqState(pool.ctx)
        state.read(session.seq)
        cache.insert(session, session.tokens)
        pool.end_session(session)
        stats = cache.stats()
        return stats.held_bytes // stats.held_pages, state.row_bytes, stats.held_pages
    finally:
        cache.release()
        pool.close()


def test_host_pages_shrink_as_the_type_says(smol: Model) -> None:
    """A page holds llama.cpp's rows as stored: q8_0 is 17/32 of f16's K and V bytes, q4_0 9/32, with
    the same 12 bytes of cell metadata per row. So a budget of 10 f16 pages keeps 18 pages of q8_0,
    all 21 pages of the prompt in q4_0."""
    prompt = [int(t) for t in np.random.default_rng(0).integers(100, 20000, 21 * PAGE + 1)]
    ptr = smol.ptr
    head_dim = llama_cpp.llama_model_n_embd(ptr) // llama_cpp.llama_model_n_head(ptr)
    row_f16 = 2 * 2 * llama_cpp.llama_model_n_layer(ptr) * llama_cpp.llama_model_n_head_kv(ptr) * head_dim  # K, V
    budget = 10 * PAGE * (12 + row_f16)
    sizes = {t: _donated(smol, t, prompt, budget) for t in BYTES_PER_ELEMENT}
    for kv_type, (page, row, _) in sizes.items():
        assert row == row_f16 / 2 * BYTES_PER_ELEMENT[kv_type]
        assert page == PAGE * (12 + row)
    assert {t: held for t, (_, _, held) in sizes.items()} == {"f16": 10, "q8_0": 18, "q4_0": 21}


def test_cache_on_equals_cache_off_under_q8_0(smollm2: Path) -> None:
    """Attached pages (and a stream kept in place) give what recomputing gives under q8_0. With a
    quantized cache llama.cpp's CPU kernel takes one path for every batch shape, so the tokens and
    their logprobs match exactly, not only the first token."""
    types = dict(cache_type_k="q8_0", cache_type_v="q8_0", flash_attn="on", ctx_size=512, parallel=2)
    questions = [f" Question {i}: tell me about topic number {i}." for i in range(3)]
    with engine(smollm2, prefix_cache=False, **types) as e:
        assert e.pool.ctx.flash_attn
        prompts = [e.model.tokenize(SYSTEM + q, add_special=True) for q in questions]
        scratch = [run_traced(e, [r])[r.id] for r in (greedy(p, max_tokens=4, logprobs=1) for p in prompts)]
    with engine(smollm2, **types) as e:
        first = greedy(prompts[0], max_tokens=4, logprobs=1)
        assert run_traced(e, [first])[first.id] == scratch[0]
        rest = [greedy(p, max_tokens=4, logprobs=1) for p in prompts[1:]]
        outs = run_traced(e, rest)
        assert all(r.state.cached_tokens >= 2 * PAGE for r in rest)  # kept in place, then attached pages
        assert [outs[r.id][0].token for r in rest] == [s[0].token for s in scratch[1:]]
        assert [outs[r.id] for r in rest] == scratch[1:]


def test_quantized_v_turns_flash_attention_on_under_auto(monkeypatch: pytest.MonkeyPatch, smollm2: Path) -> None:
    """As llama.cpp does (`enabling flash_attn since it is required for quantized V cache`): under
    `auto` a quantized V asks for flash attention on, the self-check only warning; the context says
    it is on; a quantized K alone changes nothing."""
    from conftest import settings

    asked: list[str] = []
    real = engine_module.choose_flash_attn
    monkeypatch.setattr(engine_module, "choose_flash_attn", lambda model, flash, *rest: asked.append(flash) or real(model, flash, *rest))
    engine_module.preflight(settings(smollm2, cache_type_v="q8_0"))
    engine_module.preflight(settings(smollm2, cache_type_k="q8_0"))  # a quantized K alone needs nothing
    assert asked == ["on"]
    model = Model(smollm2)
    try:
        ctx = Context(model, ContextParams(n_ctx_seq=256, n_batch=64, n_seq_max=1, n_threads=2, flash_attn="auto",
                                           type_k="q8_0", type_v="q8_0"))
        assert ctx.flash_attn
        ctx.close()
    finally:
        model.close()


def test_quantized_v_with_flash_attn_off_exits_2_with_one_line() -> None:
    done = subprocess.run([sys.executable, "-m", "kvserve", "--port", str(free_port()), "--cache-type-v", "q4_0",
                           "--flash-attn", "off"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "--cache-type-v q4_0 needs flash attention" in lines[0]

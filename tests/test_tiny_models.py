"""The generated tiny models load in llama.cpp and decode prompt-dependent text.

Uses llama.cpp's low-level API only, the way kvserve drives it.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import llama_cpp
import numpy as np
import pytest

from kvserve.testing.tiny_models import ARCHS, write_tiny_model

# (is_recurrent, is_hybrid) per arch.
MEMORY_KIND = {"llama": (False, False), "lfm2": (False, True), "mamba": (True, False), "gemma3": (False, False)}
PROMPTS = ("The capital of France is", "def fibonacci(n):")
N_GENERATE = 8
N_CTX = 256


@pytest.fixture(scope="module", autouse=True)
def _backend() -> None:
    llama_cpp.llama_backend_init()


@pytest.fixture(params=[*ARCHS, "gemma3"])
def model(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[str, llama_cpp.llama_model_p]]:
    arch = request.param
    path = write_tiny_model(arch, tmp_path / f"{arch}.gguf")
    loaded = llama_cpp.llama_model_load_from_file(os.fsencode(path), llama_cpp.llama_model_default_params())
    assert loaded, f"llama.cpp could not load {path}"
    yield arch, loaded
    llama_cpp.llama_model_free(loaded)


@pytest.fixture
def context(model: tuple[str, llama_cpp.llama_model_p]) -> Iterator[llama_cpp.llama_context_p]:
    params = llama_cpp.llama_context_default_params()
    params.n_ctx = N_CTX
    params.n_batch = N_CTX
    params.n_seq_max = 4
    params.kv_unified = True
    ctx = llama_cpp.llama_init_from_model(model[1], params)
    assert ctx
    yield ctx
    llama_cpp.llama_free(ctx)


def tokenize(vocab: llama_cpp.llama_vocab_p, text: str) -> list[int]:
    data = text.encode()
    # Byte-level BPE never yields more tokens than bytes, plus specials.
    buf = (llama_cpp.llama_token * (len(data) + 2))()
    n = llama_cpp.llama_tokenize(vocab, data, len(data), buf, len(buf), True, True)
    assert n > 0
    return list(buf[:n])


def fill_batch(batch: llama_cpp.llama_batch, tokens: list[int], pos: int, seq_id: int) -> None:
    """Put `tokens` at positions pos.. of `seq_id`, with logits for the last one only."""
    batch.n_tokens = len(tokens)
    for i, token in enumerate(tokens):
        batch.token[i] = token
        batch.pos[i] = pos + i
        batch.n_seq_id[i] = 1
        batch.seq_id[i][0] = seq_id
        batch.logits[i] = i == len(tokens) - 1


def greedy(
    ctx: llama_cpp.llama_context_p,
    batch: llama_cpp.llama_batch,
    n_vocab: int,
    prompt: list[int],
    seq_id: int,
) -> list[int]:
    """Decode `prompt` on `seq_id`, then N_GENERATE argmax tokens one at a time."""
    generated: list[int] = []
    tokens, pos = prompt, 0
    for _ in range(N_GENERATE):
        fill_batch(batch, tokens, pos, seq_id)
        assert llama_cpp.llama_decode(ctx, batch) == 0
        pos += len(tokens)
        logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(ctx, len(tokens) - 1), shape=(n_vocab,))
        tokens = [int(np.argmax(logits))]
        generated += tokens
    return generated


def test_tiny_model_loads_and_decodes(
    model: tuple[str, llama_cpp.llama_model_p], context: llama_cpp.llama_context_p
) -> None:
    arch, loaded = model
    assert (llama_cpp.llama_model_is_recurrent(loaded), llama_cpp.llama_model_is_hybrid(loaded)) == MEMORY_KIND[arch]

    template = llama_cpp.llama_model_chat_template(loaded, None)
    assert template and b"<|im_start|>" in template  # SmolLM2's ChatML template

    vocab = llama_cpp.llama_model_get_vocab(loaded)
    n_vocab = llama_cpp.llama_vocab_n_tokens(vocab)
    batch = llama_cpp.llama_batch_init(N_CTX, 0, 1)
    try:
        # One sequence per prompt, both in the same unified cache.
        outputs = [
            greedy(context, batch, n_vocab, tokenize(vocab, prompt), seq_id)
            for seq_id, prompt in enumerate(PROMPTS)
        ]
    finally:
        llama_cpp.llama_batch_free(batch)

    assert outputs[0] != outputs[1], "greedy continuation ignores the prompt"
    for generated in outputs:
        assert len(set(generated)) > 1, f"degenerate continuation {generated}"

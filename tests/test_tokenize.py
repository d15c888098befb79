"""Model.tokenize against one raw `llama_tokenize(..., parse_special=True)` call, and its cost.

llama.cpp splits a text on special-token spellings in time quadratic in their count; Model.tokenize
cuts such a text into pieces where llama.cpp's result cannot change (kvserve.llama.special_cuts).
Every test here compares its tokens with the raw call on the same text, on three vocabularies:
SmolLM2 and Qwen2.5-Coder (BPE) and Gemma 3 (SentencePiece, thousands of control and
user-defined tokens, whitespace runs among them).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import llama_cpp
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvserve.llama.chat_template import ChatTemplate
from kvserve.llama.model import Model
from kvserve.llama.special_cuts import SpecialCuts, TooManySpecialTokens

SPECIAL = (llama_cpp.LLAMA_TOKEN_ATTR_CONTROL | llama_cpp.LLAMA_TOKEN_ATTR_USER_DEFINED
           | llama_cpp.LLAMA_TOKEN_ATTR_UNKNOWN)


@pytest.fixture(scope="module", params=["smollm2", "gemma3", "qwen_coder"])
def model(request: pytest.FixtureRequest) -> Iterator[Model]:
    loaded = Model(request.getfixturevalue(request.param))
    yield loaded
    loaded.close()


def raw(model: Model, text: str, add_special: bool) -> list[int]:
    """One llama_tokenize call on the whole text: the reference."""
    data = text.encode("utf-8")
    capacity = 4 * len(data) + 16
    buf = (llama_cpp.llama_token * capacity)()
    n = llama_cpp.llama_tokenize(model.vocab, data, len(data), buf, capacity, add_special, True)
    assert n >= 0
    return list(buf[:n])


def specials(model: Model) -> list[str]:
    """The model's special spellings, sorted."""
    vocab = model.vocab
    return sorted({llama_cpp.llama_vocab_get_text(vocab, t).decode("utf-8", "replace")
                   for t in range(model.info.n_vocab) if llama_cpp.llama_vocab_get_attr(vocab, t) & SPECIAL})


def assert_same(model: Model, text: str) -> None:
    for add_special in (False, True):
        assert model.tokenize(text, add_special=add_special) == raw(model, text, add_special), repr(text[:300])


def conversation(n: int) -> list[dict[str, str]]:
    roles = ["user", "assistant"]
    text = "héllo  wörld 日本語 🙂\n\n  indented"
    return [{"role": roles[i % 2], "content": f"message {i}: {text}"} for i in range(n)]


def test_rendered_chats_tokenize_as_one_call(model: Model) -> None:
    template = ChatTemplate.from_model(model)
    for n in (1, 2, 7, 600, 3000):  # 3000 turns: thousands of markers, so many pieces
        assert_same(model, template.render(conversation(n)))


def test_markers_anywhere_tokenize_as_one_call(model: Model) -> None:
    names = specials(model)
    marker = "<start_of_turn>" if "<start_of_turn>" in names else "<|im_start|>"
    other = names[len(names) // 2]
    texts = [
        marker, marker * 3, f"{marker}x", f"x{marker}", f" {marker} ", f"  {marker}\n\n{marker}  ",
        f"word{marker}word", f"wo{marker}rd{other}s", f"{other}{marker}{other}", f"é{marker}日本{other}🙂",
        marker[:-1], marker[1:], f"{marker[:-1]}{marker}", f"{marker}{marker[1:]}", "\n" * 100, " " * 70,
        "".join(names), " ".join(names), "\n".join(names), "", "plain text only",
        (f"{marker} a\n" * 600) + "tail", (f"{other}\n\n\n" * 700) + ("\n" * 45 + "x") * 300,
    ]
    for text in texts:
        assert_same(model, text)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_mixes_of_markers_and_text_tokenize_as_one_call(model: Model, data: st.DataObject) -> None:
    names = specials(model)
    names = names[:30] + names[len(names) // 2:len(names) // 2 + 10] + names[-10:]
    bits = st.one_of(st.sampled_from(names), st.sampled_from([" ", "  ", "\n", "\n\n", "\t", "<", "|", ">", "_"]),
                     st.text(max_size=6))
    parts = data.draw(st.lists(bits, max_size=400))
    # repeated, so that most draws are long enough to be cut into pieces
    assert_same(model, "".join(parts) * data.draw(st.integers(1, 12)))


def test_a_text_of_many_markers_is_tokenized_in_bounded_pieces(smollm2: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The work is linear in the text: llama.cpp sees pieces that together are the text exactly
    and that each hold a bounded number of markers, whatever their total count."""
    model = Model(smollm2)
    text = "".join(f"<|im_start|>user\nmessage {i}<|im_end|>\n" for i in range(10_000))  # 20,000 markers
    expected = raw(model, text, True)
    seen: list[bytes] = []
    real = llama_cpp.llama_tokenize

    def spy(vocab, data, length, *args):
        seen.append(bytes(data[:length]))
        return real(vocab, data, length, *args)

    monkeypatch.setattr(llama_cpp, "llama_tokenize", spy)
    assert model.tokenize(text, add_special=True) == expected
    assert b"".join(seen) == text.encode()
    assert max(piece.count(b"<|im_") for piece in seen) <= 2 * 256
    model.close()


def test_a_cut_never_falls_inside_overlapping_spellings() -> None:
    """Where spellings overlap (runs of newlines, each run length its own token), a cut falls only
    after an occurrence no longer or equal one overlaps; past the limit the text is refused."""
    cuts = SpecialCuts.of([(b"\n" * k, False, False) for k in range(1, 4)] + [(b"<a>", False, False)])
    assert cuts is not None
    text = b"<a>x" * 300 + b"\n" * 5000
    pieces = list(cuts.pieces(text, every=4, limit=10_000))
    assert b"".join(pieces) == text
    assert all(piece.endswith(b"<a>") for piece in pieces[:-1])
    with pytest.raises(ValueError):
        list(cuts.pieces(b"\n" * 5000, every=4, limit=100))


def test_a_run_no_cut_divides_is_a_400(gemma3: Path) -> None:
    """Gemma 3 spells every run of up to 31 newlines as one token: a long run has no safe cut,
    and llama.cpp would split it quadratically. Model.tokenize refuses it; the API answers a 400."""
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from kvserve.server.errors import install_error_handlers

    model = Model(gemma3)
    text = "a" + "\n" * 200_000
    with pytest.raises(TooManySpecialTokens):
        model.tokenize(text, add_special=True)
    assert model.tokenize(text[:20_000], add_special=True) == raw(model, text[:20_000], True)
    model.close()

    app = FastAPI()
    install_error_handlers(app)

    @app.post("/v1/completions")
    def refuse() -> None:
        raise TooManySpecialTokens("over 4096 overlapping special-token spellings in a row")

    response = TestClient(app).post("/v1/completions")
    assert response.status_code == 400
    assert response.json()["error"]["type"] == "invalid_request_error"

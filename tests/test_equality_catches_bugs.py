"""The equality tests would catch a real batching or caching bug at once, in both attention modes:
each bug below is patched in, and the comparison with a request served alone must fail.

Each is a bug a batching scheduler or a prefix cache can really have, and each is invisible to a
request served alone, in a batch of its own. A wrong position, sequence id or mask makes llama.cpp
reject the batch (it checks that each sequence's positions continue), which fails the request and
so the test; a wrong logits row, or the cells of another chain at the right positions, passes
llama.cpp's checks and only the comparison of tokens and logprobs catches it.
"""

from __future__ import annotations

import llama_cpp
import numpy as np
import pytest

from equality import TINY_TOLERANCE, TOP, assert_like_alone
from kvserve.cache import PrefixKey, create_kv_pool
from kvserve.scheduler.kv_manager import KvManager
from kvserve.llama.batch import Batch
from kvserve.llama.model import Model
from kvserve.llama.seq_state import KvPage
from kvserve.llama.sampler import TokenLogprobs, token_logprobs
from test_batching import MODES, alone_and_together, assert_all_like_alone

PAGE = 16


class _Buggy(Batch):
    """A batch whose `add` misplaces what comes after the first sequence of a step."""

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.seqs: list[int] = []  # sequences in this step, in order

    def clear(self) -> None:
        super().clear()
        self.seqs = []

    def add(self, token: int, pos: int, seq: int, wants_logits: bool) -> int:
        if seq not in self.seqs:
            self.seqs.append(seq)
        return super().add(token, *self.misplace(pos, seq), wants_logits)

    def misplace(self, pos: int, seq: int) -> tuple[int, int]:
        raise NotImplementedError


class WrongPosition(_Buggy):
    """Positions counted from the batch, not the sequence, for a sequence that is not first."""

    def misplace(self, pos: int, seq: int) -> tuple[int, int]:
        return (pos + self.n_tokens if self.seqs.index(seq) else pos), seq


class WrongSequence(_Buggy):
    """Off by one slot: a token lands in the sequence of the slot before it."""

    def misplace(self, pos: int, seq: int) -> tuple[int, int]:
        slot = self.seqs.index(seq)
        return pos, self.seqs[slot - 1] if slot else seq


class LeakyMask(_Buggy):
    """Tokens of later sequences are also filed under the first one, so its attention sees them."""

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        llama_cpp.llama_batch_free(self._raw)
        self._raw = llama_cpp.llama_batch_init(capacity, 0, 2)

    def add(self, token: int, pos: int, seq: int, wants_logits: bool) -> int:
        i = super().add(token, pos, seq, wants_logits)
        if self.seqs[0] != seq:
            self._raw.n_seq_id[i] = 2
            self._raw.seq_id[i][1] = self.seqs[0]
        return i

    def misplace(self, pos: int, seq: int) -> tuple[int, int]:
        return pos, seq


class WrongLogitsRow(_Buggy):
    """Every sequence's logits are requested, but the scheduler reads each from the row before."""

    def add(self, token: int, pos: int, seq: int, wants_logits: bool) -> int:
        i = super().add(token, pos, seq, True)  # every row has logits, so a wrong one is still readable
        return i - 1 if wants_logits and self.seqs.index(seq) else i

    def misplace(self, pos: int, seq: int) -> tuple[int, int]:
        return pos, seq


@pytest.mark.parametrize("flash_attn", MODES)
@pytest.mark.parametrize("bug", [WrongPosition, WrongSequence, LeakyMask, WrongLogitsRow],
                         ids=lambda bug: bug.__name__)
def test_equality_fails_on_a_batching_bug(tiny, monkeypatch: pytest.MonkeyPatch, bug: type[Batch],
                                          flash_attn: str) -> None:
    monkeypatch.setattr("kvserve.scheduler.scheduler.Batch", bug)
    with pytest.raises(AssertionError):
        alone, together = alone_and_together(tiny("llama"), max_tokens=8, flash_attn=flash_attn)
        assert_all_like_alone(alone, together, flash_attn)


@pytest.mark.parametrize("flash_attn", MODES)
def test_the_same_comparison_passes_without_a_bug(tiny, flash_attn: str) -> None:
    alone, together = alone_and_together(tiny("llama"), max_tokens=8, flash_attn=flash_attn)
    assert_all_like_alone(alone, together, flash_attn)


def _traced_generate(kv: KvManager, session, tail: list[int], n: int) -> list[TokenLogprobs]:
    logits, out = kv.eval(session, tail), []
    for _ in range(n):
        step = token_logprobs(logits, int(np.argmax(logits)), TOP)
        out.append(step)
        logits = kv.eval(session, [step.token])
    return out


def _moved(page: KvPage, to: int) -> KvPage:
    """The page's rows filed at positions from `to` on (a cell's metadata starts with its i32 position)."""
    tables = tuple(t.copy() for t in page.tables)
    for t in tables:
        positions = t[:, :4].copy().view(np.int32)
        t[:, :4] = (positions + to - page.start).view(np.uint8)
    return KvPage(to, page.n_rows, tables)


MUTANTS = {
    "right": lambda pages, other: pages,
    "another chain's rows": lambda pages, other: other[: len(pages)],
    "rows of another offset": lambda pages, other: [pages[0], _moved(pages[2], PAGE), *pages[2:]],
}


@pytest.mark.parametrize("flash_attn", MODES)
@pytest.mark.parametrize("mutant", list(MUTANTS))
def test_attach_equality_fails_on_misplaced_rows(tiny, monkeypatch: pytest.MonkeyPatch, flash_attn: str,
                                                 mutant: str) -> None:
    """The prefix cache restores rows that are not the prompt's at their positions: llama.cpp cannot
    tell (positions continue), so only the comparison with a scratch run can."""
    model = Model(tiny("llama"))
    pool, cache = create_kv_pool(model, PAGE, n_ctx_seq=256, n_streams=2, n_batch=256, flash_attn=flash_attn)
    kv = KvManager(pool, cache)
    a, b = (model.tokenize(f"{name} " + "and so the story goes on " * 16, add_special=True)[:65]
            for name in ("Alice", "Bob"))
    for prompt in (a, b):
        session = kv.new_session()
        kv.eval(session, prompt)
        cache.insert(session, session.tokens)
        pool.end_session(session)
    pages_of_a = [cache.store.peek(node) for node in cache.tree.match(PrefixKey("", a), len(a))]
    real_attach = cache.rows.attach
    monkeypatch.setattr(cache.rows, "attach",
                        lambda seq, pages, n: real_attach(seq, MUTANTS[mutant](pages, pages_of_a), n))
    session = kv.new_session()
    assert kv.attach(session, PrefixKey("", b)) == 64
    attached = _traced_generate(kv, session, b[64:], 8)
    pool.end_session(session)
    monkeypatch.undo()
    scratch_session = kv.new_session()
    scratch = _traced_generate(kv, scratch_session, b, 8)
    pool.end_session(scratch_session)
    cache.release()
    pool.close()
    model.close()
    tolerance = None if flash_attn == "off" else TINY_TOLERANCE
    if mutant != "right":
        with pytest.raises(AssertionError):
            assert_like_alone(scratch, attached, tolerance)
    else:
        assert_like_alone(scratch, attached, tolerance)

"""A draft model (`--speculative draft --draft-model`) must not change results, on real llama.cpp:
SmolLM2-135M drafts for itself, so nearly every guess is accepted (greedy) and sampling rejects
some (the target samples, the draft guesses greedily): every path runs. Equality is
tests/equality.py's rule, as in tests/test_speculation.py. After every step the draft stream holds
no row that is not a prefix of its target sequence's tokens, and llama.cpp's positions in both
contexts say so."""

from __future__ import annotations

import logging
import os
from dataclasses import replace
from pathlib import Path

import pytest

from conftest import engine, run_traced
from equality import SMOLLM2_TOLERANCE, assert_like_alone
from kvserve.llama.sampler import SamplingParams
from kvserve.scheduler.kv_manager import KvManager
from kvserve.scheduler.request import FinishReason
from kvserve.scheduler.sampling import Sampling
from test_speculation import MAX_TOKENS, PROMPTS, SMALL
from test_speculation import request as text_request


def request(model, prompt: str, prompt_tokens: list[int] | None = None, **kw):
    r = text_request(model, prompt or " ", **kw)
    return r if prompt_tokens is None else replace(r, prompt=prompt_tokens)


def draft_engine(smollm2: Path, mode: str = "draft", **overrides):
    return engine(smollm2, **{"speculative": mode, "flash_attn": "off", "draft_model": smollm2, **SMALL, **overrides})


def by_choice(e, requests, check=None) -> dict[tuple[str, int], list]:
    """Each choice's logprobs, stepping until all requests end; `check(e)` after every step."""
    for r in requests:
        e.scheduler.submit(r)
    out: dict[tuple[str, int], list] = {}
    while e.scheduler.has_work():
        for output in e.scheduler.step():
            assert output.error is None, output.error
            for d in output.deltas:
                out.setdefault((output.request_id, d.index), []).extend(d.logprobs)
        if check is not None:
            check(e)
    return out


def served(smollm2: Path, mode: str, make, check=None) -> tuple[list[list], dict]:
    with draft_engine(smollm2, mode) as e:
        out = by_choice(e, make(e.model), check)
        stats = {name: (s.drafted, s.accepted) for name, s in e.scheduler.speculator.stats.items()}
    return [out[k] for k in sorted(out, key=lambda k: (int(k[0][1:]) if k[0][1:].isdigit() else 0, k[1]))], stats


def _greedy(m):
    return [request(m, p) for p in PROMPTS]


def _sampled(m):
    return [request(m, p, n=2, params=SamplingParams(temperature=0.9, top_k=40, seed=seed))
            for seed, p in enumerate(PROMPTS)]


def assert_sampled_alike(off: list[list], on: list[list]) -> None:
    """Seeded sampling: the same tokens until a draw lands within rounding of a boundary (as in
    tests/test_speculation.py), logprobs within the tolerance up to there."""
    same = 0
    for alone, spec in zip(off, on):
        assert spec[0].token == alone[0].token
        for a, t in zip(alone, spec):
            if a.token != t.token:
                break
            assert abs(a.logprob - t.logprob) <= SMOLLM2_TOLERANCE
            same += 1
    assert same >= sum(map(len, off)) // 2, "most sampled tokens are the same"


def positions_hold(e) -> None:
    """Target streams hold the accepted tokens; draft streams a prefix of them, and no rejected row."""
    draft, ctx = e.draft, e.pool.ctx
    for req in e.scheduler.running:
        for choice in req.state.choices:
            session = choice.session
            if session is None:
                continue
            seq, held = session.seq, draft.held[session.seq]
            assert ctx.seq_pos_max(seq) == session.n_past - 1
            assert len(held) <= session.n_past and held == choice.tokens[: len(held)], "a rejected row in the draft stream"
            assert draft.ctx.seq_pos_max(seq) == len(held) - 1
    for seq in range(e.pool.n_streams):
        held = draft.held[seq]
        assert held == e.pool.held(seq)[: len(held)]
        assert draft.ctx.seq_pos_max(seq) == len(held) - 1


@pytest.mark.parametrize("make", [_greedy, _sampled], ids=["greedy", "seeded-n2"])
def test_draft_model_equals_off(smollm2, make) -> None:
    off, _ = served(smollm2, "off", make)
    on, stats = served(smollm2, "draft", make, check=positions_hold)
    drafted, accepted = stats["draft"]
    assert accepted > 0
    if make is _greedy:
        for alone, spec in zip(off, on):
            assert_like_alone(alone, spec, SMOLLM2_TOLERANCE)
    else:
        assert accepted < drafted, "sampling rejects some greedy guesses: the cut path runs"
        assert_sampled_alike(off, on)


def test_stop_and_max_tokens_inside_an_accepted_run(smollm2) -> None:
    def texts(mode):
        with draft_engine(smollm2, mode) as e:
            out = {}
            for stop, max_tokens in ((["cherry, date"], 60), ([], 23)):
                r = request(e.model, PROMPTS[0], max_tokens=max_tokens, stop_strings=stop)
                e.scheduler.submit(r)
                text, tokens, reason = "", [], None
                while e.scheduler.has_work():
                    for output in e.scheduler.step():
                        for d in output.deltas:
                            text, tokens, reason = text + d.text, tokens + d.token_ids, d.finish_reason or reason
                    positions_hold(e) if e.draft else None
                out[(tuple(stop), max_tokens)] = (text, tokens, reason)
            stats = e.scheduler.speculator.stats.get("draft")
            return out, stats.accepted if stats else 0
    off, _ = texts("off")
    on, accepted = texts("draft")
    assert accepted > 0
    for out in (off, on):
        (text, _, reason), (_, tokens, length) = out[(("cherry, date",), 60)], out[((), 23)]
        assert "cherry, date" not in text and reason is FinishReason.STOP
        assert len(tokens) == 23 and length is FinishReason.LENGTH
    assert on == off


@pytest.mark.parametrize("bug", ["one_too_many", "draft_rows_left"])
def test_a_wrong_verifier_or_a_kept_draft_row_fails_these_tests(smollm2, monkeypatch: pytest.MonkeyPatch, bug: str) -> None:
    if bug == "one_too_many":
        real = Sampling.verify

        def verify(self, request, choice, row, draft, outputs):
            accepted = real(self, request, choice, row, draft, outputs)
            if accepted < len(draft) and choice.finish_reason is None:
                choice.tokens[-1] = draft[accepted]  # the rejected guess is taken as if accepted
            return accepted
        monkeypatch.setattr(Sampling, "verify", verify)
    else:
        real_commit = KvManager.commit

        def commit(self, choice, n_accepted, n_decoded=None):  # the draft stream's rejected rows stay
            draft, self.draft = self.draft, None
            try:
                real_commit(self, choice, n_accepted, n_decoded)
            finally:
                self.draft = draft
        monkeypatch.setattr(KvManager, "commit", commit)
    off, _ = served(smollm2, "off", _sampled)
    with pytest.raises(AssertionError) as failed:
        on, _ = served(smollm2, "draft", _sampled, check=positions_hold)
        assert_sampled_alike(off, on)
    if bug == "draft_rows_left":  # equality cannot see it (the next catch-up recomputes the rows); positions do
        assert str(failed.value).startswith("a rejected row in the draft stream")


def test_cancel_mid_draft_and_a_reused_stream(smollm2) -> None:
    """A cancelled request leaves no sequence and no draft row its stream does not hold; the next turn
    of a conversation placed in the same stream keeps its draft rows (its catch-up is the new tokens
    only), and another prompt placed there clears them."""
    with draft_engine(smollm2, parallel=1) as e:
        draft, stats = e.draft, e.scheduler.speculator.stats["draft"]
        first = request(e.model, PROMPTS[1], max_tokens=200)
        e.scheduler.submit(first)
        while stats.drafted == 0:
            e.scheduler.step()
            positions_hold(e)
        e.scheduler.abort(first.id)
        e.scheduler.step()
        assert not e.scheduler.running and e.pool.live_sessions == 0
        positions_hold(e)
        seq = 0
        kept = len(draft.held[seq])
        assert kept > len(first.prompt)
        turn = request(e.model, "", max_tokens=4,
                       prompt_tokens=list(e.pool.held(seq)) + e.model.tokenize(" more", add_special=False))
        before = draft.catchup_tokens
        by_choice(e, [turn], positions_hold)
        assert draft.catchup_tokens - before <= len(turn.prompt) - kept + 1 + 4, "only the new tokens caught up"
        other = request(e.model, PROMPTS[3], max_tokens=4)
        e.scheduler.submit(other)
        e.scheduler.step()
        positions_hold(e)
        assert draft.held[seq] == other.prompt[: len(draft.held[seq])]


def test_a_draft_model_of_another_vocabulary_is_refused(smollm2, tiny, capsys: pytest.CaptureFixture) -> None:
    """Same size, other special tokens (a tiny model with harmony's markers): exit 2, one line."""
    from kvserve.__main__ import main

    with pytest.raises(SystemExit) as exit_:
        main(["--model", str(smollm2), "--speculative", "draft", "--draft-model", str(tiny("llama", "harmony")),
              "--ctx-size", "512", "--parallel", "1"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "vocabulary differs" in err[0] and "<|channel|>" in err[0], err
    with pytest.raises(ValueError, match="vocabulary differs"):
        with draft_engine(smollm2, draft_model=tiny("llama", "harmony")):
            pass


def test_draft_needs_a_model_and_auto_does_not_load_one(smollm2, caplog: pytest.LogCaptureFixture) -> None:
    from kvserve.config import Settings

    with pytest.raises(ValueError, match="--draft-model"):
        Settings(model=smollm2, speculative="draft")
    with caplog.at_level(logging.WARNING, logger="kvserve"), draft_engine(smollm2, "auto") as e:
        assert e.draft is None and "draft" not in e.scheduler.speculator.describe()["drafters"]
        out = by_choice(e, [request(e.model, PROMPTS[2])])
        assert len(next(iter(out.values()))) == MAX_TOKENS
    assert any("is not loaded" in r.getMessage() for r in caplog.records)


def test_no_draft_context_where_the_target_cannot_cut_rows(smollm2, tiny) -> None:
    """A recurrent target: speculation is off (as without a draft model), and no draft context is made."""
    with engine(tiny("mamba"), speculative="draft", draft_model=smollm2, ctx_size=256, parallel=2) as e:
        assert e.draft is None and not e.scheduler.speculator.enabled


QWEN = Path(os.path.expanduser("~/.cache/kvserve/models"))
EDIT = ("<|im_start|>user\nRename the variable `total` to `acc` in this function and change nothing else:\n"
        "```python\ndef summarize(values):\n    total = 0\n    for v in values:\n        if v > 0:\n"
        "            total += v\n    return total\n```<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.slow
def test_qwen_half_b_drafting_for_one_and_a_half_b_equals_off() -> None:
    target, drafter = QWEN / "qwen2.5-coder-1.5b-instruct.gguf", QWEN / "qwen2.5-coder-0.5b-instruct.gguf"
    if not (target.is_file() and drafter.is_file()):
        pytest.skip("the Qwen pair is not assembled in ~/.cache/kvserve/models")
    results = {}
    for mode in ("off", "draft"):
        with engine(target, speculative=mode, draft_model=drafter, flash_attn="off", ctx_size=1024, parallel=2,
                    batch_size=256, threads=1) as e:
            r = request(e.model, "", max_tokens=48, prompt_tokens=e.model.tokenize(EDIT, add_special=False))
            results[mode] = run_traced(e, [r])[r.id]
            if mode == "draft":
                assert e.scheduler.speculator.stats["draft"].accepted > 0
    assert_like_alone(results["off"], results["draft"], SMOLLM2_TOLERANCE)

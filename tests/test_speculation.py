"""Speculative decoding must not change results: each drafter on equals off, on real llama.cpp
(SmolLM2), as tests/equality.py compares: the first token exactly, then each token's logprob within
the measured tolerance up to a near-tie. Not strict token equality, even with `--flash-attn off`:
a verified draft puts several rows of one sequence through the layers' matrix products, whose CPU
kernels round otherwise than for one row (logprobs moved by up to 0.09 over 12 SmolLM2 tokens, and
a near-tie flipped). The drafts must really be verified (the tests check that tokens were accepted
and rejected), and a verifier that accepts one token too many or leaves rejected rows in a stream
must fail them."""

from __future__ import annotations

import pytest

import numpy as np

from conftest import engine, run, run_choices, run_traced
from equality import SMOLLM2_TOLERANCE, TINY_TOLERANCE, TOP, assert_like_alone
from kvserve.cache.host_store import HostStore
from kvserve.cache.kv_pool import StreamPool
from kvserve.cache.page_cache import PageCache
from kvserve.llama.context import Context, ContextParams
from kvserve.llama.model import Model
from kvserve.llama.sampler import SamplingParams
from kvserve.scheduler.kv_manager import KvManager
from kvserve.scheduler.request import FinishReason, Request
from kvserve.scheduler.config import SchedulerConfig
from kvserve.scheduler.sampling import Sampling
from kvserve.scheduler.scheduler import Scheduler
from kvserve.scheduler.speculation import SpecConfig, SpecMode
from kvserve.scheduler.ubatch_cost import LEARNT, UbatchCost
from kvserve.testing import read_metrics, wait_until
from kvserve.testing.tiny_models import TINY_SWA

# Text that repeats (prompt lookup drafts well) and text that does not (drafts get rejected).
PROMPTS = [
    "apple, banana, cherry, date, elderberry, fig, grape, apple, banana, cherry, date, elderberry, fig,",
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n",
    "Once upon a time, in a land far away, there lived a dragon who loved to read books about",
    "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,",
]
# Text that repeats a phrase and departs from it: `auto`, which drafts only runs it saw come true,
# still has drafts rejected here.
PHRASES = "The cat sat on the mat. The dog sat on the log. The bird sat on the"
MAX_TOKENS = 20
SMALL = dict(ctx_size=512, parallel=4, batch_size=256, threads=1)  # engines that load fast
_ids = iter(range(10**9))


def request(model, prompt: str, max_tokens: int = MAX_TOKENS, params: SamplingParams | None = None, **kw) -> Request:
    return Request(id=f"s{next(_ids)}", prompt=model.tokenize(prompt, add_special=True),
                   params=params or SamplingParams(temperature=0.0), max_tokens=max_tokens,
                   logprobs=TOP, ignore_eos=True, **kw)


def served(smollm2, mode: str, flash_attn: str, make, rounds: int = 1, **overrides):
    """Each round's outputs for the requests `make(model)` builds, all submitted at once, and the
    speculator's counts per drafter. `auto` is told that extra tokens cost a step almost nothing
    (as where weights dominate), so that it drafts whatever is likely enough."""
    with engine(smollm2, speculative=mode, flash_attn=flash_attn, **{**SMALL, **overrides}) as e:
        e.scheduler.speculator.cost = _CheapTokens()
        results = [run_traced(e, make(e.model)) for _ in range(rounds)]
        stats = {name: (s.drafted, s.accepted) for name, s in e.scheduler.speculator.stats.items()}
    return [list(r.values()) for r in results], stats


class _CheapTokens(UbatchCost):
    """A step that costs about the same whatever its tokens and ubatches."""

    def step(self, sizes: list[int], keys: int = 0, bid: bool = False) -> float:
        return 0.05 + 0.0001 * sum(sizes)

    def observe(self, sizes: list[int], seconds: float, keys: int = 0) -> None:
        pass


@pytest.mark.parametrize("mode, flash_attn", [("ngram", "off"), ("auto", "on")])
def test_speculation_equals_off(smollm2, mode: str, flash_attn: str) -> None:
    make = lambda m: [request(m, p) for p in [*PROMPTS, PHRASES]]  # noqa: E731
    (off,), _ = served(smollm2, "off", flash_attn, make)
    (on,), stats = served(smollm2, mode, flash_attn, make)
    drafted, accepted = stats["ngram"]
    assert 0 < accepted < drafted, "the test must verify drafts, accepted and rejected ones"
    for alone, spec in zip(off, on):
        assert_like_alone(alone, spec, SMOLLM2_TOLERANCE)


def test_tree_drafts_what_followed_this_context_before(smollm2) -> None:
    """A regenerated answer: the second round drafts the first round's continuation from the page tree."""
    make = lambda m: [request(m, PROMPTS[2], max_tokens=30)]  # noqa: E731
    (off,), _ = served(smollm2, "off", "off", make)
    rounds, stats = served(smollm2, "tree", "off", make, rounds=2)
    assert stats["tree"][1] >= 20, "the second round's answer is the stored continuation"
    for result in rounds:
        assert_like_alone(off[0], result[0], SMOLLM2_TOLERANCE)


def test_recent_drafts_an_earlier_answer_to_the_same_question_in_another_context(smollm2) -> None:
    """The same code after another preamble: the page tree has nothing after this context, the
    namespace's recent answers have the first round's answer, and `auto` drafts it once watched."""
    preambles = iter(["Note: ", "Remark: "] * 3)
    make = lambda m: [request(m, next(preambles) + PROMPTS[1], max_tokens=24)]  # noqa: E731
    (first, second), _ = served(smollm2, "off", "off", make, rounds=2)
    rounds, stats = served(smollm2, "auto", "off", make, rounds=2)
    shared = [t.token for t in first[0]] == [t.token for t in second[0]]
    assert shared, "the two rounds must give the same answer for this test (SmolLM2, greedy: 25 tokens alike)"
    assert stats["recent"][1] >= 8 and stats["tree"][0] == 0, stats
    for alone, result in zip((first, second), rounds):
        assert_like_alone(alone[0], result[0], SMOLLM2_TOLERANCE)
    tenants = iter(["tenant-a", "tenant-b"])  # the second round asks as another tenant: nothing to draft
    make = lambda m: [request(m, next(preambles) + PROMPTS[1], max_tokens=24, namespace=next(tenants))]  # noqa: E731
    _, stats = served(smollm2, "auto", "off", make, rounds=2)
    assert stats["recent"] == (0, 0) and stats["tree"] == (0, 0)


def test_preemption_between_drafts_resumes_like_off(smollm2, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every 5th step finds no KV slot: the newest request gives its sequences back (what it
    accepted, donated) and resumes where it stopped, drafting again, with nothing lost or doubled."""
    from test_batching import no_slot_every

    make = lambda m: [request(m, p) for p in PROMPTS]  # noqa: E731
    (off,), _ = served(smollm2, "off", "off", make)
    with engine(smollm2, speculative="ngram", flash_attn="off", **SMALL) as e:
        no_slot_every(e, 5, monkeypatch)
        requests = make(e.model)
        together = run_traced(e, requests)
        assert e.scheduler.planner.preemptions > 0 and e.scheduler.speculator.stats["ngram"].accepted > 0
        assert e.pool.sessions == []
    for alone, r in zip(off, requests):
        assert_like_alone(alone, together[r.id], SMOLLM2_TOLERANCE)


def test_prediction_drafts_and_is_counted(smollm2) -> None:
    """OpenAI's Predicted Outputs: the predicted text drafts, and usage counts accepted and rejected tokens."""
    with engine(smollm2, speculative="ngram", flash_attn="off", **SMALL) as e:
        plain = request(e.model, PROMPTS[1], max_tokens=24)
        expected = run(e, [plain])[plain.id]
        prediction = expected[:10] + e.model.tokenize(" something else entirely", add_special=False) + expected[14:]
        predicted = request(e.model, PROMPTS[1], max_tokens=24, prediction=prediction)
        e.scheduler.submit(predicted)
        tokens, usage = [], None
        while usage is None:
            for output in e.scheduler.step():
                tokens += sum((d.token_ids for d in output.deltas), [])
                usage = output.usage
    assert tokens == expected
    assert usage.accepted_prediction_tokens >= 15
    assert usage.rejected_prediction_tokens >= 1


def test_sampled_output_follows_the_same_chain(smollm2) -> None:
    """Temperature > 0, penalties and logit_bias, seeded: the chain draws once per emitted token from
    the same logits (within rounding), so the same tokens come out until a draw lands within the
    rounding of a boundary between two tokens; up to there, logprobs agree within the tolerance."""
    def make(m):
        return [request(m, p, params=SamplingParams(temperature=0.9, top_k=40, seed=seed, frequency_penalty=0.3,
                                                    logit_bias={11: -2.0}))
                for seed, p in enumerate(PROMPTS)]
    (off,), _ = served(smollm2, "off", "off", make)
    (on,), stats = served(smollm2, "ngram", "off", make)
    assert stats["ngram"][1] > 0
    same = 0
    for alone, spec in zip(off, on):
        assert spec[0].token == alone[0].token
        for a, t in zip(alone, spec):
            if a.token != t.token:
                break
            assert abs(a.logprob - t.logprob) <= SMOLLM2_TOLERANCE
            same += 1
    assert same >= len(off) * MAX_TOKENS // 2, "most sampled tokens are the same"


def test_a_grammar_keeps_its_state(smollm2) -> None:
    grammar = 'root ::= "[" item ("," item)* "]"\nitem ::= "\\"a\\"" | "\\"b\\"" | "\\"ab\\""'
    make = lambda m: [request(m, 'A JSON list of strings: ["a","b","a","b","a","b",', max_tokens=40,  # noqa: E731
                              params=SamplingParams(temperature=0.0, grammar=grammar))]
    (off,), _ = served(smollm2, "off", "off", make)
    (on,), stats = served(smollm2, "ngram", "off", make)
    assert stats["ngram"][0] > 0
    assert_like_alone(off[0], on[0], SMOLLM2_TOLERANCE)


def test_stop_and_max_tokens_inside_an_accepted_run(smollm2) -> None:
    """Nothing after a stop string or past max_tokens reaches the client, though drafts ran past them."""
    def texts(mode):
        with engine(smollm2, speculative=mode, flash_attn="off", **SMALL) as e:
            out = {}
            for stop, max_tokens in ((["cherry, date"], 60), ([], 23)):
                r = request(e.model, PROMPTS[0], max_tokens=max_tokens, stop_strings=stop)
                e.scheduler.submit(r)
                text, tokens, reason, done = "", [], None, False
                while not done:
                    for output in e.scheduler.step():
                        for d in output.deltas:
                            text, tokens = text + d.text, tokens + d.token_ids
                            reason = d.finish_reason or reason
                        done = output.usage is not None
                out[(tuple(stop), max_tokens)] = (text, tokens, reason)
            stats = e.scheduler.speculator.stats.get("ngram")
            return out, stats.accepted if stats else 0
    off, _ = texts("off")
    on, accepted = texts("ngram")
    assert accepted > 0
    for out in (off, on):
        (text, _, reason), (_, tokens, length) = out[(("cherry, date",), 60)], out[((), 23)]
        assert "cherry, date" not in text and reason is FinishReason.STOP
        assert len(tokens) == 23 and length is FinishReason.LENGTH
    assert on == off  # greedy on a repeating list: no near-tie here


def test_positions_equal_the_accepted_length_after_every_step(smollm2) -> None:
    """llama_memory_seq_pos_max of every running sequence is its session's length - 1 after each
    step, drafts rejected or not; and an ended request's stream keeps only accepted tokens."""
    with engine(smollm2, speculative="ngram", flash_attn="off", **SMALL) as e:
        ctx = e.pool.ctx
        for r in [request(e.model, p) for p in PROMPTS]:
            e.scheduler.submit(r)
        rejected_steps = 0
        while e.scheduler.has_work():
            before = e.scheduler.speculator.stats["ngram"].drafted - e.scheduler.speculator.stats["ngram"].accepted
            e.scheduler.step()
            rejected_steps += e.scheduler.speculator.stats["ngram"].drafted - e.scheduler.speculator.stats["ngram"].accepted > before
            for req in e.scheduler.running:
                for choice in req.state.choices:
                    if choice.session is not None:
                        assert ctx.seq_pos_max(choice.session.seq) == choice.session.n_past - 1
                        assert list(choice.session.tokens) == choice.tokens[: choice.session.n_past]
        assert rejected_steps > 0
        for stream in e.pool.streams:  # what each finished sequence donated and kept: accepted tokens only
            assert ctx.seq_pos_max(stream.seq) == len(stream.resident) - 1


def test_n_choices_and_a_cancel_mid_draft(smollm2) -> None:
    with engine(smollm2, speculative="ngram", flash_attn="off", **SMALL) as e:
        r = request(e.model, PROMPTS[0], max_tokens=40, n=3,
                    params=SamplingParams(temperature=0.7, seed=5))
        other = request(e.model, PROMPTS[3], max_tokens=200)
        e.scheduler.submit(r)
        e.scheduler.submit(other)
        while e.scheduler.speculator.stats["ngram"].drafted == 0 or r in e.scheduler.running:
            e.scheduler.step()
        e.scheduler.abort(other.id)
        e.scheduler.step()
        assert not e.scheduler.running and e.pool.live_sessions == 0
        for stream in e.pool.streams:
            assert e.pool.ctx.seq_pos_max(stream.seq) == len(stream.resident) - 1


def test_a_cached_prompt_drafts_after_its_first_token_and_its_choices_fork(smollm2) -> None:
    """The same prompt again, with n=2: the cache holds all of it but its last token and the tree
    holds its answer. That token is evaluated undrafted, so the prompt's siblings fork from it (a
    draft there left them waiting for ever); drafts start with the first output token."""
    make = lambda m: [request(m, PROMPTS[2], max_tokens=30)]  # noqa: E731
    (off,), _ = served(smollm2, "off", "off", make)
    with engine(smollm2, speculative="tree", flash_attn="off", **SMALL) as e:
        run_traced(e, make(e.model))
        again = request(e.model, PROMPTS[2], max_tokens=30, n=2)
        outputs = run_choices(e, again, max_steps=100)
        assert e.scheduler.speculator.stats["tree"].accepted >= 20, "the answer is drafted from the tree"
        assert e.pool.live_sessions == 0
    assert sorted(outputs) == [0, 1]
    for choice in outputs.values():
        assert_like_alone(off[0], choice, SMOLLM2_TOLERANCE)


@pytest.mark.parametrize("bug", ["one_too_many", "rows_left"])
def test_a_wrong_verifier_fails_these_tests(smollm2, monkeypatch: pytest.MonkeyPatch, bug: str) -> None:
    """Accepting one draft token too many, or leaving rejected rows in the stream, breaks equality
    (or the decode)."""
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
        monkeypatch.setattr(KvManager, "commit", lambda self, choice, n, n_decoded=None: real_commit(self, choice, n))
    make = lambda m: [request(m, p) for p in PROMPTS]  # noqa: E731
    (off,), _ = served(smollm2, "off", "off", make)
    with pytest.raises(AssertionError):
        (on,), _ = served(smollm2, "ngram", "off", make)
        for alone, spec in zip(off, on):
            assert_like_alone(alone, spec, SMOLLM2_TOLERANCE)


@pytest.mark.parametrize("arch", ["mamba", "lfm2"])
def test_no_speculation_where_rows_cannot_be_cut(tiny, arch: str) -> None:
    """A recurrent state (Mamba; LFM2, a hybrid) cannot be cut back: speculation stays off there, and
    serving works as without it."""
    with engine(tiny(arch), speculative="auto", ctx_size=256, parallel=2) as e:
        assert not e.scheduler.speculator.enabled and not e.scheduler.speculator.describe()["drafters"]
        r = Request(id="m", prompt=[1, 5, 6, 7, 5, 6, 7, 5, 6], params=SamplingParams(temperature=0.0), max_tokens=8,
                    ignore_eos=True)
        assert len(run(e, [r])["m"]) == 8


# -- sliding windows: each cut asks the stream -------------------------------------------------------

SWA_PROMPT = 100
SWA_DRAFT = 240  # longer than a 256-cell sliding-window stream keeps beyond the window


def _swa_scheduler(model, mode: str, swa_full: bool) -> Scheduler:
    """The tiny gemma3 (window TINY_SWA) in two streams of 512 cells, plain attention. Without
    `swa_full` a stream keeps n_swa + n_ubatch sliding-window cells (256 once padded), so a verified
    draft of SWA_DRAFT tokens, split into 16-token ubatches, overwrites the window of a cut near
    its start; with it (llama.cpp's default, and kvserve's) the stream keeps every row."""
    ctx = Context(model, ContextParams(n_ctx_seq=512, n_batch=256, n_seq_max=2, n_threads=2, n_ubatch=16,
                                       flash_attn="off", swa_full=swa_full))
    cache = PageCache(ctx, 16, HostStore(64 << 20))
    config = SchedulerConfig(max_running=2, token_budget=256, max_seq_len=512)
    return Scheduler(StreamPool(ctx, on_end=cache.unlock), cache, config,
                     spec=SpecConfig(SpecMode(mode), draft_max=SWA_DRAFT))


def _swa_requests(expected: list[list[int]] | None) -> list[Request]:
    """Two greedy requests on random prompts; given the outputs without speculation, each predicts
    its own first two tokens, then SWA_DRAFT tokens it will not write."""
    rng = np.random.default_rng(7)
    requests = []
    for i in range(2):
        prompt = [int(t) for t in rng.integers(200, 40000, SWA_PROMPT)]
        wrong = [int(t) for t in rng.integers(200, 40000, SWA_DRAFT)]
        requests.append(Request(id=f"w{next(_ids)}", prompt=prompt, params=SamplingParams(temperature=0.0),
                                max_tokens=SWA_DRAFT + 40, logprobs=TOP, ignore_eos=True,
                                prediction=expected[i][:2] + wrong if expected else []))
    return requests


def _served_swa(model, mode: str, swa_full: bool, expected: list[list[int]] | None = None):
    """Each request's output, and the scheduler, after checking llama.cpp's positions after every
    step: each running stream holds its session's tokens and the window its next token attends."""
    scheduler = _swa_scheduler(model, mode, swa_full)
    ctx = scheduler.pool.ctx
    requests = _swa_requests(expected)
    for r in requests:
        scheduler.submit(r)
    out: dict[str, list] = {r.id: [] for r in requests}
    try:
        while scheduler.has_work():
            for output in scheduler.step():
                assert output.error is None, output.error
                out[output.request_id] += sum((d.logprobs for d in output.deltas), [])
            for choice in (c for r in scheduler.running for c in r.state.choices if c.session is not None):
                n = choice.session.n_past
                assert ctx.seq_pos_max(choice.session.seq) == n - 1
                assert ctx.seq_pos_min(choice.session.seq) <= max(0, n - TINY_SWA + 1), "the window is gone"
        return [out[r.id] for r in requests], scheduler
    finally:
        scheduler.release_all()
        scheduler.cache.release()
        scheduler.pool.close()


@pytest.fixture(scope="module")
def gemma(tiny):
    model = Model(tiny("gemma3"))
    yield model
    model.close()


@pytest.fixture(scope="module")
def swa_alone(gemma) -> list[list]:
    return _served_swa(gemma, "off", swa_full=True)[0]


@pytest.mark.parametrize("swa_full", [True, False], ids=["full-window-cache", "window-sized-cache"])
def test_sliding_window_speculation_equals_off(gemma, swa_alone, swa_full: bool) -> None:
    """Gemma 3's kind of model speculates: each rejected draft is cut where the stream still holds
    the window before the cut, and where the draft's decode overwrote it (a window-sized cache), the
    sequence is evaluated again; either way the output is the one without speculation."""
    expected = [[t.token for t in out] for out in swa_alone]
    on, scheduler = _served_swa(gemma, "ngram", swa_full, expected)
    stats = scheduler.speculator.stats["prediction"]
    assert 0 < stats.accepted < stats.drafted, "drafts must be verified, accepted and rejected ones"
    assert (scheduler.kv.recomputed > 0) is not swa_full, scheduler.kv.recomputed
    for alone, spec in zip(swa_alone, on):
        assert_like_alone(alone, spec, TINY_TOLERANCE)


def test_a_cut_where_the_window_is_gone_fails_these_tests(gemma, swa_alone, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(StreamPool, "can_cut", lambda self, seq, n: True)  # ignores pos_min
    expected = [[t.token for t in out] for out in swa_alone]
    with pytest.raises(AssertionError):
        on, _ = _served_swa(gemma, "ngram", False, expected)
        for alone, spec in zip(swa_alone, on):
            assert_like_alone(alone, spec, TINY_TOLERANCE)


def test_prediction_over_http_and_what_server_info_says(smollm2) -> None:
    """Chat's `prediction` drafts, usage reports it as OpenAI does, a malformed one is a 400 in
    OpenAI's error shape, and /server_info states what speculation does. The mode is `ngram`, which
    drafts a prediction whatever the step costs: whether `auto` drafts it is the machine's to decide
    (a busy box times a 16-token ubatch at 16 single ones, and rightly drafts nothing), and the
    tests of its pricing decide that on prices they set."""
    import httpx
    import openai

    from conftest import serve

    with serve(smollm2, speculative="ngram", **SMALL) as url:
        info = httpx.get(f"{url}/server_info").json()["speculative"]
        assert info["enabled"] and info["drafters"] == ["prediction", "ngram"]
        body = {"messages": [{"role": "user", "content": "Say: the quick brown fox jumps over the lazy dog"}],
                "max_tokens": 16, "temperature": 0}
        plain = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=300).json()
        text = plain["choices"][0]["message"]["content"]
        predicted = httpx.post(f"{url}/v1/chat/completions", json={
            **body, "prediction": {"type": "content", "content": [{"type": "text", "text": text}]}}, timeout=300).json()
        details = predicted["usage"]["completion_tokens_details"]
        assert predicted["choices"][0]["message"]["content"] == text
        assert details["accepted_prediction_tokens"] > 0
        assert plain["usage"]["completion_tokens_details"]["accepted_prediction_tokens"] == 0
        metrics = read_metrics(url)
        assert metrics.value("kvserve_spec_accepted_tokens_total", drafter="prediction") == \
            details["accepted_prediction_tokens"]
        metrics.value("kvserve_spec_dropped_drafts_total", drafter="ngram", reason="measured")  # on the page
        bad = httpx.post(f"{url}/v1/chat/completions", json={**body, "prediction": {"type": "file"}}, timeout=60)
        assert bad.status_code == 400 and bad.json()["error"]["type"] == "invalid_request_error"
        # streamed, a verified draft's tokens arrive in one chunk, and continuous usage says how many
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        chunks = list(client.chat.completions.create(
            model="default", stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True},
            prediction={"type": "content", "content": text}, **{**body, "max_tokens": 24}))
        counts = [c.usage.completion_tokens for c in chunks if c.choices]  # not the last, usage-only chunk
        assert counts[-1] == chunks[-1].usage.completion_tokens > plain["usage"]["completion_tokens"]
        assert max(b - a for a, b in zip(counts, counts[1:-1])) > 1  # before the last output's
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices).startswith(text)


def test_auto_learns_the_step_prices_while_it_serves(smollm2) -> None:
    """The table timed at start is a prior: the steps served price the sizes they use, and
    /server_info's `speculative` shows the live prices, the samples behind each, and the drafts
    dropped, by why."""
    with engine(smollm2, speculative="auto", **SMALL) as e:
        started = dict(e.scheduler.speculator.cost.table)
        run(e, [request(e.model, p) for p in [*PROMPTS, PHRASES]])
        info = e.scheduler.speculator.describe()
    learnt = [n for n, k in info["ubatch_samples"].items() if k >= LEARNT]
    assert learnt and any(info["ubatch_seconds"][n] != round(started.get(int(n), -1), 5) for n in learnt), info
    assert set(info["dropped_drafts"]["ngram"]) == {"unlikely", "priced", "measured"}

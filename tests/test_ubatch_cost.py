"""The step cost model, without a model: prices by ubatch size learnt from the steps the engine
runs, the table timed at start only their prior, robust to a slow step and to a poisoned start.
That table is timed while the engine idles, a size at a time, not while the server loads: `auto`
drafts nothing until the sizes a step needs are priced, and the last tests check, on SmolLM2, that
a server is healthy before any timing and that idling fills the table."""

from __future__ import annotations

import asyncio
import logging
import math
import random
import threading
import time

import httpx

from conftest import engine, run
from conftest import serve as serving
from kvserve.cache.prefix_key import PrefixKey
from kvserve.llama.sampler import SamplingParams
from kvserve.scheduler.drafters import Sequence
from kvserve.llama.context import ABORTED, Context, DecodeError
from kvserve.scheduler.request import Request
from kvserve.scheduler.scheduler import PATIENCE, QUIET
from kvserve.testing.processes import wait_until
from kvserve.scheduler.speculation import Evidence, SpecConfig, SpecMode, Speculator, SpecState
from kvserve.scheduler.ubatch_cost import CALIBRATION_SIZES, LEARNT, WINDOW, UbatchCost

# A 1.5B's ubatches on 2 cores (seconds by tokens), and what each key its tokens read costs.
HONEST = {1: 0.064, 2: 0.100, 3: 0.124, 4: 0.131, 8: 0.260, 12: 0.318, 16: 0.313, 32: 0.580}
PER_KEY = 1e-6


def honest(sizes: list[int], keys: int) -> float:
    return sum(HONEST[n] for n in sizes) + PER_KEY * keys


def serve(cost: UbatchCost, steps: list[tuple[list[int], int]], rounds: int) -> None:
    for _ in range(rounds):
        for sizes, keys in steps:
            cost.observe(sizes, honest(sizes, keys), keys)


def close(a: float, b: float, within: float = 0.05) -> bool:
    return abs(a - b) <= within * b


def test_ubatch_cost_interpolates_and_extends_the_timed_sizes() -> None:
    cost = UbatchCost({1: 0.06, 4: 0.12, 8: 0.24, 16: 0.30})
    assert abs(cost.ubatch(2) - 0.08) < 1e-9 and abs(cost.ubatch(12) - 0.27) < 1e-9
    assert abs(cost.ubatch(20) - (0.30 + 4 * 0.06 / 8)) < 1e-9  # the last two sizes' slope
    assert abs(cost.step([4, 16]) - 0.42) < 1e-9 and cost.per_key == 0


def test_a_poisoned_start_is_overruled_by_honest_steps() -> None:
    """One size timed 10x too slow at start (a busy first minute), then honest steps: within a few
    steps of that size its price is honest, and no other size's price moved for it."""
    cost = UbatchCost({**HONEST, 12: 10 * HONEST[12]})
    steps = [([1], 300), ([4], 1200), ([12], 3000), ([16], 4000)]
    serve(cost, steps, rounds=LEARNT)
    assert close(cost.ubatch(12), HONEST[12]), cost.entries()
    for n in (1, 4, 16, 2, 3, 8, 32):  # learnt, or priced at their start-up timing
        assert close(cost.ubatch(n), HONEST[n]), (n, cost.entries())
    assert cost.entries()[12] == (cost.ubatch(12), LEARNT)


def test_a_start_timed_on_a_busy_machine_is_repriced_everywhere() -> None:
    """Every size timed 3x too slow: the learnt sizes' prices are honest, and a size never seen since
    start is priced at its timing times what the learnt sizes measured against theirs."""
    cost = UbatchCost({n: 3 * t for n, t in HONEST.items()})
    serve(cost, [([1], 300), ([4], 1200), ([16], 4000), ([8], 2000)], rounds=2 * LEARNT)
    for n in HONEST:
        assert close(cost.ubatch(n), HONEST[n], within=0.1), (n, cost.entries())
    assert close(cost.step([2, 32], 5000), honest([2, 32], 5000), within=0.1)


def test_a_size_nothing_samples_is_never_priced_above_a_larger_one() -> None:
    """Sizes timed 15x too slow at start that no step samples (nothing drafts at such a price, so
    nothing would ever correct it): each costs no more than the next larger size's price, learnt or
    timed; with the cap removed (a mutation) they keep their poisoned prices and this fails."""
    cost = UbatchCost({**HONEST, 4: 15 * HONEST[4], 12: 15 * HONEST[12], 16: 15 * HONEST[16]})
    serve(cost, [([1], 300), ([8], 2000)], rounds=LEARNT)
    assert cost.ubatch(4) <= cost.ubatch(8) and close(cost.ubatch(4), HONEST[8], within=0.1), cost.entries()
    assert cost.ubatch(12) <= cost.ubatch(32) and close(cost.ubatch(16), HONEST[32], within=0.1), cost.entries()
    assert cost.entries()[4][1] == 0  # priced from a larger size, not from samples of its own


def test_one_slow_step_moves_no_price() -> None:
    cost = UbatchCost(HONEST)
    serve(cost, [([4], 1000)], rounds=WINDOW)
    learnt = cost.ubatch(4)
    cost.observe([4], 10 * honest([4], 1000), 1000)  # the machine stalled for one step
    assert cost.ubatch(4) == learnt


def test_a_size_is_not_priced_from_one_sample_of_its_own() -> None:
    cost = UbatchCost(HONEST)
    for _ in range(LEARNT - 1):
        cost.observe([3], 10 * HONEST[3])
    assert cost.ubatch(3) == HONEST[3] and cost.entries()[3] == (HONEST[3], LEARNT - 1)


def test_a_step_of_several_sizes_teaches_the_one_not_learnt() -> None:
    """A drafting sequence beside plain ones: [8, 16] once 8 is learnt is a sample of 16 (what 8's
    price leaves); [2, 3] with neither learnt teaches neither."""
    cost = UbatchCost({**HONEST, 16: 5 * HONEST[16]})
    serve(cost, [([8], 0)], rounds=LEARNT)
    serve(cost, [([8, 16], 0)], rounds=LEARNT)
    assert close(cost.ubatch(16), HONEST[16])
    serve(cost, [([2, 3], 0)], rounds=WINDOW)
    assert 2 not in cost.samples and 3 not in cost.samples


def test_the_price_of_attention_is_learnt_beside_the_sizes() -> None:
    """Timed in an empty stream, the table misses what each token's attention to its context costs:
    the steps teach a price per key read, and each size's price is what is left."""
    cost = UbatchCost(HONEST)
    steps = [([1], 100), ([1], 20000), ([8], 8000), ([8], 40000), ([4, 16], 3000), ([16], 20000), ([16], 60000)]
    serve(cost, steps, rounds=100)
    assert close(cost.per_key, PER_KEY, within=0.05)
    for n in (1, 4, 8, 16):
        assert close(cost.ubatch(n), HONEST[n]), (n, cost.entries())
    assert close(cost.step([8], 8000), honest([8], 8000), within=0.02)



def test_prices_and_the_key_price_do_not_feed_on_each_other() -> None:
    """Served as a server serves: 1 to 16 users with contexts of their own, a fifth of them drafting
    (a ubatch apart), every step 10% noisy. The price per key stays near the truth and each size's
    price honest; a fit of the keys on the learnt prices (the earlier design) drifted to 10x the
    price per key and priced a 4-token ubatch at 40% of its cost."""
    rng = random.Random(7)
    per_key = 5e-6
    cost = UbatchCost(HONEST)
    for _ in range(60):
        users = rng.choice([1, 4, 8, 16])
        contexts = [rng.randint(50, 400) for _ in range(users)]
        for t in range(64):
            tokens = [5 if rng.random() < 0.2 else 1 for _ in range(users)]
            sizes = [sum(run) for run in _runs(tokens)]
            if any(n not in HONEST for n in sizes):
                continue
            keys = sum(n * (c + t + n) for n, c in zip(tokens, contexts))
            cost.observe(sizes, (sum(HONEST[n] for n in sizes) + per_key * keys) * rng.lognormvariate(0, 0.1), keys)
    assert cost.per_key <= 2 * per_key, cost.per_key
    for n in (1, 4, 8, 16):
        assert close(cost.ubatch(n), HONEST[n], within=0.25), (n, cost.entries())


def _runs(tokens: list[int]) -> list[list[int]]:
    """Adjacent streams with equal token counts: llama.cpp's ubatches of a step."""
    out: list[list[int]] = []
    for n in tokens:
        if out and out[-1][0] == n:
            out[-1].append(n)
        else:
            out.append([n])
    return out

# -- the start-up table, timed while the engine idles -------------------------------------------------

def test_sizes_to_time_are_unpriced_until_timed_smallest_first() -> None:
    """A step prices without end while a size of it is neither timed nor learnt; the first timing
    replaces the guess, each one after joins it; a size that could not be timed is not asked again."""
    cost = UbatchCost(to_time=CALIBRATION_SIZES)
    assert cost.next_to_time() == 1 and math.isinf(cost.step([1]))
    cost.add_timings([1], {1: 0.05})
    assert cost.table == {1: 0.05} and cost.step([1]) == 0.05 and cost.step([1, 1]) == 0.1
    assert math.isinf(cost.step([1, 2])) and cost.next_to_time() == 2
    cost.add_timings([2], {})  # the context could not time it: priced from its neighbours, never asked again
    assert cost.next_to_time() == 3 and cost.priced(2) and 2 not in cost.table
    for n in CALIBRATION_SIZES[2:]:
        assert not cost.priced(n)
        cost.add_timings([n], {n: HONEST.get(n, 0.01 * n)})
    assert cost.next_to_time() is None and not cost.untimed
    assert close(cost.step([7]), (HONEST.get(6, 0.06) + HONEST[8]) / 2, within=1e-9)  # between two timed sizes
    assert cost.step([200]) > cost.step([64])  # beyond the last: the last two's slope, as timed at start


def test_a_size_between_timed_ones_is_priced_once_its_neighbours_are() -> None:
    cost = UbatchCost(to_time=(1, 4, 8))
    cost.add_timings([1], {1: 0.06})
    cost.add_timings([4], {4: 0.12})
    assert cost.priced(3) and not cost.priced(5) and not cost.priced(100)
    cost.add_timings([8], {8: 0.24})
    assert cost.priced(5) and cost.priced(100) and close(cost.step([6]), 0.18, within=1e-9)


def test_served_steps_price_a_size_before_its_timing_and_skip_it() -> None:
    """A size the served steps learnt is priced, and the idle timing passes it by; a later timing of
    other sizes keeps the learnt price, and re-measures the load against the new prior."""
    cost = UbatchCost(to_time=CALIBRATION_SIZES)
    serve(cost, [([1], 0)], rounds=LEARNT)
    assert cost.priced(1) and 1 not in cost.untimed and cost.next_to_time() == 2
    assert close(cost.ubatch(1), HONEST[1])
    cost.add_timings([2], {2: HONEST[2] / 2})  # timed on a quiet moment: half what steps now take
    assert close(cost.ubatch(1), HONEST[1]) and close(cost.ubatch(2), HONEST[2] / 2)
    cost.add_timings([4], {4: HONEST[4] / 2})
    serve(cost, [([4], 0)], rounds=LEARNT)
    assert close(cost.ubatch(2), HONEST[2], within=0.1), cost.entries()  # the load the learnt sizes measured


def test_auto_drafts_nothing_until_its_step_is_priced() -> None:
    """A prediction that is sure to be accepted: while the table is untimed, `auto` drafts none of it
    (the undrafted step has no price either); with the sizes timed, it drafts."""
    speculator = Speculator(SpecConfig(SpecMode.AUTO, draft_max=8), None, can_cut=True)
    assert speculator.cost.untimed == set(CALIBRATION_SIZES)
    assert speculator.describe()["ubatch_to_time"] == list(CALIBRATION_SIZES)

    def drafted() -> int:
        state = SpecState(Sequence(list(range(40)), 40, prediction=list(range(40, 80))))
        state.evidence["prediction"] = Evidence(1000, 1000)
        return len(speculator.choose([(state, 30)], n_other=0)[0][0])

    assert drafted() == 0
    while (n := speculator.cost.next_to_time()) is not None:
        speculator.cost.add_timings([n], {n: 0.05 + 0.0005 * n})  # weights dominate: drafts are nearly free
    assert drafted() == 8 and speculator.describe()["ubatch_to_time"] == []


def test_auto_tries_a_size_its_start_priced_too_high_and_drafts_at_its_learnt_price() -> None:
    """Sizes 6 and up timed 1.5x too slow at start, then honest steps, one sure prediction: at its
    start-up prices `auto` would draft 4 tokens (a ubatch of 5) for ever, since nothing samples a
    size it never drafts at. Bid low until tried, 17 is tried, learnt honest and kept, the
    draft an honest table picks; with sizes bid at their price (a mutation) this fails."""
    honest = {n: 0.03 + 0.015 * n for n in range(1, 65)}
    speculator = Speculator(SpecConfig(SpecMode.AUTO, draft_max=16), None, can_cut=True)
    speculator.cost.calibrate({n: t * (1.5 if n >= 6 else 1.0) for n, t in honest.items()})

    def drafted() -> int:
        state = SpecState(Sequence(list(range(40)), 40, prediction=list(range(40, 80))))
        state.evidence["prediction"] = Evidence(1000, 1000)
        return len(speculator.choose([(state, 30)], n_other=0)[0][0])

    first = drafted()
    chosen = []
    for _ in range(4 * LEARNT):
        k = drafted()
        chosen.append(k)
        speculator.timed([1 + k], honest[1 + k], 0, [])
    assert chosen[-1] == 16 and speculator.cost.ubatch(17) == honest[17], (first, chosen, speculator.cost.entries())
    assert speculator.cost.entries()[17][1] >= LEARNT

    neutral = UbatchCost({n: t * (1.5 if n >= 6 else 1.0) for n, t in honest.items()})
    assert min(range(1, 18), key=lambda n: neutral.ubatch(n) / n) == 5  # what its start priced best


SMALL = dict(ctx_size=512, parallel=4, batch_size=256, threads=1)


def _request(model, prompt: str) -> Request:
    return Request(id=f"u{time.monotonic_ns()}", prompt=model.tokenize(prompt, add_special=True),
                   params=SamplingParams(temperature=0.0), max_tokens=4, ignore_eos=True)


def test_an_auto_engine_loads_without_timing_and_idles_the_table_in(smollm2) -> None:
    """Loading times nothing; an idle call times every size still to time, in one stream it borrows:
    here the one stream of `--parallel 1`, which a finished request left its rows in. The stream gets
    back what the cache holds of them, so the conversation's next turn continues in place, and
    generates what it generates from scratch."""
    story = "The cat sat on the mat, and the dog lay by the door. " * 12
    with engine(smollm2, speculative="auto", **{**SMALL, "parallel": 1}) as e:
        cost, ctx = e.scheduler.speculator.cost, e.pool.ctx
        assert cost.untimed == set(CALIBRATION_SIZES) and cost.table == UbatchCost().table
        run(e, [_request(e.model, story)])
        held = e.pool.held(0)
        assert ctx.seq_pos_max(0) == len(held) - 1 > 100  # its rows stay for a next turn
        assert cost.untimed == set(CALIBRATION_SIZES) - {1}  # its steps, one token each, priced size 1
        before = e.scheduler.kv.stats()
        e.scheduler.idle()
        assert set(cost.table) == set(CALIBRATION_SIZES) - {1} and all(t > 0 for t in cost.table.values())
        assert cost.table[64] > cost.table[2] and not e.scheduler.wants_idle()
        back = e.pool.held(0)
        assert back == held[: len(back)] and len(back) >= len(held) - 32, (len(back), len(held))
        assert ctx.seq_pos_max(0) == len(back) - 1 and e.pool.sessions == []
        prompt = held + e.model.tokenize(" Then the cat", add_special=False)

        def turn(name: str) -> Request:
            return Request(id=name, prompt=prompt, params=SamplingParams(temperature=0.0), max_tokens=8, ignore_eos=True)

        reuses, kept = e.pool.inplace_reuses, e.pool.inplace_tokens
        continued = run(e, [turn("turn")])["turn"]
        assert e.pool.inplace_reuses == reuses + 1 and e.pool.inplace_tokens - kept >= len(back) - 1
        after = e.scheduler.kv.stats()  # the next turn counted once, the attach back not as a prompt's
        assert after.queried_tokens - before.queried_tokens == len(prompt)
        assert after.hit_tokens - before.hit_tokens == e.pool.inplace_tokens - kept
    with engine(smollm2, speculative="off", prefix_cache=False, **{**SMALL, "parallel": 1}) as alone:
        assert run(alone, [turn("alone")])["alone"] == continued


def test_a_stream_given_back_after_a_timing_keeps_its_namespace(smollm2) -> None:
    """The rows an idle timing gives back are the stream's own namespace's, and stay so: its tenant's
    next turn keeps them in place, another tenant's identical prompt does not."""
    story = "The cat sat on the mat, and the dog lay by the door. " * 12
    with engine(smollm2, speculative="auto", **{**SMALL, "parallel": 1}) as e:
        prompt = e.model.tokenize(story, add_special=True)
        run(e, [Request(id="a", prompt=prompt, params=SamplingParams(temperature=0.0), max_tokens=4,
                        ignore_eos=True, namespace="tenant:a")])
        e.scheduler.idle()
        assert not e.scheduler.wants_idle()
        back = e.pool.resident_key(0)
        assert back is not None and back.namespace == "tenant:a" and len(back.tokens) > 100
        assert e.pool.resident_match(PrefixKey("tenant:a", prompt + [13])) >= len(back.tokens) - 1
        assert e.pool.resident_match(PrefixKey("tenant:b", prompt + [13])) == 0
        assert e.pool.resident_match(PrefixKey("", prompt + [13])) == 0


def test_a_request_arriving_during_a_timing_ends_the_decode_it_finds(smollm2, monkeypatch, caplog) -> None:
    """A request that comes while the engine idles a size in ends the timing within the decode it
    finds (llama.cpp's abort callback asks between the graph's nodes): it waits for one node, not a
    decode (a 64-token one of a 1.5B takes over a second). The size stays to time, the borrowed
    stream is left empty, and a later idle times again. llama.cpp's error lines for the aborted
    decode are not a server's warnings."""
    with engine(smollm2, speculative="auto", **SMALL) as e:
        cost, ctx = e.scheduler.speculator.cost, e.pool.ctx
        n = cost.next_to_time()
        decodes, aborted = [], []
        real = type(ctx).decode

        def arriving(self, batch) -> None:  # the request comes as the timing's first decode starts
            decodes.append(batch.n_tokens)
            if len(decodes) == 1:
                e.scheduler.submit(_request(e.model, "The cat sat on the"))
            try:
                real(self, batch)
            except DecodeError as error:
                aborted.append(error.code)
                raise

        monkeypatch.setattr(type(ctx), "decode", arriving)
        with caplog.at_level(logging.DEBUG, logger="kvserve.llama"):
            e.scheduler.idle()
        monkeypatch.setattr(type(ctx), "decode", real)
        assert decodes == [1] and aborted == [ABORTED], (decodes, aborted)  # its warm-up, ended early
        said = [r for r in caplog.records if r.name == "kvserve.llama"]
        assert any("failed to compute graph" in r.getMessage() for r in said), said  # llama.cpp said so
        assert all(r.levelno == logging.DEBUG for r in said), said
        assert n in cost.untimed and cost.table == UbatchCost().table  # nothing timed: the guess stands
        assert all(ctx.seq_pos_max(s) == -1 for s in range(4)) and e.scheduler.has_work()
        while e.scheduler.has_work():  # it is served
            assert all(o.error is None for o in e.scheduler.step())
        e.scheduler.idle()  # timed now (or learnt from the request's steps, and the next size timed)
        assert n not in cost.untimed and cost.table != UbatchCost().table


def _first_decode_held(monkeypatch, ctx, until) -> tuple[list[int], list[int]]:  # noqa: ANN001
    """`ctx`'s decodes recorded (each batch's tokens, each abort's code), the first one held until
    `until()` (10 s at most): what happens meanwhile happens during that decode."""
    decodes: list[int] = []
    aborted: list[int] = []
    real = type(ctx).decode

    def held(self, batch) -> None:  # noqa: ANN001
        decodes.append(batch.n_tokens)
        deadline = time.monotonic() + 10
        while len(decodes) == 1 and not until() and time.monotonic() < deadline:
            time.sleep(0.01)
        try:
            real(self, batch)
        except DecodeError as error:
            aborted.append(error.code)
            raise

    monkeypatch.setattr(type(ctx), "decode", held)
    return decodes, aborted


def test_stopping_the_engine_ends_the_timing_it_finds(smollm2, monkeypatch) -> None:
    """An engine stopped while it idles a size in (a model unloaded to make room for another) ends
    the timing within the decode it finds, as a request does; the unload once waited for every size
    left to time, 6 s in one swap to a 0.5B. A mutation that does not tell the scheduler it stops
    times every size before the engine's thread ends."""
    with engine(smollm2, speculative="auto", **SMALL) as e:
        decodes, aborted = _first_decode_held(monkeypatch, e.pool.ctx, lambda: e.scheduler.stopping)

        async def start_then_stop() -> None:
            e.async_engine.start()
            while not decodes:  # the engine idles a size in
                await asyncio.sleep(0.01)
            await e.async_engine.stop()

        asyncio.run(start_then_stop())
        assert decodes == [1] and aborted == [ABORTED], (decodes, aborted)


def test_a_call_for_the_engine_thread_ends_the_timing_it_finds(smollm2, monkeypatch) -> None:
    """A call queued behind an idle timing (a cache view, a router's prefix match) ends the timing
    within the decode it finds, as a request does, and runs: it once waited for every size left to
    time (6-7 s after a 0.5B's load)."""
    with engine(smollm2, speculative="auto", **SMALL) as e:
        queued = threading.Event()
        decodes, aborted = _first_decode_held(monkeypatch, e.pool.ctx, queued.is_set)

        async def scenario() -> str:
            e.async_engine.start()
            while not decodes:  # the engine idles a size in
                await asyncio.sleep(0.01)
            call = asyncio.ensure_future(e.async_engine.call(lambda: "answered"))
            await asyncio.sleep(0.05)  # submitted
            queued.set()
            answer = await call
            seen = list(decodes)
            await e.async_engine.stop()
            return answer, seen

        answer, seen = asyncio.run(scenario())
        # answered after the aborted decode, before any size was timed (the timing may start again after it)
        assert answer == "answered" and len(seen) <= 2 and aborted[:1] == [ABORTED], (seen, aborted)


def test_a_call_cancelled_before_it_ran_is_not_left_waiting(smollm2) -> None:
    """A call whose caller leaves while it still queues (a stall watch's timed-out describe, a client
    gone) never runs: it must not count as waiting, or every later idle timing would give up at once
    and the engine loop would spin on it (a review found the count one high for good)."""
    with engine(smollm2, speculative="off", **SMALL) as e:
        scheduler = e.scheduler

        async def scenario() -> tuple[int, int]:
            busy = asyncio.ensure_future(e.async_engine.call(lambda: time.sleep(0.3)))
            await asyncio.sleep(0.05)  # the engine thread runs it
            queued = asyncio.ensure_future(e.async_engine.call(lambda: "never"))
            await asyncio.sleep(0.05)
            queued.cancel()
            await asyncio.gather(busy, queued, return_exceptions=True)
            await e.async_engine.call(lambda: None)
            return scheduler.calls_submitted, scheduler.calls_started

        submitted, started = asyncio.run(scenario())
        assert submitted == started == 2, (submitted, started)


def test_a_timing_waits_until_the_engine_has_served_nothing_for_a_moment(smollm2, monkeypatch) -> None:
    """Requests come in bursts: once one ends, no ubatch timing starts before the engine has served
    nothing for QUIET seconds (one started at once would hold the next request for its decode); the
    table still fills while the server idles."""
    starts: list[float] = []
    real = Context.time_ubatches

    def slow(self, sizes, **kwargs):  # each timing a little longer, so that some are left after the request
        starts.append(time.monotonic())
        time.sleep(0.05)
        return real(self, sizes, **kwargs)

    monkeypatch.setattr(Context, "time_ubatches", slow)
    with serving(smollm2, speculative="auto", **SMALL) as url:
        wait_until(lambda: starts, 60, "a first timing")
        reply = httpx.post(f"{url}/v1/completions", json={"prompt": "Say hi", "max_tokens": 4}, timeout=120)
        ended = time.monotonic()
        assert reply.status_code == 200
        wait_until(lambda: not httpx.get(f"{url}/server_info", timeout=10).json()["speculative"]["ubatch_to_time"],
                   120, "the table timed")
    after = [t for t in starts if t > ended]
    assert after, starts  # sizes were left to time after the request
    assert after[0] - ended >= QUIET - 0.2, (after[0] - ended, QUIET)


def test_past_its_first_seconds_the_engine_times_in_any_gap_a_stream_is_empty_for(smollm2) -> None:
    """The quiet second is asked only in the engine's first PATIENCE seconds, while a stream is empty:
    a server busy from its start still times its sizes between requests. Where every stream holds an
    idle conversation's rows (`--parallel 1`), the timing still waits for it: a request in a short gap
    would find its rows borrowed and restore them instead of continuing in place."""
    for parallel, later in ((4, 0.0), (1, QUIET)):
        with engine(smollm2, speculative="auto", **{**SMALL, "parallel": parallel}) as e:
            run(e, [_request(e.model, "The cat sat on the")])
            assert QUIET - 0.5 < e.scheduler.idle_delay() <= QUIET
            e.scheduler.started -= PATIENCE
            assert later - 0.5 < e.scheduler.idle_delay() <= later, parallel


def test_an_auto_server_is_healthy_before_timing_and_fills_the_table_while_idle(smollm2) -> None:
    """The server answers /health with nothing timed at load; while it idles the table fills, and a
    request meanwhile is served."""
    with serving(smollm2, speculative="auto", **SMALL) as url:
        reply = httpx.post(f"{url}/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 4}, timeout=120)
        assert reply.status_code == 200
        deadline = time.monotonic() + 120
        while (info := httpx.get(f"{url}/server_info", timeout=10).json()["speculative"])["ubatch_to_time"]:
            assert time.monotonic() < deadline, info
            time.sleep(0.2)
        assert set(info["ubatch_seconds"]) >= {str(n) for n in CALIBRATION_SIZES}, info
        assert info["enabled"] and info["drafters"] == ["prediction", "tree", "recent", "ngram"]

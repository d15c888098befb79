"""The benchmark harness, without timing: what the workloads send, what the client reads from a
stream, how results become ratios and tables, and that every server gets the same model,
threads and context. Speed goals live in bench/ as ratios, never here."""

from __future__ import annotations

import asyncio
import json
from dataclasses import asdict
from pathlib import Path

import httpx
import pytest

from bench import attention, compare, host_tier, kv_types, lora, sweep, workloads
from bench import embeddings as bench_embeddings
from bench.client import Result, stream_chat
from bench.report import markdown, medians, targets
from bench.servers import Setup, contenders
from bench.stats import summarize
from conftest import serve
from kvserve.llama.model import Model


@pytest.fixture(scope="module")
def tokens(smollm2: Path):
    model = Model(smollm2)
    yield lambda text: len(model.tokenize(text, add_special=False))
    model.close()


def user_texts(workload: workloads.Workload) -> list[str]:
    return [workload.messages(u, r, [])[-1]["content"] for u in range(workload.users) for r in range(workload.rounds)]


def test_workload_shapes(tokens) -> None:
    shared = workloads.shared()
    assert (shared.users, shared.rounds) == (8, 4)
    assert 1000 <= tokens(shared.messages(0, 0, [])[0]["content"]) <= 1300  # the ~1,000-token (1,223) system prompt
    assert len({shared.messages(u, r, [])[0]["content"] for u in range(8) for r in range(4)}) == 1
    assert len(set(user_texts(shared))) == 32

    unique = workloads.unique("a")
    assert len({text[:12] for text in user_texts(unique)}) == unique.users * unique.rounds  # distinct from the first words on
    assert not set(user_texts(unique)) & set(user_texts(workloads.unique("b")))

    long = workloads.long("a")
    assert (long.users, long.rounds) == (2, 1)
    assert all(2900 <= tokens(text) <= 3100 for text in user_texts(long))


def test_multiturn_carries_the_earlier_answers() -> None:
    messages = workloads.multiturn().messages(3, 2, ["first answer", "second answer"])
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user", "assistant", "user"]
    assert [m["content"] for m in messages if m["role"] == "assistant"] == ["first answer", "second answer"]
    assert messages[1] == workloads.multiturn().messages(3, 0, [])[1]  # earlier questions resent unchanged


def test_conversations_paste_a_document_each_and_come_back_turn_by_turn(tokens) -> None:
    chat = workloads.conversations()
    assert (chat.users, chat.rounds, chat.at_once) == (32, 3, 8)
    first = [chat.messages(u, 0, [])[1]["content"] for u in range(chat.users)]
    assert len({chat.messages(u, 0, [])[0]["content"] for u in range(chat.users)}) == 1  # one system prompt
    assert all(350 <= tokens(text) <= 550 for text in first)  # each its own ~300-word document
    assert len({text[:60] for text in first}) == chat.users
    later = chat.messages(5, 2, ["a1", "a2"])
    assert [m["role"] for m in later] == ["system", "user", "assistant", "user", "assistant", "user"]
    assert later[1]["content"] == first[5] and len(later[-1]["content"]) < 100  # the document is pasted once

    # turn by turn: every conversation's turn r is sent before any conversation's turn r + 1
    sent: list[tuple[int, int]] = []  # (turn, conversation)

    def answer(request: httpx.Request) -> httpx.Response:
        messages = json.loads(request.content)["messages"]
        sent.append(((len(messages) - 2) // 2, int(messages[-1]["content"].rsplit("In file ", 1)[1].split(",")[0])))
        return httpx.Response(200, content=sse(delta("ok")))

    small = workloads.conversations(users=5, rounds=3, at_once=2)
    with pytest.MonkeyPatch.context() as patch:
        transport = httpx.MockTransport(answer)
        real = httpx.AsyncClient
        patch.setattr(workloads.httpx, "AsyncClient", lambda **kw: real(transport=transport))
        run = workloads.run_sync("http://test", small, 4)
    assert [turn for turn, _ in sent] == [0] * 5 + [1] * 5 + [2] * 5
    assert sorted(sent) == [(t, u) for t in range(3) for u in range(5)]
    assert [len(r) for r in run.per_user] == [3] * 5 and all(x.text == "ok" for x in run.results)
    assert small.messages(0, 1, ["ok"])[2] == {"role": "assistant", "content": "ok"}


def sse(*chunks: dict) -> bytes:
    return "".join(f"data: {json.dumps(c)}\n\n" for c in chunks).encode() + b"data: [DONE]\n\n"


def read(body: bytes) -> Result:
    transport = httpx.MockTransport(lambda request: httpx.Response(200, content=body))

    async def go() -> Result:
        async with httpx.AsyncClient(transport=transport) as client:
            return await stream_chat(client, "http://test", [{"role": "user", "content": "hi"}], 8)

    return asyncio.run(go())


def delta(text: str) -> dict:
    return {"choices": [{"index": 0, "delta": {"content": text}}]}


def test_client_reads_usage_or_counts_chunks() -> None:
    usage = {"completion_tokens": 5, "prompt_tokens": 40, "prompt_tokens_details": {"cached_tokens": 32}}
    reported = read(sse(delta("a"), delta("b"), {"choices": [], "usage": usage}))
    assert (reported.text, reported.output_tokens, reported.prompt_tokens, reported.cached_tokens) == ("ab", 5, 40, 32)
    assert len(reported.itls) == 1

    # continuous usage: a chunk of 3 tokens is 3 gaps of a third of its wait; text split from one
    # output (no new token) adds none
    def counted(text: str, n: int) -> dict:
        return {**delta(text), "usage": {"completion_tokens": n, "prompt_tokens": 40}}

    spread = read(sse(counted("a", 1), counted("bcd", 4), counted("e", 4), counted("f", 5)))
    assert spread.output_tokens == 5 and len(spread.gaps) == 2
    assert len(spread.itls) == 4 and spread.itls[0] == spread.itls[1] == spread.itls[2] == spread.gaps[0] / 3
    assert spread.itls[3] == spread.gaps[1]

    # llama-cpp-python's server streams no usage: one chunk is one token, cached tokens unknown
    unreported = read(sse({"choices": [{"index": 0, "delta": {"role": "assistant"}}]}, delta("a"), delta("b"),
                          delta("c")))
    assert (unreported.output_tokens, unreported.cached_tokens) == (3, None)


def test_summary_counts_errors_apart_and_keeps_unreported_cache_unknown() -> None:
    ok = Result(ttft=0.5, itls=[0.1, 0.2], output_tokens=3, prompt_tokens=10)
    failed = Result(error="HTTP 500")
    row = summarize([ok, ok, failed], wall=2.0)
    assert (row["errors"], row["requests"], row["output_tok_s"], row["requests_s"]) == (1, 3, 3.0, 1.0)
    assert (row["cached_tokens"], row["first_error"]) == (None, "HTTP 500")
    assert summarize([Result(cached_tokens=4), Result(cached_tokens=0)], wall=1.0)["cached_tokens"] == 4


MACHINE = {"cpu": "cpu", "cores": 2, "memory_gib": 4, "os": "linux", "llama_cpp_python": "0.3.36",
           "kvserve_commit": "abc"}


def row(server: str, workload: str, tok_s: float, ttft_p95: float, cached: int | None) -> dict:
    return {"server": server, "workload": workload, "output_tok_s": tok_s, "ttft_p95": ttft_p95, "ttft_p50": 0.1,
            "itl_p50": 0.01, "itl_p95": 0.02, "requests_s": 1.0, "prompt_tokens": 100, "cached_tokens": cached,
            "errors": 0}


def test_targets_are_ratios_to_llama_server_from_the_same_run() -> None:
    rows = [row("kvserve", "shared", 30.0, 1.0, 90), row("llama-server", "shared", 10.0, 2.0, 50),
            row("llama-cpp-python", "shared", 5.0, 9.0, None),
            row("kvserve", "unique", 9.0, 1.0, 0), row("llama-server", "unique", 10.0, 1.0, 0)]
    got = {t["target"]: (round(t["ratio"], 3), t["met"]) for t in targets(rows)}
    assert got == {"shared: output tok/s ≥ 3x llama-server": (3.0, True),
                   "shared: TTFT p95 ≤ 0.2x llama-server": (0.5, False),
                   "unique: output tok/s ≥ 1x llama-server": (0.9, False),
                   "unique: ITL p95 (per token) ≤ 1x llama-server": (1.0, True)}  # no multiturn/long rows: no targets
    rows += [row("kvserve", "conversations", 30.0, 1.0, 90), row("llama-server", "conversations", 15.0, 2.0, 50),
             row("llama-server-defaults", "conversations", 25.0, 2.0, 50)]
    got = {t["target"]: (round(t["ratio"], 3), t["met"]) for t in targets(rows)}
    assert got["conversations: output tok/s ≥ 1.5x llama-server"] == (2.0, True)
    assert got["conversations: output tok/s ≥ 1.5x llama-server-defaults"] == (1.2, False)
    settings = {"model": "m.gguf", "threads": 2, "slots": 8, "ctx_per_request": 4096, "max_tokens": 64}
    text = markdown({"machine": MACHINE, "settings": settings, "rows": rows, "targets": targets(rows)})
    assert "| shared | llama-cpp-python | 0 |" in text and "not reported" in text and "90 / 100 (90%)" in text
    assert "| shared: TTFT p95 ≤ 0.2x llama-server | 0.50x | 0.50x | **no** |" in text


def test_targets_pair_each_turn_and_take_the_median() -> None:
    """Turns pair kvserve with the reference of the same turn (servers loaded side by side, measured
    in turns): a turn the reference did not run counts for nothing, and the target is the median."""
    rows = [{**row("kvserve", "shared", tok_s, 1.0, 90), "turn": turn} for turn, tok_s in enumerate((30.0, 20.0, 99.0))]
    rows += [{**row("llama-server", "shared", tok_s, 1.0, 50), "turn": turn} for turn, tok_s in enumerate((10.0, 10.0))]
    got = {t["target"]: t for t in targets(rows)}["shared: output tok/s ≥ 3x llama-server"]
    assert (got["ratio"], got["by_turn"], got["met"]) == (2.5, [3.0, 2.0], False)
    assert {(r["server"], r["output_tok_s"]) for r in medians(rows)} == {("kvserve", 30.0), ("llama-server", 10.0)}
    order = [s.name for s in contenders(Setup(Path("/m"), 1, 64, 1), Path("/l"))[:2]]
    assert [[s for s in turn] for turn in compare.turns(order, 3)] == [order, order[::-1], order]


def test_every_server_gets_the_same_model_threads_and_context() -> None:
    setup = Setup(model=Path("/m.gguf"), threads=3, ctx_per_request=4096, slots=8)
    argv = {s.name: s.command(9000) for s in contenders(setup, Path("/bin/llama-server"))}

    def flag(name: str, *keys: str) -> str:
        return next(argv[name][i + 1] for i, a in enumerate(argv[name]) if a in keys)

    assert {flag(n, "--model") for n in argv} == {"/m.gguf"}
    assert {flag(n, "--threads", "--n_threads") for n in argv} == {"3"}
    assert flag("llama-server", "--threads-batch") == flag("llama-cpp-python", "--n_threads_batch") == "3"
    # kvserve's context is one request's, llama-server's split evenly between its 8 slots
    assert flag("kvserve", "--ctx-size") == "4096" and flag("llama-server", "--ctx-size") == str(8 * 4096)
    assert flag("kvserve", "--parallel") == flag("llama-server", "--parallel") == "8"
    assert flag("llama-cpp-python", "--n_ctx") == "4096"  # one request at a time
    assert flag("llama-cpp-python", "--interrupt_requests") == "False"
    # the second reference is llama-server as it first starts: no slots or context given
    defaults = next(s for s in contenders(setup, Path("/bin/llama-server")) if s.name == "llama-server-defaults")
    assert not {"--parallel", "-np", "--ctx-size", "-c"} & set(argv["llama-server-defaults"])
    assert flag("llama-server-defaults", "--threads") == "3"
    assert defaults.runs("conversations") and defaults.runs("shared") and not defaults.runs("unique")


def test_multiturn_workload_on_kvserve_reuses_the_conversation(smollm2: Path) -> None:
    with serve(smollm2) as url:
        run = workloads.run_sync(url, workloads.multiturn(users=2, rounds=2), 4)
    assert [len(rounds) for rounds in run.per_user] == [2, 2]
    assert all(r.error is None and r.output_tokens > 0 for r in run.results)
    for first, second in run.per_user:
        assert second.prompt_tokens > first.prompt_tokens
        assert second.cached_tokens >= first.prompt_tokens - 16  # all but a partial page of turn one


def test_sweep_points_cover_the_axes_with_prompts_that_share_nothing(tokens) -> None:
    users, prompts = sweep.axes(quick=False)
    assert users.points == (1, 2, 4, 8, 16, 32) and prompts.points == (256, 512, 1024, 2048, 4096)
    for quick, full in zip(sweep.axes(quick=True), (users, prompts)):
        assert set(quick.points) < set(full.points)
    texts = []
    for x in users.points:
        workload = users.workload(x)
        assert (workload.users, workload.rounds) == (x, sweep.ROUNDS)
        texts += user_texts(workload)
    assert len({text.split(":")[0] for text in texts}) == len(texts)  # distinct from the first words on
    assert all(120 <= tokens(text) <= 180 for text in texts)
    for x in prompts.points:
        workload = prompts.workload(x)
        assert workload.users == 1 and len(set(user_texts(workload))) == workload.rounds
        assert all(abs(tokens(text) - x) <= 0.05 * x for text in user_texts(workload))
    # every user decodes at once; a slot holds the prompt, its chat template and the answer
    assert users.slots >= max(users.points) and users.ctx_per_request >= 180 + 64 + users.max_tokens
    assert prompts.ctx_per_request >= 1.05 * max(prompts.points) + 64 + prompts.max_tokens


def sweep_row(axis: str, x: int, server: str, tok_s: float, itl_p95: float, ttft_p50: float) -> dict:
    measured = {**row(server, f"{axis}-{x}", tok_s, 2 * ttft_p50, None), "requests": 4, "errors": 0,
                "itl_p95": itl_p95, "ttft_p50": ttft_p50, "prompt_tokens": 4 * x}
    return sweep.point_row(axis, x, measured)


def test_sweep_tables_put_kvserve_next_to_llama_server_at_each_point(tmp_path: Path) -> None:
    rows = [sweep_row("users", 1, "kvserve", 20.0, 0.05, 0.1), sweep_row("users", 1, "llama-server", 25.0, 0.04, 0.1),
            sweep_row("users", 8, "kvserve", 60.0, 0.2, 0.5), sweep_row("users", 8, "llama-server", 40.0, 0.4, 0.6),
            sweep_row("prompt_tokens", 1024, "kvserve", 5.0, 0.05, 1.5),
            sweep_row("prompt_tokens", 1024, "llama-server", 5.0, 0.05, 1.0)]
    assert rows[-1]["mean_prompt_tokens"] == 1024
    assert sweep.versus(rows, "output_tok_s") == {("users", 1): 0.8, ("users", 8): 1.5, ("prompt_tokens", 1024): 1.0}
    assert sweep.versus(rows, "ttft_p50")[("prompt_tokens", 1024)] == 1.5
    assert sweep.versus(rows[:1] + rows[2:4], "itl_p95") == {("users", 8): 0.5}  # a point llama-server missed: none

    settings = {"model": "m.gguf", "threads": 2, "rounds": 2,
                "axes": [{"name": "users", "slots": 32, "ctx_per_request": 512, "max_tokens": 32}]}
    text = sweep.markdown({"machine": MACHINE, "settings": settings, "rows": rows})
    assert "| 8 | kvserve | 60 | 1.50x | 10 | 200 | 0.50x |" in text
    assert "| 8 | llama-server | 40 | - | 10 | 400 | - |" in text
    assert "| 1024 | kvserve | 1.5 | 1.50x |" in text

    sweep.chart(rows, tmp_path / "sweep.png")
    assert (tmp_path / "sweep.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_sweep_refuses_servers_it_does_not_compare() -> None:
    with pytest.raises(SystemExit, match="only kvserve and llama-server"):
        sweep.main(quick=True, servers=["llama-cpp-python"])



def test_attention_times_each_call_in_both_kv_layouts(tiny, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in {"SEQUENCES": 2, "PROMPT_TOKENS": 40, "PROMPT_CHUNK": 70, "REPEATS": 1}.items():
        monkeypatch.setattr(attention, name, value)
    attention.main(tiny("llama"), threads=1, out=tmp_path)
    seconds = json.loads((tmp_path / "attention.json").read_text())["seconds"]
    assert set(seconds) == {"unified", "a stream per sequence"}
    for shapes in seconds.values():
        assert len(shapes) == 4 and all(s > 0 for s in shapes.values())
    assert "| decode step and chunk, two calls |" in (tmp_path / "attention.md").read_text()


def test_host_tier_times_donate_and_attach_against_prefill(tiny, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in {"LENGTHS": (64, 96), "PREFILL_CHUNK": 32, "REPEATS": 1}.items():
        monkeypatch.setattr(host_tier, name, value)
    host_tier.main(tiny("llama"), threads=1, out=tmp_path)
    rows = json.loads((tmp_path / "host_tier.json").read_text())["rows"]
    assert [r["tokens"] for r in rows] == [64, 96]
    for r in rows:
        assert all(r[k] > 0 for k in ("prefill_us", "donate_us", "attach_us", "llama_get_us", "llama_set_us"))
        assert r["row_bytes"] <= r["host_bytes_per_token"] <= 1.1 * r["row_bytes"]
    assert "| attach / prefill |" in (tmp_path / "host_tier.md").read_text()


def test_embedding_texts_are_distinct_and_retrieval_sized(tokens) -> None:
    texts = bench_embeddings.texts()
    assert len(set(texts)) == len(texts) == bench_embeddings.TEXTS == 256
    assert all(15 <= tokens(text) <= 60 for text in texts)


def test_embedding_servers_get_the_same_model_threads_batch_and_pooling() -> None:
    argv = {name: command(9000) for name, command in
            bench_embeddings.servers(Path("/m.gguf"), 3, Path("/bin/llama-server")).items()}

    def flag(name: str, key: str) -> str:
        return argv[name][argv[name].index(key) + 1]

    for key, value in (("--model", "/m.gguf"), ("--threads", "3"), ("--pooling", "mean"), ("--parallel", "8")):
        assert flag("kvserve", key) == flag("llama-server", key) == value
    # kvserve's --ctx-size is one request's stream, llama-server's is split between its slots
    assert flag("kvserve", "--ctx-size") == "512" and flag("llama-server", "--ctx-size") == str(8 * 512)
    # the longest input each embeds: kvserve's embedding batch, llama-server's physical batch
    assert flag("kvserve", "--embedding-batch") == flag("llama-server", "--ubatch-size") == "512"
    assert "--embeddings" in argv["llama-server"]


def test_embedding_report_rows() -> None:
    rows = [{"server": "kvserve", "workload": "single", "texts": 256, "seconds": 4.0, "embeddings_s": 64.0,
             "lowest_cosine": 1.0},
            {"server": "llama-server", "workload": "single", "texts": 256, "seconds": 5.0, "embeddings_s": 51.2,
             "lowest_cosine": 0.99991}]
    text = bench_embeddings.markdown({"machine": MACHINE, "rows": rows})
    assert "| kvserve | single | 256 | 64 | 1.000000 |" in text
    assert "| llama-server | single | 256 | 51.2 | 0.999910 |" in text


def test_kv_types_reports_bytes_time_and_drift_per_type(smollm2: Path, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in {"CONTEXT": 64, "CHUNK": 32, "ROUNDS": 1, "STEPS": 1}.items():
        monkeypatch.setattr(kv_types, name, value)
    monkeypatch.setattr(kv_types, "checked_probe_kl", lambda *args: 0.001)  # its own tests run it
    kv_types.main(smollm2, threads=1, out=tmp_path)
    rows = json.loads((tmp_path / "kv_types.json").read_text())["types"]
    assert list(rows) == ["f16", "q8_0", "q4_0"]
    assert rows["f16"]["mean_abs_dlogprob"] == 0 and rows["q4_0"]["max_abs_dlogprob"] > 0
    assert rows["f16"]["host_bytes_per_token"] > rows["q8_0"]["host_bytes_per_token"] > rows["q4_0"]["host_bytes_per_token"]
    assert all(r["decode_ms_at_context"] > 0 for r in rows.values())
    assert "| q8_0 |" in (tmp_path / "kv_types.md").read_text()


def test_lora_times_steps_with_and_without_a_switch(smollm2: Path, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in {"SEQUENCES": 2, "PROMPT_TOKENS": 16, "STEPS": 2}.items():
        monkeypatch.setattr(lora, name, value)
    lora.main(smollm2, threads=1, out=tmp_path)
    result = json.loads((tmp_path / "lora.json").read_text())
    assert set(result["median_ms"]) == {"base", "same set", "switching"}
    assert all(ms > 0 for ms in result["median_ms"].values())
    assert "A switch of adapter set costs" in (tmp_path / "lora.md").read_text()


def test_speculative_targets_divide_cells_of_the_same_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from bench import speculative

    monkeypatch.setattr(speculative, "RESULTS", tmp_path)

    def row(server: str, workload: str, users: int, tps: float) -> dict:
        return {"server": server, "workload": workload, "users": users, "decode_tps": tps, "ttft": 0.5, "errors": []}
    rows = [row("kvserve-off", "edit", 1, 20.0), row("kvserve-auto", "edit", 1, 40.0),
            row("llama-server-none", "edit", 1, 25.0), row("llama-server-ngram-mod", "edit", 1, 32.0),
            row("kvserve-off", "free", 8, 10.0), row("kvserve-auto", "free", 8, 9.7),
            {"server": "kvserve-draft", "workload": "-", "users": 0, "decode_tps": 0.0, "skipped": "refused"}]
    found = {what: (ratio, goal) for what, ratio, goal in speculative.targets(rows)}
    assert found["edit, 1 user: auto / off"] == (2.0, 1.5)
    assert found["edit, 1 user: auto / llama-server-ngram-mod (llama-server's best)"] == (1.25, 1.25)
    assert found["free, 8 users: auto / off"] == (pytest.approx(0.97), 0.98)
    assert found["free, 1 user: auto / off"] == (None, 1.0)  # a missing cell is no ratio, not 0
    text = speculative.report(rows)
    assert "| kvserve-auto | edit | 1 | 40.0 | 2.00x |" in text
    assert "| kvserve-draft | skipped: refused |" in text
    assert "| free, 8 users: auto / off | 0.97x | >= 0.98x | no |" in text
    assert (tmp_path / "speculative.md").read_text() == text + "\n"


def test_speculative_also_pairs_a_third_server_run_by_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`--also`: a third server served in the pair's turns; the report gives its rates and auto's ratio
    to it run by run, and the three are one group."""
    from bench import speculative

    monkeypatch.setattr(speculative, "RESULTS", tmp_path)
    monkeypatch.setattr(speculative, "PAIRED", ("kvserve-off", "kvserve-auto", "llama-server-ngram-mod"))

    def row(server: str, runs: list[float], engine: list[list] | None = None) -> dict:
        return {"server": server, "workload": "edit", "users": 1, "decode_tps": sum(runs) / len(runs), "ttft": 0.5,
                "errors": [], "runs_tps": runs, "runs_drafted": [5, 6], **({"runs_engine": engine} if engine else {})}
    rows = [row("kvserve-off", [20.0, 30.0], [[64, 10.0], [66, 9.5]]), row("kvserve-auto", [40.0, 45.0], [[30, 6.25], [31, 6.0]]),
            row("llama-server-ngram-mod", [25.0, 30.0])]
    text = speculative.report(rows)
    assert ("| edit | 1 | 20.0, 30.0 | 40.0, 45.0 | 2.00x, 1.50x | 0.50x | 5, 6 "
            "| 64/30 steps, 10.0/6.2 s; 66/31 steps, 9.5/6.0 s | 25.0, 30.0 | 1.60x, 1.50x |") in text
    named = [speculative.Server(n, (), ()) for n in ("kvserve-off", "kvserve-auto", "kvserve-ngram", "llama-server-ngram-mod")]
    assert [[s.name for s in g] for g in speculative.groups(named)] == [
        ["kvserve-off", "kvserve-auto", "llama-server-ngram-mod"], ["kvserve-ngram"]]


def test_speculative_cells_filter_by_glob_and_draft_cells_need_the_draft_model(tmp_path: Path) -> None:
    from bench import speculative

    run = speculative.Run(["kvserve-*/edit/1", "llama-server-none/*/8"])
    assert run.wanted("kvserve-auto", "edit", 1) and run.wanted("llama-server-none", "free", 8)
    assert not run.wanted("kvserve-auto", "edit", 4) and not run.wanted("llama-server-ngram-mod", "free", 8)
    assert speculative.Run(None).wanted("anything", "free", 4)
    target, draft = tmp_path / "target.gguf", tmp_path / "draft.gguf"
    with_draft = {s.name: s for s in speculative.servers(target, draft)}
    assert with_draft["kvserve-auto"].argv == ("--speculative", "auto", "--draft-model", str(draft))
    assert with_draft["kvserve-auto"].fallback == ("--speculative", "auto")
    assert "edit+prediction" not in with_draft.get("llama-server-none", speculative.Server("", (), ())).workloads
    alone = [s.name for s in speculative.servers(target, None)]
    assert "kvserve-draft" not in alone and not any("draft-simple" in name for name in alone)
    assert all("--draft-model" not in s.argv for s in speculative.servers(target, None))
    everything = speculative.Run(None)
    assert ("regenerate", 8) in everything.cells(with_draft["kvserve-auto"], speculative.USERS)
    assert ("regenerate", 8) in everything.cells(with_draft["kvserve-off"], speculative.USERS)
    assert ("regenerate", 8) not in everything.cells(with_draft["kvserve-ngram"], speculative.USERS)
    assert ("free", 8) in everything.cells(with_draft["kvserve-ngram"], speculative.USERS)
    assert everything.cells(with_draft["kvserve-ngram"], (1,)) == [(w, 1) for w in speculative.KVSERVE_WORKLOADS]
    assert run.cells(with_draft["kvserve-ngram"], speculative.USERS) == [("edit", 1)]


def test_speculative_pair_is_served_at_once_in_turns_on_the_same_prompts(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    from bench import speculative

    groups = [[s.name for s in g] for g in speculative.groups(speculative.servers(tmp_path / "t", tmp_path / "d"))]
    assert groups[0] == list(speculative.PAIRED) and all(len(g) == 1 for g in groups[1:])
    assert sorted(sum(groups, [])) == sorted(s.name for s in speculative.servers(tmp_path / "t", tmp_path / "d"))
    calls = []

    async def fake_round(client, url, workload, tags, users):
        calls.append((url, tuple(tags)))
        return [url] * len(tags)
    monkeypatch.setattr(speculative, "_round", fake_round)
    found = asyncio.run(speculative.measure_paired(["a", "b"], "free", 1))
    assert [url for url, _ in calls] == ["a", "b", "b", "a", "a", "b"][:2 * speculative.PAIRED_ROUNDS[0]]
    assert all(calls[i][1] == calls[i + 1][1] and len(calls[i][1]) == 1 for i in range(0, len(calls), 2))
    assert found == [["a"] * speculative.PAIRED_ROUNDS[0], ["b"] * speculative.PAIRED_ROUNDS[0]]
    calls.clear()
    asyncio.run(speculative.measure_paired(["a", "b"], "edit", 8))
    assert [len(tags) for _, tags in calls] == [8, 8] * speculative.PAIRED_ROUNDS[1]


def test_novel_questions_are_distinct_across_a_servers_tags() -> None:
    from bench import speculative

    asked = {speculative.novel(tag)[0]["content"] for tag in range(1000, 1000 + len(speculative.TOPICS))}
    assert len(asked) == len(speculative.TOPICS) >= 5 * sum(speculative.USERS) // 2


def test_models_turns_are_abba_and_ratios_pair_turns_of_the_same_run(tmp_path: Path) -> None:
    from bench import models

    assert models.turns(["one", "two", "two-split"], 0) == [("one", 0), ("two", 0), ("two-split", 0),
                                                            ("two-split", 1), ("two", 1), ("one", 1)]
    assert [c for c, _ in models.turns(["one", "two"], 1)] == ["two", "one", "one", "two"]
    asked = {m[1]["content"] for u in range(models.CHAT_USERS) for m in (models.question(u, n) for n in range(20))}
    assert len(asked) == 20 * models.CHAT_USERS
    assert len({models.question(u, 3)[0]["content"] for u in range(4)}) == 1  # one shared system prompt

    def row(config: str, run: int, turn: int, chat: float, embeddings: float) -> dict:
        return {"config": config, "run": run, "turn": turn, "chat_tok_s": chat, "embeddings_s": embeddings}
    rows = [row("one", 0, 0, 40.0, 10.0), row("two", 0, 0, 20.0, 10.0), row("one", 0, 1, 30.0, 10.0),
            row("two", 0, 1, 30.0, 5.0), row("one", 1, 0, 20.0, 8.0), row("two", 1, 0, 40.0, 8.0),
            {**row("one", 1, -1, 50.0, 0.0), "solo": "chat"}]
    found = models.ratio(rows, "one", "two", "chat_tok_s")
    assert found == {"median": 1.0, "min": 0.5, "max": 2.0, "pairs": 3}  # the solo row and the missing turn left out
    assert models.ratio(rows, "one", "two-split", "chat_tok_s") is None
    stalled = [row("one", 0, 0, 4.0, 1.0), row("two", 0, 0, 0.0, 1.0), row("one", 0, 1, 0.0, 1.0), row("two", 0, 1, 0.0, 1.0)]
    assert models.ratio(stalled, "one", "two", "chat_tok_s")["max"] == float("inf")  # both 0: no pair
    assert models.combined(row("one", 0, 0, 25.0, 5.0), {"chat_tok_s": 50.0, "embeddings_s": 10.0}) == 1.0
    assert models.combined(row("one", 0, 0, 25.0, 5.0), {"chat_tok_s": None, "embeddings_s": 10.0}) is None
    folder = models.models_dir(tmp_path / "a.gguf", tmp_path / "b.gguf", tmp_path / "models")
    assert sorted(p.name for p in folder.iterdir()) == sorted([f"{models.CHAT}.gguf", f"{models.EMBED}.gguf"])
    assert (folder / f"{models.CHAT}.gguf").readlink() == tmp_path / "a.gguf"


def test_restart_prompts_are_cut_to_size_and_targets_pair_cold_with_restart(tmp_path: Path) -> None:
    from bench import restart

    files = [tmp_path / "kvserve" / f"m{i}.py" for i in range(3)]
    for i, f in enumerate(files):
        f.parent.mkdir(exist_ok=True)
        f.write_text(f"def f{i}():\n    return {i}\n" * 20)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(restart, "ROOT", tmp_path)
        words = restart.build_prompt(lambda text: [hash(w) % 1000 for w in text.split()], 100, files)
    assert len(words) == 100 and words[-3:] == [hash(w) % 1000 for w in restart.QUESTION.split()][-3:]
    assert restart.parse_sizes("2048,16384:1", 2) == [(2048, 2), (16384, 1)]
    assert restart.workload_turns(2) == ["host", "disk", "disk", "host"] and restart.workload_turns(1) == ["host", "disk"]

    def chain(server: str, run: int, cold: float, again: float) -> dict:
        return {"server": server, "tokens": 8192, "run": run, "restart_start_s": 1.0, "restore_s": 0.5,
                "cold": {"ttft_s": cold}, "restart": {"ttft_s": again, "cached_tokens": 8176, "prompt_tokens": 8192}}
    rows = [chain("kvserve-sigterm", 0, 40.0, 1.0), chain("kvserve-sigterm", 1, 60.0, 4.0),
            chain("kvserve-sigkill", 0, 50.0, 1.0), chain("llama-server-slot-save", 0, 45.0, 0.4)]
    found = restart.targets(restart.restart_summary(rows))
    # sigterm: the median of 40x and 15x; sigkill 50x; kvserve's 2.5 s against llama-server's restore + TTFT, 0.9 s
    assert [t["met"] for t in found] == [True, True, False]
    assert found[0]["shown"] == "27.5x (15.0-40.0)" and found[2]["value"] == pytest.approx(2.5 / 0.9)
    host = {"workload": "shared", "output_tok_s": 10.0, "ttft_p50": 1.0, "ttft_p95": 2.0}
    ratios = restart.workload_ratios([{**host, "config": "host", "turn": 0},
                                      {**host, "config": "disk", "turn": 1, "output_tok_s": 8.0}])
    assert ratios["shared"]["output_tok_s"] == {"median": 0.8, "min": 0.8, "max": 0.8, "pairs": 1}


def test_restart_turns_alternate_across_chains_and_pair_with_llama_servers_turn(tmp_path: Path) -> None:
    """`--restarts 3`: each chain's first restart ends it, the later ones go in turns across the chains
    (A B C, C B A, A B C); the restart cells count every turn, restart / cold only the first, and each
    kvserve turn is divided by llama-server's restore + TTFT of the same run and turn."""
    from bench import restart

    order, binary = [], tmp_path / "llama-server"
    binary.write_text("")

    def first(_b, _m, tokens, _f, chain, run):
        order.append((chain, 0))
        server = {"llama": "llama-server-slot-save"}.get(chain, f"kvserve-{chain}")
        row = {"server": server, "tokens": len(tokens), "run": run, "restart_start_s": 1.0,
               "cold": {"ttft_s": 10.0, "cached_tokens": 0, "loadavg": [0.5]},
               "restart": {"ttft_s": 0.2, "cached_tokens": 3, "prompt_tokens": 4}}
        if chain == "llama":
            row["restore_s"] = 0.05
        row["turns"] = [{"ttft": row["restart"], **({"restore_s": 0.05} if chain == "llama" else {})}]
        return row

    def further(_b, _m, _t, _f, chain):
        order.append((chain, len(order)))
        ttft = {"ttft_s": 0.1 if chain == "sigterm" else 0.15, "cached_tokens": 3, "prompt_tokens": 4}
        return {"ttft": ttft, "restore_s": 0.05} if chain == "llama" else {"ttft": ttft}

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(restart.llama_server, "binary", lambda: binary)
        patch.setattr(restart, "prompts", lambda _m, sizes: {n: [1] * n for n in sizes})
        patch.setattr(restart, "first_restart", first)
        patch.setattr(restart, "further_restart", further)
        rows, _, failed = restart.restart_part(tmp_path / "m.gguf", [(4, 1)], tmp_path, restarts=3)
    assert failed == [] and [c for c, _ in order] == ["sigterm", "sigkill", "llama", "llama", "sigkill", "sigterm",
                                                        "sigterm", "sigkill", "llama"]
    summary = {x["server"]: x for x in restart.restart_summary(rows)}
    assert summary["kvserve-sigterm"]["restart_s"] == [0.2, 0.1, 0.1] and summary["kvserve-sigterm"]["turns"] == 3
    assert summary["kvserve-sigterm"]["speedup"] == [50.0]  # the cold prompt against the first restart alone
    assert summary["llama-server-slot-save"]["restore_s"] == [0.05] * 3
    assert restart.paired(rows, 4, "kvserve-sigterm") == pytest.approx([0.8, 0.5, 0.5])
    target = restart.targets(list(summary.values()), rows)[-1]
    assert target["met"] and "turn by turn after SIGTERM 0.5 (0.5-0.8)x (3 turns)" in target["shown"]


def test_kv_events_turns_alternate_and_each_events_turn_pairs_with_an_off_turn_beside_it() -> None:
    from bench import kv_events

    from bench.restart import workload_ratios, workload_turns

    turns = workload_turns(2, kv_events.CONFIGS)
    assert turns == ["off", "events", "events", "off"]
    row = {"workload": "shared", "output_tok_s": 10.0, "ttft_p50": 1.0, "ttft_p95": 2.0, "step_ms": 20.0}
    rows = [{**row, "config": c, "turn": t, "output_tok_s": v}
            for t, (c, v) in enumerate(zip(turns, (10.0, 9.0, 12.0, 8.0)))]
    ratios = workload_ratios(rows, kv_events.CONFIGS, kv_events.METRICS)
    found = ratios["shared"]
    # turn 1 against turn 0 (0.9), turn 2 against turn 3 (1.5)
    assert found["output_tok_s"] == {"median": 1.2, "min": 0.9, "max": 1.5, "pairs": 2}
    assert found["step_ms"] == {"median": 1.0, "min": 1.0, "max": 1.0, "pairs": 2}
    text = kv_events.markdown({"machine": {"cpu": "c", "cores": 2, "memory_gib": 1, "os": "l", "llama_cpp_python": "x",
                                          "kvserve_commit": "y"}, "turns": turns, "max_tokens": 8,
                               "loadavg_before": [0], "loadavg_after": [0], "seconds": 1,
                               "rows": [{**r, "published": 3, "dropped": 0, "errors": 0} for r in rows],
                               "ratios": ratios})
    assert "| shared | output_tok_s | 1.200x (0.9-1.5, 2 pairs) |" in text


def test_a_measured_run_waits_for_every_server_to_be_idle() -> None:
    """A server still busy (kvserve timing its ubatch sizes after its own run) would share the cores with
    the next server's run: `wait_quiet` returns only once each process has gone quiet."""
    import subprocess
    import sys

    busy = "import time\nt = time.process_time()\nwhile time.process_time() - t < 1.5: pass\ntime.sleep(60)"
    idle = "import time; time.sleep(60)"
    children = [subprocess.Popen([sys.executable, "-c", code]) for code in (busy, idle)]
    try:
        waited = compare.wait_quiet([c.pid for c in children], window=0.3, cap=30)
        assert compare.cpu_seconds(children[0].pid) >= 1.4, "it returned while a process was still busy"
        assert waited < 30
    finally:
        for child in children:
            child.kill()
            child.wait()

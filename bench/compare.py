"""The comparison, the default benchmark suite: kvserve against llama-server (and, asked for,
llama-server at its defaults and llama-cpp-python's server).

Each workload runs on freshly started servers (so no workload warms another's cache), on loopback,
with the same model file, threads and per-request context. The servers of a turn are loaded side by
side and measured one after another, in turns: in the order given, then reversed (A B, B A), each
turn on fresh servers; the targets are ratios of the same turn, reported as their median and
spread, since this box's speed drifts by 10-50% within an hour. Every request streams a chat
completion at temperature 0 and generates exactly MAX_TOKENS tokens: end-of-generation tokens get a
logit bias of -100, the OpenAI field all three servers honour (llama-server's own ignore_eos is the
same bias).

python -m bench [compare] [--quick] [--servers ...] [--workloads ...] [--runs N]
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from pathlib import Path

from bench import llama_server, report, workloads
from bench.client import engine_work
from bench.servers import Server, Setup, contenders
from bench.stats import summarize
from bench.workloads import Workload
from kvserve.config import embedded_model_path
from kvserve.llama.model import Model
from kvserve.testing import ServerProcess, free_port

RESULTS = Path(__file__).parent / "results"
MAX_TOKENS = 64
SLOTS = 8
CTX_PER_REQUEST = 4096  # a long prompt (~3,000 tokens) and its answer fit
WARM_UP = [{"role": "user", "content": "Say hello."}]
PAIRED = ("kvserve", "llama-server")  # the servers of a run not told which: the targets' pair
# A server using less than QUIET_CORES of a core over QUIET_WINDOW seconds is idle: each measured run
# starts only once every server of its turn is. kvserve times its ubatch sizes while it first idles
# (1-1.5 s of both cores for SmolLM2 alone; after its own run that overlapped the next server's
# first ~6 s, at about one core), starting a second after its last request (scheduler.QUIET): a
# window of one second closed before that began, and the timing then ran beside llama-server's
# first run (unique 8.8 tok/s against 23.1 in the other turn). Three seconds see it start.
QUIET_CORES = 0.05
QUIET_WINDOW = 3.0
QUIET_CAP = 120.0
RUNS = 2  # turns of each workload, the servers' order reversed each turn


def all_workloads(quick: bool) -> list[Workload]:
    """The five workloads; quick: the fewest rounds that still exercise each (a smoke run)."""
    if quick:
        return [workloads.shared(rounds=1), workloads.multiturn(rounds=2), workloads.unique("compare", rounds=1),
                workloads.long("compare"), workloads.conversations(users=16, rounds=2)]
    return [workloads.shared(), workloads.multiturn(), workloads.unique("compare"), workloads.long("compare"),
            workloads.conversations()]


def end_of_generation_bias(model_path: Path) -> dict[str, float]:
    model = Model(model_path)
    try:
        return {str(t): -100.0 for t in range(model.info.n_vocab) if model.is_eog(t)}
    finally:
        model.close()


def turns(servers: list[Server], runs: int) -> list[list[Server]]:
    """The order the servers start and are measured in, turn by turn: as given, then reversed."""
    return [servers if turn % 2 == 0 else servers[::-1] for turn in range(runs)]


def cpu_seconds(pid: int) -> float:
    """User and system CPU seconds the process has used (0 once it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def wait_quiet(pids: list[int], window: float = QUIET_WINDOW, cap: float = QUIET_CAP) -> float:
    """Wait until each process of `pids` used under QUIET_CORES of a core over the last `window`
    seconds, or `cap` seconds pass; the seconds waited."""
    began = time.monotonic()
    before = [cpu_seconds(pid) for pid in pids]
    while time.monotonic() - began < cap:
        time.sleep(window)
        after = [cpu_seconds(pid) for pid in pids]
        if all(b - a < QUIET_CORES * window for a, b in zip(before, after)):
            break
        before = after
    return time.monotonic() - began


def measure_turn(order: list[Server], workload: Workload, max_tokens: int, extra: dict, turn: int) -> list[dict]:
    """`workload` on each server of `order`, all started fresh and loaded side by side, one at a time."""
    with contextlib.ExitStack() as stack:
        up = []
        for server in order:
            port = free_port()
            log = RESULTS / f"{server.name}-{workload.name}.log"
            up.append((server, stack.enter_context(ServerProcess(server.command(port), port, log))))
        for server, process in up:
            process.wait_healthy(server.health)
            workloads.run_sync(process.url, Workload("warm-up", 1, 1, lambda *_: WARM_UP), 8, extra)
        rows = []
        for server, process in up:
            wait_quiet([p.pid for _, p in up])
            kvserve = server.name.startswith("kvserve")  # llama-server does not say what it drafted
            before = engine_work(process.url) if kvserve else None
            run = workloads.run_sync(process.url, workload, max_tokens, extra)
            done = engine_work(process.url) - before if before else None
            drafted, accepted = (done.drafted, done.accepted) if done else (None, None)
            row = {"server": server.name, "workload": workload.name, "turn": turn, **summarize(run.results, run.wall),
                   "drafted_tokens": drafted, "accepted_tokens": accepted}
            print(f"{workload.name:>13} {server.name:>21} turn {turn}: TTFT p95 {row['ttft_p95']:.2f} s, "
                  f"{row['output_tok_s']:.1f} tok/s, {row['errors']} errors {row['first_error'] or ''}"
                  + (f" drafted {drafted}, accepted {accepted}" if kvserve else ""), flush=True)
            rows.append(row)
    return rows


def main(quick: bool = False, servers: list[str] | None = None, only: list[str] | None = None,
         runs: int | None = None) -> str:
    binary = llama_server.require()
    setup = Setup(model=embedded_model_path(), threads=os.cpu_count() or 1, ctx_per_request=CTX_PER_REQUEST,
                  slots=SLOTS)
    chosen = [s for s in contenders(setup, binary) if s.name in (servers or PAIRED)]
    chosen_workloads = [w for w in all_workloads(quick) if only is None or w.name in only]
    max_tokens = 16 if quick else MAX_TOKENS
    runs = runs or (1 if quick else RUNS)
    extra = {"logit_bias": end_of_generation_bias(setup.model)}
    rows = [row for workload in chosen_workloads
            for turn, order in enumerate(turns([s for s in chosen if s.runs(workload.name)], runs))
            for row in measure_turn(order, workload, max_tokens, extra, turn)]
    result = {
        "machine": report.machine(),
        "settings": {"model": setup.model.name, "threads": setup.threads, "slots": setup.slots,
                     "ctx_per_request": setup.ctx_per_request, "max_tokens": max_tokens, "runs": runs,
                     "workloads": {w.name: {"users": w.users, "rounds": w.rounds, "at_once": w.at_once or w.users}
                                   for w in chosen_workloads}},
        "rows": rows,
        "targets": report.targets(rows),
    }
    # only a full run replaces the results docs/benchmarks.md shows
    name = "latest" if not quick and servers is None and only is None and runs >= RUNS else "partial"
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps(result, indent=2) + "\n")
    markdown = report.markdown(result)
    (RESULTS / f"{name}.md").write_text(markdown + "\n")
    report.chart(rows, RESULTS / f"{name}.png")
    return markdown

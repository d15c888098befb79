"""The comparison, the default benchmark suite: kvserve against llama-server and llama-cpp-python's server.

Each workload runs on a freshly started server of each kind (so no workload warms another's cache),
on loopback, with the same model file, threads and per-request context. Every request streams a
chat completion at temperature 0 and generates exactly MAX_TOKENS tokens: end-of-generation tokens
get a logit bias of -100, the OpenAI field all three servers honour (llama-server's own ignore_eos
is the same bias).

python -m bench [compare] [--quick] [--servers ...] [--workloads ...]
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from bench import llama_server, report, workloads
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


def measure(server: Server, workload: Workload, max_tokens: int, extra: dict) -> dict:
    port = free_port()
    with ServerProcess(server.command(port), port, RESULTS / f"{server.name}-{workload.name}.log") as process:
        process.wait_healthy(server.health)
        workloads.run_sync(process.url, Workload("warm-up", 1, 1, lambda *_: WARM_UP), 8, extra)
        run = workloads.run_sync(process.url, workload, max_tokens, extra)
    row = {"server": server.name, "workload": workload.name, **summarize(run.results, run.wall)}
    print(f"{workload.name:>10} {server.name:>16}: TTFT p95 {row['ttft_p95']:.2f} s, "
          f"{row['output_tok_s']:.1f} tok/s, {row['errors']} errors {row['first_error'] or ''}", flush=True)
    return row


def main(quick: bool = False, servers: list[str] | None = None, only: list[str] | None = None) -> str:
    binary = llama_server.require()
    setup = Setup(model=embedded_model_path(), threads=os.cpu_count() or 1, ctx_per_request=CTX_PER_REQUEST,
                  slots=SLOTS)
    chosen = [s for s in contenders(setup, binary) if servers is None or s.name in servers]
    chosen_workloads = [w for w in all_workloads(quick) if only is None or w.name in only]
    max_tokens = 16 if quick else MAX_TOKENS
    extra = {"logit_bias": end_of_generation_bias(setup.model)}
    rows = [measure(server, workload, max_tokens, extra) for workload in chosen_workloads for server in chosen
            if server.runs(workload.name)]
    result = {
        "machine": report.machine(),
        "settings": {"model": setup.model.name, "threads": setup.threads, "slots": setup.slots,
                     "ctx_per_request": setup.ctx_per_request, "max_tokens": max_tokens,
                     "workloads": {w.name: {"users": w.users, "rounds": w.rounds, "at_once": w.at_once or w.users}
                                   for w in chosen_workloads}},
        "rows": rows,
        "targets": report.targets(rows),
    }
    # only a full run replaces the results docs/benchmarks.md shows
    name = "latest" if not quick and servers is None and only is None else "partial"
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps(result, indent=2) + "\n")
    markdown = report.markdown(result)
    (RESULTS / f"{name}.md").write_text(markdown + "\n")
    report.chart(rows, RESULTS / f"{name}.png")
    return markdown

"""python -m bench sweep: how kvserve's and llama-server's costs grow, side by side.

- users: 1 to 32 users at once, each sending ROUNDS streamed chats of a ~150-token prompt that shares
  nothing with any other; output tok/s and ITL p95 against the number of users;
- prompt length: one user, prompts of 256 to 4,096 tokens (a ledger to summarize, distinct from the
  first token on); TTFT against prompt length.

Each point runs on a freshly started server of each kind, as compare runs a workload (the same
model and threads, end-of-generation tokens biased away so every answer is full length), so no
point warms another's cache. The slots and context fit the axis: 32 slots of 512 tokens for users
(every user decodes at once), one slot of 8,192 for prompt length.

python -m bench sweep [--quick] [--servers kvserve llama-server]
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

from bench import compare, llama_server, workloads
from bench.report import REFERENCE, describe_machine, machine, pyplot
from bench.servers import Setup, contenders
from bench.stats import markdown_table
from bench.workloads import Workload
from kvserve.config import embedded_model_path

RESULTS = Path(__file__).parent / "results"
SERVERS = ("kvserve", REFERENCE)
ROUNDS = 2  # per user: the second round arrives while other users still decode
SENTENCES = 10  # of a users-axis prompt: ~150 tokens
TOKENS_PER_LEDGER_LINE = 30  # SmolLM2's tokens per line of `workloads.long`'s ledger


@dataclass(frozen=True)
class Axis:
    """One sweep: its points, and the slots, context and answer length every server gets for it."""
    name: str  # what a point's x counts: "users" or "prompt_tokens"
    points: tuple[int, ...]
    workload: Callable[[int], Workload]  # x -> what that point sends
    slots: int
    ctx_per_request: int
    max_tokens: int


def by_users(users: int) -> Workload:
    return replace(workloads.unique(f"c{users}", users=users, rounds=ROUNDS, sentences=SENTENCES),
                   name=f"users-{users}")


def by_prompt_length(tokens: int) -> Workload:
    lines = max(round(tokens / TOKENS_PER_LEDGER_LINE), 1)
    return replace(workloads.long(f"p{tokens}", users=1, rounds=ROUNDS, lines=lines), name=f"prompt-{tokens}")


def axes(quick: bool) -> list[Axis]:
    """The two sweeps; quick: two points of each (a smoke run)."""
    return [Axis("users", (1, 4) if quick else (1, 2, 4, 8, 16, 32), by_users, slots=32, ctx_per_request=512,
                 max_tokens=32),
            Axis("prompt_tokens", (256, 1024) if quick else (256, 512, 1024, 2048, 4096), by_prompt_length,
                 slots=1, ctx_per_request=8192, max_tokens=8)]


def main(quick: bool = False, servers: list[str] | None = None) -> str:
    names = servers or SERVERS
    if set(names) - set(SERVERS):
        raise SystemExit(f"the sweep runs only {' and '.join(SERVERS)}")
    binary = llama_server.require() if REFERENCE in names else llama_server.binary()
    model, threads = embedded_model_path(), os.cpu_count() or 1
    extra = {"logit_bias": compare.end_of_generation_bias(model)}
    chosen_axes = axes(quick)
    rows = []
    for axis in chosen_axes:
        setup = Setup(model=model, threads=threads, ctx_per_request=axis.ctx_per_request, slots=axis.slots)
        chosen = [s for s in contenders(setup, binary) if s.name in names]
        for x in axis.points:
            workload = axis.workload(x)
            rows += [point_row(axis.name, x, compare.measure(server, workload, axis.max_tokens, extra))
                     for server in chosen]
    result = {
        "machine": machine(),
        "settings": {"model": model.name, "threads": threads, "rounds": ROUNDS,
                     "axes": [{"name": a.name, "points": a.points, "slots": a.slots,
                               "ctx_per_request": a.ctx_per_request, "max_tokens": a.max_tokens} for a in chosen_axes]},
        "rows": rows,
    }
    # only a full run replaces the results the README shows
    name = "sweep" if not quick and servers is None else "sweep-partial"
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps(result, indent=2) + "\n")
    text = markdown(result)
    (RESULTS / f"{name}.md").write_text(text + "\n")
    chart(rows, RESULTS / f"{name}.png")
    return text


def point_row(axis: str, x: int, row: dict) -> dict:
    """compare's row of one point, with the point and the prompt length its requests really had."""
    ok = row["requests"] - row["errors"]
    return {"axis": axis, "x": x, **row, "mean_prompt_tokens": row["prompt_tokens"] / ok if ok else float("nan")}


def versus(rows: list[dict], metric: str) -> dict[tuple[str, int], float]:
    """kvserve's `metric` over llama-server's, at each point both ran."""
    by = {(r["axis"], r["x"], r["server"]): r[metric] for r in rows}
    return {(axis, x): value / by[axis, x, REFERENCE] if by[axis, x, REFERENCE] else float("nan")
            for (axis, x, server), value in by.items() if server == "kvserve" and (axis, x, REFERENCE) in by}


def markdown(result: dict) -> str:
    s = result["settings"]
    sizes = "; ".join(f"{a['name']}: {a['slots']} x {a['ctx_per_request']}-token slots, "
                      f"{a['max_tokens']} output tokens" for a in s["axes"])
    header = (f"{describe_machine(result['machine'])}; {s['model']}, {s['threads']} threads, "
              f"{s['rounds']} rounds per user; {sizes}.")
    rows = result["rows"]
    tok_s, itl, ttft = versus(rows, "output_tok_s"), versus(rows, "itl_p95"), versus(rows, "ttft_p50")

    def ratio(ratios: dict, r: dict) -> str:
        key = (r["axis"], r["x"])
        return f"{ratios[key]:.2f}x" if r["server"] == "kvserve" and key in ratios else "-"

    users = markdown_table(
        ["users", "server", "output tok/s", "vs llama-server", "ITL p50 ms", "ITL p95 ms", "vs llama-server",
         "TTFT p95 s", "errors"],
        [[r["x"], r["server"], r["output_tok_s"], ratio(tok_s, r), r["itl_p50"] * 1000, r["itl_p95"] * 1000,
          ratio(itl, r), r["ttft_p95"], r["errors"]] for r in rows if r["axis"] == "users"])
    prompts = markdown_table(
        ["prompt tokens", "server", "TTFT p50 s", "vs llama-server", "TTFT p95 s", "errors"],
        [[round(r["mean_prompt_tokens"]), r["server"], r["ttft_p50"], ratio(ttft, r), r["ttft_p95"], r["errors"]]
         for r in rows if r["axis"] == "prompt_tokens"])
    return f"{header}\n\nUnique prompts, all users at once:\n\n{users}\n\nOne user:\n\n{prompts}"


def chart(rows: list[dict], path: Path) -> None:
    """Output tok/s and ITL p95 against users, TTFT against prompt tokens: one line per server."""
    plt = pyplot()
    from matplotlib.ticker import FuncFormatter

    figure, (tok_s, itl, ttft) = plt.subplots(1, 3, figsize=(15, 4.5))
    for server in dict.fromkeys(r["server"] for r in rows):
        users = [r for r in rows if r["server"] == server and r["axis"] == "users"]
        prompts = [r for r in rows if r["server"] == server and r["axis"] == "prompt_tokens"]
        tok_s.plot([r["x"] for r in users], [r["output_tok_s"] for r in users], marker="o", label=server)
        itl.plot([r["x"] for r in users], [r["itl_p95"] * 1000 for r in users], marker="o", label=server)
        ttft.plot([r["mean_prompt_tokens"] for r in prompts], [r["ttft_p50"] for r in prompts], marker="o",
                  label=server)
    plain = FuncFormatter(lambda value, _: f"{value:g}")  # 1024, not 2^10
    for axis, x_label, title in ((tok_s, "users at once", "output tokens/s (higher is better)"),
                                 (itl, "users at once", "inter-token latency p95, ms (log)"),
                                 (ttft, "prompt tokens, one user", "time to first token p50, s (log)")):
        axis.set_xscale("log", base=2)
        axis.xaxis.set_major_formatter(plain)
        axis.set_xlabel(x_label)
        axis.set_title(title)
        axis.grid(alpha=0.3)
        axis.legend()
    tok_s.set_ylim(bottom=0)
    for axis in (itl, ttft):
        axis.set_yscale("log", base=2)
        axis.yaxis.set_major_formatter(plain)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)

"""The comparison's report: the machine it ran on, the targets as ratios, a Markdown table, a chart."""

from __future__ import annotations

import importlib.metadata
import os
import platform
import statistics
import subprocess
from dataclasses import dataclass
from pathlib import Path

from bench.stats import markdown_table

REFERENCE = "llama-server"


@dataclass(frozen=True)
class Target:
    workload: str
    metric: str
    goal: float  # kvserve's value over the reference's, from the same run
    higher_is_better: bool
    reference: str = REFERENCE

    def describe(self) -> str:
        bound = "≥" if self.higher_is_better else "≤"
        return f"{self.workload}: {LABELS[self.metric]} {bound} {self.goal:g}x {self.reference}"


LABELS = {"output_tok_s": "output tok/s", "ttft_p95": "TTFT p95", "itl_p95": "ITL p95 (per token)"}
TARGETS = [
    Target("shared", "output_tok_s", 3.0, True),
    Target("shared", "ttft_p95", 0.2, False),
    Target("multiturn", "output_tok_s", 2.5, True),
    Target("unique", "output_tok_s", 1.0, True),
    Target("unique", "itl_p95", 1.0, False),
    Target("long", "output_tok_s", 1.0, True),
    Target("conversations", "output_tok_s", 1.5, True),
    Target("conversations", "output_tok_s", 1.5, True, "llama-server-defaults"),
]


def machine() -> dict:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=Path(__file__).parent).stdout.strip()
    return {"cpu": cpu, "cores": os.cpu_count(), "memory_gib": round(memory), "os": platform.platform(),
            "python": platform.python_version(), "llama_cpp_python": importlib.metadata.version("llama-cpp-python"),
            "kvserve_commit": commit or None}


def targets(rows: list[dict]) -> list[dict]:
    """Each target whose workload ran on both kvserve and the target's reference: kvserve's value over
    the reference's in each turn both ran (a row without a turn is turn 0), and their median."""
    by = {(r["server"], r["workload"], r.get("turn", 0)): r for r in rows}
    out = []
    for t in TARGETS:
        ratios = [mine[t.metric] / by[t.reference, workload, turn][t.metric]
                  for (server, workload, turn), mine in by.items()
                  if server == "kvserve" and workload == t.workload and (t.reference, workload, turn) in by]
        if ratios:
            ratio = statistics.median(ratios)
            met = ratio >= t.goal if t.higher_is_better else ratio <= t.goal
            out.append({"target": t.describe(), "ratio": ratio, "by_turn": ratios, "met": met})
    return out


def medians(rows: list[dict]) -> list[dict]:
    """One row per server and workload: each figure the median over its turns."""
    groups: dict[tuple[str, str], list[dict]] = {}
    for r in rows:
        groups.setdefault((r["server"], r["workload"]), []).append(r)
    return [{**mine[0], **{k: statistics.median(r[k] for r in mine) for k in MEDIAN_KEYS
                           if all(isinstance(r.get(k), (int, float)) for r in mine)}} for mine in groups.values()]


MEDIAN_KEYS = ("ttft_p50", "ttft_p95", "itl_p50", "itl_p95", "gap_p95", "output_tok_s", "requests_s")


def cached(row: dict) -> str:
    if row["cached_tokens"] is None:
        return "not reported"
    return f"{row['cached_tokens']} / {row['prompt_tokens']} ({row['cached_tokens'] / max(row['prompt_tokens'], 1):.0%})"


def describe_machine(m: dict) -> str:
    """`machine()` as the first words of a report."""
    return (f"{m['cpu']}, {m['cores']} cores, {m['memory_gib']} GiB, {m['os']}; llama-cpp-python "
            f"{m['llama_cpp_python']}, kvserve {m['kvserve_commit']}")


def markdown(result: dict) -> str:
    s = result["settings"]
    turns = f", {s['runs']} turns per workload" if s.get("runs") else ""
    header = (f"{describe_machine(result['machine'])}; {s['model']}, {s['threads']} threads, "
              f"{s['slots']} slots x {s['ctx_per_request']} context, {s['max_tokens']} output tokens per request{turns}.")
    table = markdown_table(
        ["workload", "server", "turn", "TTFT p50 s", "TTFT p95 s", "ITL p50 ms", "ITL p95 ms", "chunk gap p95 ms",
         "output tok/s", "requests/s", "cached prompt tokens", "errors"],
        [[r["workload"], r["server"], r.get("turn", 0), r["ttft_p50"], r["ttft_p95"], r["itl_p50"] * 1000,
          r["itl_p95"] * 1000, r["gap_p95"] * 1000 if "gap_p95" in r else None, r["output_tok_s"], r["requests_s"],
          cached(r), r["errors"]] for r in result["rows"]])
    goals = markdown_table(["target", "kvserve / reference (median)", "by turn", "met"],
                           [[t["target"], f"{t['ratio']:.2f}x", ", ".join(f"{x:.2f}x" for x in t.get("by_turn", ())),
                             "yes" if t["met"] else "**no**"] for t in result["targets"]])
    return f"{header}\n\n{table}\n\n{goals}"


def chart(rows: list[dict], path: Path) -> None:
    """TTFT (p50 bar, whisker to p95) and output tok/s per workload, one bar per server (medians over turns)."""
    plt = pyplot()
    workload_names = list(dict.fromkeys(r["workload"] for r in rows))
    servers = list(dict.fromkeys(r["server"] for r in rows))
    by = {(r["server"], r["workload"]): r for r in medians(rows)}
    width = 0.8 / len(servers)
    figure, (ttft, throughput) = plt.subplots(1, 2, figsize=(12, 4.5))
    for i, server in enumerate(servers):
        xs = [w + (i - (len(servers) - 1) / 2) * width for w in range(len(workload_names))]
        mine = [by.get((server, w)) for w in workload_names]
        p50 = [r["ttft_p50"] if r else 0 for r in mine]
        p95 = [r["ttft_p95"] if r else 0 for r in mine]
        ttft.bar(xs, p50, width, label=server, yerr=[[0] * len(p50), [b - a for a, b in zip(p50, p95)]], capsize=3)
        bars = throughput.bar(xs, [r["output_tok_s"] if r else 0 for r in mine], width, label=server)
        throughput.bar_label(bars, fmt="%.3g", fontsize=7)  # the long workload's bars are too short to read
    for axis, title in ((ttft, "time to first token, s (p50, whisker to p95; log)"),
                        (throughput, "output tokens/s (higher is better)")):
        axis.set_xticks(range(len(workload_names)), workload_names)
        axis.set_title(title)
        axis.grid(axis="y", alpha=0.3)
    ttft.set_yscale("log")
    throughput.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def pyplot():
    """matplotlib.pyplot drawing to files: there is no display on a server."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt

"""python -m bench kv-events: what publishing KV events costs a server that nobody listens to.

`python -m bench`'s shared and multiturn workloads (SmolLM2-135M, the sizes they are there) on a server
without events (`off`) and one with `--kv-events tcp://127.0.0.1:PORT` and no subscriber (`events`),
one server at a time in turns (off events events off ...), a fresh server each. Per turn: output tokens
per second, TTFT, the engine's mean step (`kvserve_engine_step_seconds_total` over `..._steps_total`),
and the events published and dropped. The claim it checks: the publisher never blocks the engine, so
`events` / `off` stays within the box's drift of 1.0 on every figure (a ratio, not a timed assertion).

python -m bench kv-events [--quick] [--runs 2]  -> bench/results/kv_events{,-partial}.{json,md}
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from bench import compare, report, workloads
from bench.restart import START_CAP, loadavg, the_workloads, workload_ratios, workload_turns
from bench.stats import markdown_table, summarize
from kvserve.config import embedded_model_path
from kvserve.testing import ServerProcess, free_port, kvserve_command, read_metrics

RESULTS = Path(__file__).parent / "results"
RUNS = 2
CONFIGS = ("off", "events")
METRICS = ("output_tok_s", "ttft_p50", "ttft_p95", "step_ms")


def measure(config: str, workload: workloads.Workload, max_tokens: int, extra: dict) -> dict:
    port = free_port()
    settings = {"port": port, "model": str(embedded_model_path()), "threads": os.cpu_count() or 1,
                "parallel": compare.SLOTS, "ctx_size": compare.CTX_PER_REQUEST}
    if config == "events":
        settings["kv_events"] = f"tcp://127.0.0.1:{free_port()}"
    row = {"config": config, "workload": workload.name, "loadavg": loadavg()}
    with ServerProcess(kvserve_command(**settings), port, RESULTS / f"kv-events-{config}-{workload.name}.log") as p:
        p.wait_healthy(timeout=START_CAP)
        workloads.run_sync(p.url, workloads.Workload("warm-up", 1, 1, lambda *_: compare.WARM_UP), 8, extra)
        before = read_metrics(p.url)
        ran = workloads.run_sync(p.url, workload, max_tokens, extra)
        after = read_metrics(p.url)
    row |= summarize(ran.results, ran.wall)
    steps = after.total("kvserve_engine_steps_total") - before.total("kvserve_engine_steps_total")
    seconds = after.total("kvserve_engine_step_seconds_total") - before.total("kvserve_engine_step_seconds_total")
    row["step_ms"] = 1000 * seconds / steps if steps else None
    row["published"] = after.total("kvserve_kv_events_published_total")
    row["dropped"] = after.total("kvserve_kv_events_dropped_total")
    return row


def markdown(result: dict) -> str:
    lines = [report.describe_machine(result["machine"]), "",
             f"SmolLM2-135M, {compare.SLOTS} slots x {compare.CTX_PER_REQUEST} context, {result['max_tokens']} output "
             f"tokens per request; turns {', '.join(result['turns'])} per workload, a fresh server each; `events`: "
             "`--kv-events tcp://127.0.0.1:PORT`, nothing subscribed. Load average before "
             f"{result['loadavg_before']}, after {result['loadavg_after']} ({result['seconds']} s).", ""]
    lines.append(markdown_table(
        ["workload", "turn", "config", "output tok/s", "TTFT p50 s", "TTFT p95 s", "mean step ms", "events published",
         "events dropped", "errors"],
        [[r["workload"], r["turn"], r["config"], f"{r['output_tok_s']:.3g}", f"{r['ttft_p50']:.3g}",
          f"{r['ttft_p95']:.3g}", f"{r['step_ms']:.3g}" if r.get("step_ms") else "-", int(r["published"]),
          int(r["dropped"]), r["errors"]] for r in result["rows"]]))
    lines += ["", markdown_table(
        ["workload", "events / off", "median (lowest-highest)"],
        [[name, metric, f"{v['median']:.3f}x ({v['min']:.3g}-{v['max']:.3g}, {v['pairs']} pairs)" if v else "n/a"]
         for name, metrics in result["ratios"].items() for metric, v in metrics.items()])]
    return "\n".join(lines)


def main(quick: bool = False, runs: int | None = None) -> str:
    runs = runs or (1 if quick else RUNS)
    max_tokens = 16 if quick else compare.MAX_TOKENS
    extra = {"logit_bias": compare.end_of_generation_bias(embedded_model_path())}
    turns = workload_turns(runs, CONFIGS)
    result: dict = {"machine": report.machine(), "loadavg_before": loadavg(), "turns": turns,
                    "max_tokens": max_tokens, "rows": []}
    began = time.monotonic()
    for workload in the_workloads(quick):
        for turn, config in enumerate(turns):
            row = measure(config, workload, max_tokens, extra) | {"turn": turn}
            result["rows"].append(row)
            print(f"{workload.name:>10} {config:>6} turn {turn}: {row['output_tok_s']:.1f} tok/s, TTFT p50 "
                  f"{row['ttft_p50']:.3f} s, step {row['step_ms']} ms, published {row['published']:.0f}, "
                  f"dropped {row['dropped']:.0f}, errors {row['errors']}", flush=True)
    result["ratios"] = workload_ratios(result["rows"], CONFIGS, METRICS)
    result["seconds"] = round(time.monotonic() - began)
    result["loadavg_after"] = loadavg()
    name = "kv_events-partial" if quick else "kv_events"
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps(result, indent=1) + "\n")
    text = markdown(result)
    (RESULTS / f"{name}.md").write_text(text + "\n")
    return text

"""kvserve's Grafana dashboard as code. `python -m deploy.observability.dashboard` rewrites
kvserve.json beside this file, the JSON that Grafana provisions; a test fails when the two differ.

Every series is selected with `instance=~"$instance"`, so one dashboard shows one replica or a
fleet, and every per-model one (all but the server-wide `process_*`; the vLLM-compatible row's
too) with `model_name=~"$model_name"`, so it shows one model, some or all; panels draw a line per
model. Built with grafana-foundation-sdk, Grafana's own typed builders."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from grafana_foundation_sdk.builders.common import VizLegendOptions, VizTooltipOptions
from grafana_foundation_sdk.builders.dashboard import (
    Dashboard, DatasourceVariable, QueryVariable, Row, TextBoxVariable,
)
from grafana_foundation_sdk.builders.prometheus import Dataquery
from grafana_foundation_sdk.builders.timeseries import Panel
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models.common import (
    LegendDisplayMode, LegendPlacement, SortOrder, TooltipDisplayMode,
)
from grafana_foundation_sdk.models.dashboard import (
    DashboardCursorSync, DataSourceRef, VariableOption, VariableRefresh, VariableSort,
)

JSON_PATH = Path(__file__).with_name("kvserve.json")
DATASOURCE = DataSourceRef(type_val="prometheus", uid="${datasource}")
QUANTILES = (0.5, 0.95, 0.99)
TOKENS_PER_SECOND = "suffix: tok/s"


@dataclass(frozen=True)
class Query:
    expr: str
    legend: str


@dataclass(frozen=True)
class Graph:
    """One time-series panel: the question it answers (its description) and the queries that answer it."""
    title: str
    description: str
    unit: str
    queries: tuple[Query, ...]


@dataclass(frozen=True)
class Section:
    """A dashboard row. Collapsed rows hold what only some deployments have."""
    title: str
    graphs: tuple[Graph, ...]
    collapsed: bool = False


MODEL = 'model_name=~"$model_name"'
SERVER_WIDE = ("process_",)  # series of the whole process: no model_name


def selector(metric: str, *matchers: str) -> str:
    """`metric` on the picked replicas, and, unless it is server-wide, of the picked models."""
    model = () if metric.startswith(SERVER_WIDE) else (MODEL,)
    return metric + "{" + ", ".join(('instance=~"$instance"', *model, *matchers)) + "}"


def rate(metric: str, *matchers: str) -> str:
    return f"rate({selector(metric, *matchers)}[$__rate_interval])"


def by_instance(expr: str) -> str:
    return f"sum by (instance) ({expr})"


def by_model(expr: str) -> str:
    """A line per model and replica."""
    return f"sum by (instance, model_name) ({expr})"


PER_MODEL = "{{model_name}} {{instance}}"


def quantiles(histogram: str) -> tuple[Query, ...]:
    """p50/p95/p99 of each model over the selected instances, from the histogram's buckets."""
    return tuple(Query(f"histogram_quantile({q}, sum by (model_name, le) ({rate(histogram + '_bucket')}))",
                       f"p{round(q * 100)} {{{{model_name}}}}")
                 for q in QUANTILES)


def ratio(hits: str, queries: str, by: str, *matchers: str) -> str:
    return f"sum by ({by}) ({rate(hits, *matchers)}) / sum by ({by}) ({rate(queries, *matchers)})"


SECTIONS = (
    Section("Traffic: what is asked of the server", (
        Graph("Finished requests by finish reason",
              "Requests per second that finished: stop (end of text or a stop string), length (max_tokens), "
              "abort (the client left), error (a decode failed mid-stream).", "reqps",
              (Query(f"sum by (model_name, finish_reason) ({rate('kvserve_request_success_total')})",
                     "{{finish_reason}} {{model_name}}"),)),
        Graph("Running and waiting requests",
              "Requests decoding now (at most --parallel) and requests queued for a slot. A queue that stays "
              "above zero means the replica is saturated.", "short",
              (Query(by_model(selector("kvserve_requests_running")), f"running {PER_MODEL}"),
               Query(by_model(selector("kvserve_requests_waiting")), f"waiting {PER_MODEL}"))),
        Graph("Rejected requests",
              "Requests per second refused for load: 429 queue full (--max-queue), 503 queue timeout "
              "(--queue-timeout) or the model stopping, by model; a 503 while the replica shuts down has no "
              "model (shown under All only).", "reqps",
              (Query(f"sum by (model_name, status) ({rate('kvserve_request_rejected_total')})",
                     "{{status}} {{model_name}}"),)),
        Graph("Preemptions",
              "Running requests per second sent back to the queue for lack of KV cells; each recomputes "
              "what the cache no longer holds when readmitted.", "ops",
              (Query(by_model(rate("kvserve_preemptions_total")), PER_MODEL),)),
        Graph("Oldest waiting request",
              "Age of the oldest request not yet admitted. It should fall back to zero between bursts; a "
              "steady climb is a saturated replica, a climb with no engine steps is a stall.", "s",
              (Query(by_model(selector("kvserve_oldest_waiting_seconds")), PER_MODEL),)),
    )),
    Section("Latency: how long clients wait", (
        Graph("Time to first token", "Arrival to the first generated token: queue time plus the prefill of "
              "the part of the prompt the cache did not hold.", "s",
              quantiles("kvserve_time_to_first_token_seconds")),
        Graph("Inter-token latency", "Time between two tokens of one request.", "s",
              quantiles("kvserve_inter_token_latency_seconds")),
        Graph("End-to-end latency", "Arrival to the last token.", "s",
              quantiles("kvserve_e2e_request_latency_seconds")),
        Graph("Queue time", "Arrival to admission into the running batch.", "s",
              quantiles("kvserve_request_queue_time_seconds")),
    )),
    Section("Throughput: what the engine gets done", (
        Graph("Tokens per second", "Prompt tokens of finished requests (cached ones included) and generated "
              "tokens.", TOKENS_PER_SECOND,
              (Query(f"sum by (model_name) ({rate('kvserve_prompt_tokens_total')})", "prompt {{model_name}}"),
               Query(f"sum by (model_name) ({rate('kvserve_generation_tokens_total')})",
                     "generated {{model_name}}"))),
        Graph("Engine steps", "Scheduler steps per second; each admits requests, decodes one batch and "
              "samples.", "ops",
              (Query(by_model(rate("kvserve_engine_steps_total")), PER_MODEL),)),
        Graph("Engine time", "busy: share of wall time the engine thread spends in each model's steps (a "
              "replica's models take turns, so their lines add up to the thread's). in llama_decode: share of "
              "step time inside llama.cpp's decode; the rest is scheduling, sampling and cache bookkeeping.",
              "percentunit",
              (Query(by_model(rate("kvserve_engine_step_seconds_total")), f"busy {PER_MODEL}"),
               Query(ratio("kvserve_engine_decode_seconds_total", "kvserve_engine_step_seconds_total",
                           "instance, model_name"), f"in llama_decode {PER_MODEL}"))),
    )),
    Section("Health: what a long-running replica must hold steady", (
        Graph("Resident memory", "The process's resident memory. After warm-up (model, KV cache, caches "
              "filled) it stays flat; a straight climb with traffic is a per-request leak.", "bytes",
              (Query(by_instance(selector("process_resident_memory_bytes")), "{{instance}}"),)),
        Graph("Live sampler chains", "llama.cpp sampler chains allocated and not yet freed: one per running "
              "choice, so it follows running requests and is 0 when the replica is idle.", "short",
              (Query(by_model(selector("kvserve_live_sampler_chains")), PER_MODEL),)),
        Graph("Engine stalls", "Stalls per second: requests in flight and no engine progress for "
              "--stall-seconds. Each is logged once with the scheduler's state.", "ops",
              (Query(by_model(rate("kvserve_engine_stalls_total")), PER_MODEL),)),
    )),
    Section("Prefix cache: how much prefill the cache saves", (
        Graph("Cache hit ratio", "Share of prompt tokens attached from the prefix cache instead of "
              "prefilled: hit tokens / queried tokens.", "percentunit",
              (Query(ratio("kvserve_prefix_cache_hit_tokens_total", "kvserve_prefix_cache_queried_tokens_total",
                           "instance, model_name"), PER_MODEL),)),
        Graph("Prefill saved", "Prompt tokens per second attached from the cache: tokens llama.cpp did not "
              "have to prefill.", TOKENS_PER_SECOND,
              (Query(by_model(rate("kvserve_prefix_cache_hit_tokens_total")), PER_MODEL),)),
        Graph("Host memory against --prefix-state-mb",
              "Bytes of host memory the prefix cache's pages and checkpoints take against its budget, the "
              "picked models of each replica together (with several models each one's cache gets "
              "--prefix-state-mb / --models-max); set the variable prefix_state_mb to the replicas' "
              "--prefix-state-mb.", "bytes",
              (Query(by_instance(selector("kvserve_prefix_cache_held_bytes")), "held {{instance}}"),
               Query("$prefix_state_mb * 1024 * 1024", "--prefix-state-mb"))),
        Graph("Evictions", "Pages per second the cache gave back for room. A steady rate means the hot "
              "prefixes outgrow --prefix-state-mb.", "suffix: pages/s",
              (Query(by_model(rate("kvserve_prefix_cache_evicted_pages_total")), PER_MODEL),)),
        Graph("KV cache usage", "Share of the streams' KV cells in use, every stream together (a finished "
              "conversation's stream keeps its rows for its next turn until the stream is needed).", "percentunit",
              (Query(by_model(selector("kvserve_kv_cache_usage_ratio")), PER_MODEL),)),
    )),
    Section("Recurrent-state checkpoints (models that carry state: Mamba, LFM2, hybrids)", (
        Graph("Checkpoint bytes", "Bytes of recurrent-state checkpoints, kept in the prefix cache's host "
              "memory under --prefix-state-mb beside its pages.", "bytes",
              (Query(by_model(selector("kvserve_prefix_state_bytes")), f"held {PER_MODEL}"),)),
        Graph("Checkpoints by kind", "opening: the end of a shared prompt head (system prompt); "
              "conversation: where a finished turn ended, for the conversation's next turn.", "short",
              (Query(f"sum by (instance, model_name, kind) ({selector('kvserve_prefix_state_checkpoints')})",
                     f"{{{{kind}}}} {PER_MODEL}"),)),
        Graph("Checkpoint hits and evictions", "Prompts per second restored from a checkpoint instead of "
              "prefilled, and checkpoints evicted to keep the budget.", "ops",
              (Query(by_model(rate("kvserve_prefix_state_hits_total")), f"hits {PER_MODEL}"),
               Query(by_model(rate("kvserve_prefix_state_evictions_total")), f"evictions {PER_MODEL}"))),
    ), collapsed=True),
    Section("vLLM-compatible series (--metrics-compat vllm): what routers read", (
        Graph("Running and waiting requests by model",
              "vllm:num_requests_running and vllm:num_requests_waiting, the load that load-aware routers see.",
              "short",
              (Query(f"sum by (model_name) ({selector('vllm:num_requests_running')})",
                     "running {{model_name}}"),
               Query(f"sum by (model_name) ({selector('vllm:num_requests_waiting')})",
                     "waiting {{model_name}}"))),
        Graph("KV cache usage by model", "vllm:kv_cache_usage_perc, 1 meaning 100%.", "percentunit",
              (Query(f"max by (instance, model_name) ({selector('vllm:kv_cache_usage_perc')})",
                     "{{model_name}} {{instance}}"),)),
        Graph("Prefix cache hit ratio by model",
              "vllm:prefix_cache_hits_total / vllm:prefix_cache_queries_total over the selected replicas.",
              "percentunit",
              (Query(ratio("vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total", "model_name"),
                     "{{model_name}}"),)),
    ), collapsed=True),
)


def _panel(graph: Graph, panel_id: int, width: int) -> Panel:
    panel = (Panel().id(panel_id).title(graph.title).description(graph.description).unit(graph.unit)
             .datasource(DATASOURCE).span(width).height(8).min(0)
             .legend(VizLegendOptions().display_mode(LegendDisplayMode.LIST).placement(LegendPlacement.BOTTOM)
                     .show_legend(True))
             .tooltip(VizTooltipOptions().mode(TooltipDisplayMode.MULTI).sort(SortOrder.DESCENDING)))
    for ref, query in zip("ABCDEFGH", graph.queries, strict=False):
        panel = panel.with_target(Dataquery().ref_id(ref).expr(query.expr).legend_format(query.legend)
                                  .datasource(DATASOURCE))
    return panel


def _query_variable(name: str, query: str, label: str) -> QueryVariable:
    return (QueryVariable(name).label(label).datasource(DATASOURCE).query(query).multi(True).include_all(True)
            .all_value(".*").refresh(VariableRefresh.ON_TIME_RANGE_CHANGED).sort(VariableSort.ALPHABETICAL_ASC))


def _setting(name: str, default: str, description: str) -> TextBoxVariable:
    return (TextBoxVariable(name).description(description).default_value(default)
            .current(VariableOption(text=default, value=default)))


def build() -> Dashboard:
    dashboard = (
        Dashboard("kvserve").uid("kvserve").tags(["kvserve", "llm"])
        .description("Generated by deploy/observability/dashboard.py; edit that, not the JSON.")
        .time("now-1h", "now").refresh("30s").timezone("browser").tooltip(DashboardCursorSync.CROSSHAIR)
        .with_variable(DatasourceVariable("datasource").label("Data source").type("prometheus"))
        .with_variable(_query_variable("instance", "label_values(kvserve_requests_running, instance)", "Replica"))
        .with_variable(_query_variable(
            "model_name", 'label_values(kvserve_requests_running{instance=~"$instance"}, model_name)', "Model"))
        .with_variable(_setting("prefix_state_mb", "8192", "the replicas' --prefix-state-mb"))
    )
    panel_id = 0
    for section in SECTIONS:
        panel_id += 1
        row = Row(section.title).id(panel_id).collapsed(section.collapsed)
        width = 6 if len(section.graphs) % 4 == 0 else 8
        panels = []
        for graph in section.graphs:
            panel_id += 1
            panels.append(_panel(graph, panel_id, width))
        if section.collapsed:  # Grafana keeps a collapsed row's panels inside the row
            for panel in panels:
                row = row.with_panel(panel)
            dashboard = dashboard.with_row(row)
        else:
            dashboard = dashboard.with_row(row)
            for panel in panels:
                dashboard = dashboard.with_panel(panel)
    return dashboard


def render() -> str:
    return JSONEncoder(sort_keys=True, indent=2).encode(build().build()) + "\n"


def main() -> None:
    JSON_PATH.write_text(render())
    print(f"wrote {JSON_PATH}")


if __name__ == "__main__":
    main()

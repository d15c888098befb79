"""Prometheus metrics. Per-request timings are observed as outputs stream; engine-wide numbers are
read at scrape time from the snapshot the engine thread publishes after every step."""

from __future__ import annotations

import time
from typing import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvserve.config import ServerSettings
from kvserve.scheduler.async_engine import AsyncEngine
from kvserve.scheduler.request import FinishReason, RequestOutput
from kvserve.scheduler.scheduler import StepTimes
from kvserve.scheduler.snapshot import EngineSnapshot
from kvserve.server.namespace import NAMESPACE_KINDS
from kvserve.tools.parser import TOOL_CALLS

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_TOKEN_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0, 2.5)


# The engines of the loaded models, by served name: (name, snapshot, step times, queue) read at scrape time.
EngineViews = Callable[[], list[tuple[str, EngineSnapshot, StepTimes, AsyncEngine]]]


class _EngineCollector(Collector):
    """Each loaded model's engine numbers, each sample labelled with its `model_name` (vLLM's label),
    one model or several; a model that is not loaded has no samples."""

    def __init__(self, engines: EngineViews) -> None:
        self._engines = engines

    def collect(self) -> Iterator[Metric]:
        merged: dict[str, Metric] = {}
        for name, snapshot, times, queue in self._engines():
            for family in self._families(snapshot, times, queue):
                into = merged.setdefault(family.name, Metric(family.name, family.documentation, family.type))
                for sample in family.samples:
                    into.add_sample(sample.name, {"model_name": name, **sample.labels}, sample.value)
        yield from merged.values()

    @staticmethod
    def _families(s: EngineSnapshot, t: StepTimes, queue: AsyncEngine) -> Iterator[Metric]:
        yield GaugeMetricFamily("kvserve_requests_running", "Requests with sequences in the KV cache", s.running)
        yield GaugeMetricFamily("kvserve_requests_waiting", "Requests waiting for admission", s.waiting)
        yield GaugeMetricFamily(
            "kvserve_oldest_waiting_seconds", "Age of the oldest request not yet admitted (0: none waits)",
            queue.oldest_waiting_seconds(),
        )
        yield CounterMetricFamily(
            "kvserve_engine_stalls", "Times the engine had work and made no progress for --stall-seconds",
            queue.stall_watch.stalls,
        )
        yield GaugeMetricFamily(
            "kvserve_live_sampler_chains", "llama.cpp sampler chains allocated and not yet freed", s.live_samplers
        )
        yield GaugeMetricFamily(
            "kvserve_kv_cache_usage_ratio", "Share of KV cells in use, every stream together", s.kv_usage
        )
        yield GaugeMetricFamily("kvserve_prefix_cache_held_pages", "Pages the prefix cache keeps", s.cache.held_pages)
        yield GaugeMetricFamily(
            "kvserve_prefix_cache_held_bytes", "Host memory the prefix cache's pages and states take",
            s.cache.held_bytes,
        )
        yield GaugeMetricFamily(
            "kvserve_prefix_cache_locked_entries",
            "Cached pages or checkpoints a live request reads (0 whenever no request is open)", s.cache.locked_entries,
        )
        yield GaugeMetricFamily(
            "kvserve_live_kv_sessions", "KV streams running a sequence (0 whenever no request is open)", s.live_sessions
        )
        yield CounterMetricFamily(
            "kvserve_prefix_cache_inplace_reuse", "Sequences started in a stream that still held their prefix",
            s.inplace_reuses,
        )
        yield CounterMetricFamily(
            "kvserve_prefix_cache_inplace_tokens", "Prompt tokens kept in place in a stream instead of evaluated",
            s.inplace_tokens,
        )
        yield CounterMetricFamily(
            "kvserve_prefix_cache_queried_tokens", "Prompt tokens looked up in the prefix cache", s.cache.queried_tokens
        )
        yield CounterMetricFamily(
            "kvserve_prefix_cache_hit_tokens", "Prompt tokens not evaluated: attached from the cache or kept in place",
            s.cache.hit_tokens,
        )
        yield CounterMetricFamily(
            "kvserve_prefix_cache_evicted_pages", "Pages the prefix cache gave back", s.cache.evicted_pages
        )
        yield from _by_namespace_kind(s)
        yield GaugeMetricFamily(
            "kvserve_prefix_state_bytes", "Bytes of recurrent checkpoint states", s.cache.state_bytes
        )
        checkpoints = GaugeMetricFamily(
            "kvserve_prefix_state_checkpoints", "Recurrent checkpoints kept, by kind", labels=["kind"]
        )
        checkpoints.add_metric(["opening"], s.cache.opening_checkpoints)
        checkpoints.add_metric(["conversation"], s.cache.conversation_checkpoints)
        yield checkpoints
        yield CounterMetricFamily("kvserve_prefix_state_hits", "Prompts restored from a checkpoint", s.cache.state_hits)
        yield CounterMetricFamily(
            "kvserve_prefix_state_evictions", "Checkpoints evicted to keep the budget", s.cache.state_evictions
        )
        yield CounterMetricFamily(
            "kvserve_preemptions", "Running requests sent back to the queue because llama.cpp found no KV slot",
            s.preemptions,
        )
        drafts = CounterMetricFamily("kvserve_spec_drafts", "Drafts verified, by drafter", labels=["drafter"])
        drafted = CounterMetricFamily("kvserve_spec_draft_tokens", "Draft tokens verified, by drafter", labels=["drafter"])
        accepted = CounterMetricFamily(
            "kvserve_spec_accepted_tokens", "Draft tokens the target accepted, by drafter (acceptance length: "
            "accepted / drafts)", labels=["drafter"])
        for name, (n_drafts, n_drafted, n_accepted) in s.speculation.items():
            drafts.add_metric([name], n_drafts)
            drafted.add_metric([name], n_drafted)
            accepted.add_metric([name], n_accepted)
        dropped = CounterMetricFamily(
            "kvserve_spec_dropped_drafts", "Steps where auto drafted none of a sequence's proposal, by drafter and "
            "why: unlikely (to be accepted), priced (the cost table prices the step faster without it), measured (the "
            "sequence's drafted steps gave fewer tokens per second than its others)", labels=["drafter", "reason"])
        for name, stats in queue.scheduler.speculator.stats.items():  # read live: its keys are fixed at start
            for reason, n in stats.dropped.items():
                dropped.add_metric([name, reason.value], n)
        yield drafts
        yield drafted
        yield accepted
        yield dropped
        yield CounterMetricFamily("kvserve_engine_steps", "Engine steps run", t.steps)
        yield CounterMetricFamily("kvserve_engine_step_seconds", "Time spent in engine steps", t.step_seconds)
        yield CounterMetricFamily("kvserve_engine_decode_seconds", "Time spent inside llama_decode", t.decode_seconds)
        yield CounterMetricFamily("kvserve_engine_decodes", "llama_decode calls", t.decodes)
        yield CounterMetricFamily(
            "kvserve_engine_decode_tokens", "Tokens those calls carried (decode, draft and prompt tokens)",
            t.decode_tokens,
        )
        yield CounterMetricFamily(
            "kvserve_engine_loop_seconds", "Event-loop turns that ran a step, hand-off included", t.loop_seconds
        )


def _by_namespace_kind(s: EngineSnapshot) -> Iterator[Metric]:
    """Hits per namespace kind (shared, tenant, tenant+salt, ...: which parts a namespace has, never
    whose), every kind from the start at 0, and how many namespaces hold cached rows."""
    queried = CounterMetricFamily(
        "kvserve_prefix_cache_namespace_queried_tokens", "Prompt tokens of started requests, by namespace kind",
        labels=["namespace_kind"],
    )
    hits = CounterMetricFamily(
        "kvserve_prefix_cache_namespace_hit_tokens",
        "Prompt tokens of started requests not evaluated (kept in place or attached), by namespace kind",
        labels=["namespace_kind"],
    )
    for kind in NAMESPACE_KINDS:
        queried.add_metric([kind], s.cache.kind_queried.get(kind, 0))
        hits.add_metric([kind], s.cache.kind_hits.get(kind, 0))
    yield queried
    yield hits
    yield GaugeMetricFamily(
        "kvserve_prefix_cache_namespaces", "Cache namespaces (tenants, salts, adapter sets) holding cached rows",
        s.cache.namespaces,
    )


class _VllmCollector(Collector):
    """The engine numbers under vLLM's names and `model_name` label, the ones routers (load-aware
    policies) and existing vLLM dashboards read; the same snapshot as the kvserve_* ones."""

    def __init__(self, engines: EngineViews) -> None:
        self._engines = engines

    def collect(self) -> Iterator[Metric]:
        families: dict[str, Metric] = {}
        for model_name, s, _, _ in self._engines():
            for kind, name, doc, value in self._values(s):
                family = families.setdefault(name, kind(name, doc, labels=["model_name"]))
                family.add_metric([model_name], value)
        yield from families.values()

    @staticmethod
    def _values(s: EngineSnapshot) -> tuple:
        return (
            (GaugeMetricFamily, "vllm:num_requests_running", "Requests in the running batch", s.running),
            (GaugeMetricFamily, "vllm:num_requests_waiting", "Requests waiting for admission", s.waiting),
            (GaugeMetricFamily, "vllm:kv_cache_usage_perc", "KV-cache usage; 1 means 100 percent", s.kv_usage),
            (CounterMetricFamily, "vllm:prefix_cache_queries", "Prompt tokens queried in the prefix cache",
             s.cache.queried_tokens),
            (CounterMetricFamily, "vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache",
             s.cache.hit_tokens),
        )


# The refusals that come before any model is picked (a replica draining) count under this model_name:
# empty, which Prometheus stores as no label at all.
NO_MODEL = ""


class _TierCollector(Collector):
    """The server's disk tier and event publisher (one per server, shared by its models)."""

    def __init__(self, persistence: Callable[[], object]) -> None:
        self._persistence = persistence

    def collect(self) -> Iterator[Metric]:
        persistence = self._persistence()
        disk = getattr(persistence, "disk", None)
        if disk is not None:
            d = disk.stats()
            yield GaugeMetricFamily("kvserve_prefix_disk_bytes", "Bytes of page files the disk tier holds", d.bytes)
            yield GaugeMetricFamily("kvserve_prefix_disk_pages", "Pages the disk tier holds", d.pages)
            yield GaugeMetricFamily("kvserve_prefix_disk_budget_bytes", "The disk tier's budget", d.budget_bytes)
            for name, value, doc in (
                ("hits", d.hits, "Pages read back from disk"),
                ("writes", d.writes, "Pages written to disk"),
                ("written_bytes", d.written_bytes, "Bytes written to disk"),
                ("read_seconds", d.read_seconds, "Time spent reading pages from disk, summed over the reading threads"),
                ("write_seconds", d.write_seconds, "Time the writer spent writing pages"),
                ("refused", d.refused, "Page files found corrupt, truncated or foreign, and removed"),
                ("dropped_writes", d.dropped_writes, "Pages not written: the write queue was full"),
                ("evictions", d.evictions, "Page files removed to stay within the budget"),
            ):
                yield CounterMetricFamily(f"kvserve_prefix_disk_{name}", doc, value)
        runs = getattr(persistence, "runs", None)
        if runs is not None:
            r = runs.stats()
            yield GaugeMetricFamily("kvserve_prefix_disk_run_bytes",
                                    "Bytes of run files (long chains of pages again, one file each)", r.bytes)
            yield GaugeMetricFamily("kvserve_prefix_disk_runs", "Run files the disk tier holds", r.runs)
            yield GaugeMetricFamily("kvserve_prefix_disk_run_staged_bytes",
                                    "Bytes of the newest run, read into memory at start until a restore takes it",
                                    r.staged_bytes)
            for name, value, doc in (
                ("run_hits", r.hits, "Prompts restored from a run file"),
                ("run_staged_hits", r.staged_hits, "Of those, restored from the run staged in memory at start"),
                ("run_writes", r.writes, "Run files written"),
                ("run_refused", r.refused, "Run files found corrupt, truncated or foreign, and removed"),
            ):
                yield CounterMetricFamily(f"kvserve_prefix_disk_{name}", doc, value)
        publisher = getattr(persistence, "publisher", None)
        if publisher is not None:
            p = publisher.stats()
            yield CounterMetricFamily("kvserve_kv_events_published", "KV events published", p.get("events", 0))
            yield CounterMetricFamily("kvserve_kv_events_dropped",
                                      "KV events dropped: the publisher's queue was full", p.get("dropped", 0))


class Metrics:
    """Per-request series, each labelled with the served model's `model_name` (one model or several,
    as vLLM does), the engine collector's (the same label), and the server-wide ones: refusals while
    draining (`model_name` empty), `kvserve_unexpected_errors{route}` and `process_*`."""

    def __init__(self, engines: EngineViews, settings: ServerSettings,
                 persistence: Callable[[], object] = lambda: None) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self._engines = engines
        model = ["model_name"]
        self.prompt_tokens = Counter(
            "kvserve_prompt_tokens", "Prompt tokens of finished requests", model, registry=None
        )
        self.generation_tokens = Counter("kvserve_generation_tokens", "Generated tokens", model, registry=None)
        self.success = Counter(
            "kvserve_request_success", "Finished requests by finish reason", [*model, "finish_reason"], registry=None
        )
        self.ttft = Histogram(
            "kvserve_time_to_first_token_seconds", "Arrival to first token", model, buckets=_LATENCY_BUCKETS,
            registry=None,
        )
        self.itl = Histogram(
            "kvserve_inter_token_latency_seconds", "Time between streamed tokens", model, buckets=_TOKEN_BUCKETS,
            registry=None,
        )
        self.e2e = Histogram(
            "kvserve_e2e_request_latency_seconds", "Arrival to last token", model, buckets=_LATENCY_BUCKETS,
            registry=None,
        )
        self.queue = Histogram(
            "kvserve_request_queue_time_seconds", "Arrival to admission", model, buckets=_LATENCY_BUCKETS,
            registry=None,
        )
        self.rejected = Counter(
            "kvserve_request_rejected", "Requests refused for load: a model's queue full (429), its queue timeout "
            "or its engine stopping (503); model_name empty: refused while the server drains (503)",
            [*model, "status"], registry=None,
        )
        self.unexpected = Counter(
            "kvserve_unexpected_errors", "Requests a server bug ended (500 server_error, traceback in the log)",
            ["route"], registry=r,
        )
        ProcessCollector(registry=r)  # process_resident_memory_bytes and friends: the memory a soak watches
        self._by_model = (self.prompt_tokens, self.generation_tokens, self.success, self.ttft, self.itl, self.e2e,
                          self.queue, self.rejected)
        self._models: set[str] = set()
        # Every label value exists at 0 before its first count: a series born at 1 on its first 429 or
        # error is one increase()/rate() cannot see, so the alerts on them would miss it. A model's are
        # made when it loads (`model`); the draining refusal, of no model, from the server's start.
        self.rejected.labels(model_name=NO_MODEL, status="503")
        r.register(_PerModelSeries(self, self._by_model))
        r.register(_EngineCollector(engines))
        r.register(_TierCollector(persistence))
        if settings.metrics_compat == "vllm":
            r.register(_VllmCollector(engines))

    def model(self, name: str) -> str:
        """`name`, once its model's series exist, each label value at 0. A model's series begin at its
        load: a scrape makes those of every model loaded then, before reading them, and a request those
        of its model, before counting anything; so Prometheus sees them as if the load had made them,
        at 0 in every scrape from the load until the first count (kept out of app.py and the model set,
        which need not know of metrics). They stay once made: a model unloaded and loaded again counts
        on (its engine series, read live, are absent while it is unloaded)."""
        if name not in self._models:
            for reason in [*(r.value for r in FinishReason), TOOL_CALLS]:
                self.success.labels(model_name=name, finish_reason=reason)
            for status in ("429", "503"):
                self.rejected.labels(model_name=name, status=status)
            for family in (self.prompt_tokens, self.generation_tokens, self.ttft, self.itl, self.e2e, self.queue):
                family.labels(model_name=name)
            self._models.add(name)
        return name

    def loaded_models(self) -> None:
        """Make the series of every model loaded now (`model`)."""
        for name, *_ in self._engines():
            self.model(name)


class _PerModelSeries(Collector):
    """The per-request families, read through this collector rather than registered on their own so
    that a scrape first makes the series of every model loaded since the last (`Metrics.model`)."""

    def __init__(self, metrics: Metrics, families: tuple) -> None:
        self._metrics = metrics
        self._families = families

    def describe(self) -> Iterator[Metric]:
        for family in self._families:
            yield from family.describe()

    def collect(self) -> Iterator[Metric]:
        self._metrics.loaded_models()
        for family in self._families:
            yield from family.collect()


class RequestTimer:
    """Observes one request's latencies from its stream of outputs, under its model's `model_name`."""

    def __init__(self, metrics: Metrics, arrival: float, model_name: str) -> None:
        self._m = metrics
        self._arrival = arrival
        self._model = metrics.model(model_name)
        self._generation_tokens, self._ttft, self._itl, self._prompt_tokens, self._queue, self._e2e = (
            family.labels(model_name=model_name) for family in (
                metrics.generation_tokens, metrics.ttft, metrics.itl, metrics.prompt_tokens, metrics.queue,
                metrics.e2e))
        self._last: float | None = None

    def observe(self, output: RequestOutput) -> None:
        n_tokens = sum(len(d.token_ids) for d in output.deltas)
        if n_tokens:
            self._generation_tokens.inc(n_tokens)
            if self._last is None:
                self._ttft.observe(output.at - self._arrival)
            else:
                self._itl.observe(output.at - self._last)
            self._last = output.at
        if output.usage is not None:
            self._prompt_tokens.inc(output.usage.prompt_tokens)
            self._queue.observe(output.usage.queue_seconds)
            self._e2e.observe(time.monotonic() - self._arrival)

    def finished(self, reasons: list[str]) -> None:
        for reason in reasons:
            self._m.success.labels(model_name=self._model, finish_reason=reason).inc()

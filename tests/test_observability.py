"""deploy/observability: the dashboard JSON is its generator's output and loads back through
grafana-foundation-sdk; every PromQL expression of the dashboard and the alert rules parses, and every
series, label and label value it names is one a live kvserve exports, with and without
--metrics-compat vllm; the rules have the shape Prometheus reads; the compose file provisions both.
There is no container engine here: the compose file is checked statically."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Iterator

import httpx
import promql_parser
import pytest
import yaml
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.cog.plugins import register_default_plugins
from grafana_foundation_sdk.models.dashboard import Dashboard

from conftest import kvserve_help, names_flag
from deploy.observability.dashboard import render
from kvserve.testing import Metrics, ServerProcess, http_get

OBSERVABILITY = Path(__file__).resolve().parent.parent / "deploy" / "observability"
DASHBOARD = OBSERVABILITY / "kvserve.json"
ALERTS = OBSERVABILITY / "alerts.yml"
PROMETHEUS = OBSERVABILITY / "prometheus.yml"
COMPOSE = OBSERVABILITY / "compose.yml"

PROMETHEUS_SERIES = {"up"}  # written by Prometheus for each scrape target, not by kvserve
TARGET_LABELS = {"instance", "job"}  # attached by Prometheus to every series it scrapes
GRAFANA_BUILTINS = {"__rate_interval": "1m"}  # what Grafana puts in their place, near enough to parse
RULE_KEYS = {"alert", "expr", "for", "keep_firing_for", "labels", "annotations"}
DURATION = re.compile(r"(\d+(ms|s|m|h|d|w|y))+")

Exported = dict[str, list[dict[str, str]]]  # sample name -> the label sets of its samples


# --- reading the dashboard and the rules ----------------------------------------------------------

def _dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def _graphs(dashboard: dict) -> list[dict]:
    """Every panel but the rows, collapsed rows' panels included."""
    panels = [p for top in dashboard["panels"] for p in [top, *top.get("panels", [])]]
    return [p for p in panels if p["type"] != "row"]


def _variables(dashboard: dict) -> dict[str, dict]:
    return {v["name"]: v for v in dashboard["templating"]["list"]}


def _label_values_as_promql(query: str) -> str:
    """Grafana's `label_values(selector, label)` asks for the label's values on the selector's
    series: the same series and label `group by (label) (selector)` needs."""
    selector, label = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", query).groups()
    return f"group by ({label}) ({selector})"


def _dashboard_queries(dashboard: dict) -> list[str]:
    targets = [t["expr"] for p in _graphs(dashboard) for t in p["targets"]]
    lookups = [_label_values_as_promql(v["query"]) for v in _variables(dashboard).values() if v["type"] == "query"]
    return targets + lookups


def _promql(query: str, dashboard: dict) -> str:
    """The query as Prometheus receives it: Grafana's interval and the text-box variables (numbers)
    replaced; $instance and $model_name stand inside regex matchers and are left as written."""
    values = {**GRAFANA_BUILTINS, **{name: v["query"] for name, v in _variables(dashboard).items()
                                     if v["type"] == "textbox"}}
    return re.sub(r"\$(\w+)", lambda m: values.get(m[1], m[0]), query)


def _rules() -> list[dict]:
    return [rule for group in yaml.safe_load(ALERTS.read_text())["groups"] for rule in group["rules"]]


def _all_promql() -> list[str]:
    dashboard = _dashboard()
    return [_promql(q, dashboard) for q in _dashboard_queries(dashboard)] + [r["expr"] for r in _rules()]


# --- what an expression needs from /metrics ---------------------------------------------------------

def _nodes(expr: promql_parser.Expr) -> list[promql_parser.Expr]:
    found: list[promql_parser.Expr] = []
    promql_parser.walk(expr, found.append)
    return found


def _selectors(expr: promql_parser.Expr) -> list[promql_parser.VectorSelector]:
    return [n for n in _nodes(expr) if isinstance(n, promql_parser.VectorSelector)]


def _has_label(samples: list[dict[str, str]], label: str) -> bool:
    return label in TARGET_LABELS or any(label in s for s in samples)


def _selector_problems(selector: promql_parser.VectorSelector, exported: Exported) -> list[str]:
    name = selector.name
    if name in PROMETHEUS_SERIES:
        return []
    if name not in exported:
        return [f"{name} is not exported"]
    problems = []
    for matcher in selector.matchers.matchers:
        if not _has_label(exported[name], matcher.name):
            problems.append(f"{name} has no label {matcher.name}")
        elif matcher.op == promql_parser.MatchOp.Equal and matcher.name not in TARGET_LABELS and all(
                s.get(matcher.name) != matcher.value for s in exported[name]):
            problems.append(f'{name} has no series with {matcher.name}="{matcher.value}"')
    return problems


def _grouping_problems(node: promql_parser.Expr, exported: Exported) -> list[str]:
    """`sum by (label)` over series that lack the label would silently merge them into one."""
    if not isinstance(node, promql_parser.AggregateExpr) or node.modifier is None:
        return []
    return [f"{s.name} has no label {label}" for s in _selectors(node.expr) if s.name in exported
            for label in node.modifier.labels if not _has_label(exported[s.name], label)]


def _quantile_problems(node: promql_parser.Expr) -> list[str]:
    if not (isinstance(node, promql_parser.Call) and node.func.name == "histogram_quantile"):
        return []
    return [f"histogram_quantile reads {s.name}, not a _bucket series" for s in _selectors(node.args[1])
            if not s.name.endswith("_bucket")]


def _problems(promql: str, exported: Exported) -> list[str]:
    """What `promql` names that the scrape in `exported` lacks, in words; empty when it has it all."""
    nodes = _nodes(promql_parser.parse(promql))
    return [problem for node in nodes for problem in (
        *(_selector_problems(node, exported) if isinstance(node, promql_parser.VectorSelector) else ()),
        *_grouping_problems(node, exported),
        *_quantile_problems(node),
    )]


def _exported(text: str) -> Exported:
    exported: Exported = {}
    for sample in Metrics.parse(text).samples:
        exported.setdefault(sample.name, []).append(sample.labels)
    return exported


def _all_problems(text: str) -> set[str]:
    exported = _exported(text)
    return {p for promql in _all_promql() for p in _problems(promql, exported)}


# --- a live kvserve -----------------------------------------------------------------------------------

@pytest.fixture(scope="module", params=["plain", "vllm"])
def scraped(request: pytest.FixtureRequest, tiny, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    """(mode, /metrics after one request) of a kvserve process, with --metrics-compat vllm or without."""
    mode = request.param
    log = tmp_path_factory.mktemp("observability") / "kvserve.log"
    with ServerProcess.kvserve(log, model=tiny("llama"), threads=1, ctx_size=1024,
                               metrics_compat="vllm" if mode == "vllm" else None) as server:
        server.wait_healthy()
        answer = httpx.post(f"{server.url}/v1/completions", json={"prompt": "Hello", "max_tokens": 2}, timeout=60)
        assert answer.status_code == 200, answer.text
        status, body = http_get(f"{server.url}/metrics")
        assert status == 200
        yield mode, body.decode()


def _vllm_names() -> set[str]:
    return {s.name for promql in _all_promql() for s in _selectors(promql_parser.parse(promql))
            if s.name.startswith("vllm:")}


def test_every_series_queried_is_exported(scraped: tuple[str, str]) -> None:
    """With --metrics-compat vllm every query finds what it names; without it, only the vLLM row's do not."""
    mode, text = scraped
    vllm_names = _vllm_names()
    assert vllm_names, "the dashboard has no vLLM-compatible row"
    expected = set() if mode == "vllm" else {f"{name} is not exported" for name in vllm_names}
    assert _all_problems(text) == expected


def test_a_renamed_metric_or_label_fails_the_check(scraped: tuple[str, str]) -> None:
    _, text = scraped
    renamed_metric = text.replace("kvserve_prefix_cache_hit_tokens", "kvserve_prefix_cache_hits")
    assert "kvserve_prefix_cache_hit_tokens_total is not exported" in _all_problems(renamed_metric)
    renamed_label = text.replace("finish_reason=", "reason=")
    assert "kvserve_request_success_total has no label finish_reason" in _all_problems(renamed_label)
    renamed_bucket = text.replace("kvserve_time_to_first_token_seconds_bucket", "kvserve_ttft_bucket")
    assert "kvserve_time_to_first_token_seconds_bucket is not exported" in _all_problems(renamed_bucket)


# --- the dashboard ----------------------------------------------------------------------------------

def test_the_dashboard_json_is_the_generators_output() -> None:
    assert DASHBOARD.read_text() == render(), "regenerate it: python -m deploy.observability.dashboard"


def test_the_dashboard_loads_back_through_the_sdk() -> None:
    register_default_plugins()
    committed = _dashboard()
    loaded = json.loads(JSONEncoder().encode(Dashboard.from_json(committed)))
    assert _dashboard_queries(loaded) == _dashboard_queries(committed)
    assert [p["title"] for p in _graphs(loaded)] == [p["title"] for p in _graphs(committed)]


def test_every_query_parses_and_uses_only_defined_variables() -> None:
    dashboard = _dashboard()
    defined = set(_variables(dashboard)) | set(GRAFANA_BUILTINS)
    queries = _dashboard_queries(dashboard)
    assert len(queries) > 20
    for query in queries:
        assert set(re.findall(r"\$(\w+)", query)) <= defined, query
        promql_parser.parse(_promql(query, dashboard))  # raises on a syntax error
    for graph in _graphs(dashboard):
        assert graph["datasource"]["uid"] == "${datasource}", graph["title"]


def test_every_panel_reads_only_the_picked_replicas_and_models() -> None:
    """One dashboard for one replica or a fleet: no panel reads series the viewer did not pick."""
    dashboard = _dashboard()
    for graph in _graphs(dashboard):
        for target in graph["targets"]:
            for selector in _selectors(promql_parser.parse(_promql(target["expr"], dashboard))):
                matchers = str(selector.matchers)
                assert 'instance=~"$instance"' in matchers, target["expr"]
                assert selector.name.startswith("vllm:") == ('model_name=~"$model_name"' in matchers), target["expr"]
    assert 'instance=~"$instance"' in _variables(dashboard)["model_name"]["query"]


# --- the alert rules ------------------------------------------------------------------------------

def test_the_rules_have_the_shape_prometheus_reads() -> None:
    groups = yaml.safe_load(ALERTS.read_text())["groups"]
    assert groups and all(set(g) == {"name", "rules"} and g["rules"] for g in groups)
    rules = _rules()
    names = [r["alert"] for r in rules]
    assert len(names) == len(set(names)) >= 6
    for rule in rules:
        assert set(rule) <= RULE_KEYS and {"alert", "expr", "for", "labels", "annotations"} <= set(rule), rule
        assert DURATION.fullmatch(rule["for"]), rule["for"]
        assert rule["labels"]["severity"] in {"warning", "critical"}
        assert {"summary", "description"} <= set(rule["annotations"])
        promql_parser.parse(rule["expr"])


def test_the_rules_pass_promtool_where_it_is_installed() -> None:
    if shutil.which("promtool") is None:
        pytest.skip("promtool (Prometheus' own checker) is not installed")
    for check in (["rules", str(ALERTS)], ["config", str(PROMETHEUS)]):
        result = subprocess.run(["promtool", "check", *check], capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, result.stdout + result.stderr


# --- the compose file ---------------------------------------------------------------------------

def _mounts(service: dict) -> dict[str, Path]:
    """Container path -> the file of this folder mounted there (read-only, and it must exist)."""
    mounts = {}
    for volume in service["volumes"]:
        source, target, mode = volume.split(":")
        assert mode == "ro" and (OBSERVABILITY / source).is_file(), volume
        mounts[target] = (OBSERVABILITY / source).resolve()
    return mounts


def _provisioned(mounts: dict[str, Path], kind: str) -> list[dict]:
    return [yaml.safe_load(path.read_text()) for target, path in mounts.items()
            if target.startswith(f"/etc/grafana/provisioning/{kind}/")]


def test_compose_runs_kvserve_prometheus_and_grafana_with_the_rules_and_dashboard() -> None:
    services = yaml.safe_load(COMPOSE.read_text())["services"]
    assert set(services) == {"kvserve", "prometheus", "grafana"}

    kvserve = services["kvserve"]["command"]
    help_text = kvserve_help()
    assert all(names_flag(help_text, a) for a in kvserve if a.startswith("--")), kvserve
    assert kvserve[kvserve.index("--metrics-compat") + 1] == "vllm"  # so the vLLM row has data too
    port = kvserve[kvserve.index("--port") + 1]

    prometheus = _mounts(services["prometheus"])
    config = yaml.safe_load(prometheus["/etc/prometheus/prometheus.yml"].read_text())
    assert {prometheus[f"/etc/prometheus/{f}"] for f in config["rule_files"]} == {ALERTS.resolve()}
    (job,) = config["scrape_configs"]
    assert job["static_configs"] == [{"targets": [f"kvserve:{port}"]}]
    jobs_in_rules = {m.value for promql in (r["expr"] for r in _rules())
                     for s in _selectors(promql_parser.parse(promql)) for m in s.matchers.matchers if m.name == "job"}
    assert jobs_in_rules == {job["job_name"]}

    grafana = _mounts(services["grafana"])
    (datasources,) = _provisioned(grafana, "datasources")
    assert [(d["type"], d["url"]) for d in datasources["datasources"]] == [("prometheus", "http://prometheus:9090")]
    (dashboards,) = _provisioned(grafana, "dashboards")
    (provider,) = dashboards["providers"]
    folder = provider["options"]["path"]
    assert [p for t, p in grafana.items() if t.startswith(folder + "/")] == [DASHBOARD.resolve()]

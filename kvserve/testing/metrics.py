"""A server's /metrics page, read with prometheus-client's own exposition parser."""

from __future__ import annotations

from dataclasses import dataclass
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from kvserve.testing.processes import http_get


@dataclass(frozen=True)
class Metrics:
    """The samples of one scrape. Names are the exposed ones: a counter's sample ends in `_total`,
    a histogram's in `_bucket`, `_sum` and `_count`."""

    samples: tuple[Sample, ...]

    @classmethod
    def parse(cls, text: str) -> "Metrics":
        return cls(tuple(s for family in text_string_to_metric_families(text) for s in family.samples))

    def value(self, name: str, **labels: str) -> float:
        """The sample `name` with these labels. `model_name` (every per-model series carries it) counts
        only where the caller gives it: a sample matches when its labels, less `model_name` unless
        `labels` has one, equal `labels`; so `value("kvserve_requests_running")` reads a one-model
        server's, and where samples of several models match (several loaded, or a series with a
        model-less sample too: the draining refusal's `model_name=""`) raises ValueError (ambiguous:
        give `model_name`) rather than pick one. KeyError if the page has no such sample."""
        found = [s for s in self.samples if s.name == name and _without_model(s.labels, labels) == labels]
        if not found:
            raise KeyError(f"{name}{labels or ''} is not on the page")
        if len(found) > 1:
            models = sorted(s.labels.get("model_name", "") for s in found)
            raise ValueError(f"{name}{labels or ''} is ambiguous: samples of models {models} match; give model_name")
        return found[0].value

    def total(self, name: str, **labels: str) -> float:
        """The sum of `name` over every sample whose labels include `labels`, of every model and every
        other label value; 0 while it has none (a labelled counter has no series until its first
        increment)."""
        return sum(s.value for s in self.samples
                   if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


def _without_model(sample: dict[str, str], asked: dict[str, str]) -> dict[str, str]:
    """`sample`'s labels, less `model_name` unless `asked` names one."""
    if "model_name" in asked:
        return sample
    return {k: v for k, v in sample.items() if k != "model_name"}


def read_metrics(url: str) -> Metrics:
    """GET `url`/metrics and parse it; RuntimeError unless it answers 200."""
    status, body = http_get(f"{url}/metrics")
    if status != 200:
        raise RuntimeError(f"{url}/metrics answered {status}")
    return Metrics.parse(body.decode())

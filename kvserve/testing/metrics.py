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
        """The sample `name` with exactly these labels; KeyError if the page has none."""
        for sample in self.samples:
            if sample.name == name and sample.labels == labels:
                return sample.value
        raise KeyError(f"{name}{labels or ''} is not on the page")

    def total(self, name: str) -> float:
        """The sum of `name` over all its label sets; 0 while it has none (a labelled counter has
        no series until its first increment)."""
        return sum(s.value for s in self.samples if s.name == name)


def read_metrics(url: str) -> Metrics:
    """GET `url`/metrics and parse it; RuntimeError unless it answers 200."""
    status, body = http_get(f"{url}/metrics")
    if status != 200:
        raise RuntimeError(f"{url}/metrics answered {status}")
    return Metrics.parse(body.decode())

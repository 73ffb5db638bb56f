"""Engine metrics in Prometheus' text exposition, written by prometheus_client: counters (`<name>_total`), gauges,
request latency histograms with vLLM's buckets (TTFT, time per output token, end to end), the per-position
accepted-token vector as one labelled counter, and the draft mode as an info gauge."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import prometheus_client
from prometheus_client.core import CollectorRegistry, CounterMetricFamily, GaugeMetricFamily, Metric

from tandem.engine.metrics import Counter, Gauge, Vector
from tandem.engine.metrics import Metric as EngineMetric

# vLLM's latency buckets, in seconds
LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                   20.0, 40.0, 80.0, 160.0)
CONTENT_TYPE = prometheus_client.CONTENT_TYPE_LATEST


class Histogram(prometheus_client.Histogram):
    """A latency histogram with vLLM's buckets, owned by one server (not in prometheus_client's global registry,
    so several engines in one process keep their own)."""

    def __init__(self, name: str, documentation: str = ""):
        super().__init__(name, documentation or name, buckets=LATENCY_BUCKETS, registry=None)


class _EngineCollector:
    """One scrape's view of the engine: its counters and gauges as they are now, plus the latency histograms."""

    def __init__(self, metrics: list[EngineMetric], draft_mode: str | None, histograms: Sequence[Histogram]):
        self.metrics, self.draft_mode, self.histograms = metrics, draft_mode, histograms

    def collect(self) -> Iterator[Metric]:
        for h in self.histograms:
            yield from h.collect()
        for m in self.metrics:
            if isinstance(m, Counter):
                yield CounterMetricFamily(m.name, m.name, value=m.value)
            elif isinstance(m, Gauge):
                yield GaugeMetricFamily(m.name, m.name, value=m.value)
            elif isinstance(m, Vector):
                kind = CounterMetricFamily if m.kind == "counter" else GaugeMetricFamily
                family = kind(m.name, m.name, labels=[m.label])
                for i, v in enumerate(m.values):
                    family.add_metric([str(i)], v)
                yield family
        # an info metric the way vLLM writes its *_info metrics: a gauge of 1 with labels
        info = GaugeMetricFamily("tandem:spec_decode_draft_mode_info", "speculative decoding draft mode",
                                 labels=["mode"])
        info.add_metric([self.draft_mode or "none"], 1.0)
        yield info


def render_metrics(metrics: list[EngineMetric], draft_mode: str | None,
                   histograms: Sequence[Histogram] = ()) -> str:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_EngineCollector(metrics, draft_mode, histograms))
    return prometheus_client.generate_latest(registry).decode()

"""Engine metrics in Prometheus' text exposition format: counters as `<name>_total` with their TYPE line, as
prometheus_client writes them; request latency histograms (TTFT, time per output token, end to end); the
per-position accepted-token vector as one labelled counter; the draft mode as an info gauge."""

from __future__ import annotations

from dataclasses import dataclass, field

from tandem.engine.metrics import Counter, Gauge, Metric, Vector

# vLLM's latency buckets, in seconds
LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                   20.0, 40.0, 80.0, 160.0)


@dataclass
class Histogram:
    name: str
    buckets: tuple[float, ...] = LATENCY_BUCKETS
    counts: list[int] = field(default_factory=list)  # per bucket, not cumulative; last = +Inf
    total: float = 0.0
    count: int = 0

    def observe(self, value: float) -> None:
        if not self.counts:
            self.counts = [0] * (len(self.buckets) + 1)
        index = next((i for i, b in enumerate(self.buckets) if value <= b), len(self.buckets))
        self.counts[index] += 1
        self.total += value
        self.count += 1

    def render(self) -> list[str]:
        lines, running = [f"# TYPE {self.name} histogram"], 0
        counts = self.counts or [0] * (len(self.buckets) + 1)
        for bound, n in zip((*self.buckets, float("inf")), counts, strict=True):
            running += n
            le = "+Inf" if bound == float("inf") else repr(bound)
            lines.append(f'{self.name}_bucket{{le="{le}"}} {float(running)}')
        return lines + [f"{self.name}_sum {self.total}", f"{self.name}_count {float(self.count)}"]


def render_metrics(metrics: list[Metric], draft_mode: str | None, histograms: list[Histogram] = ()) -> str:
    lines: list[str] = []
    for h in histograms:
        lines += h.render()
    for m in metrics:
        if isinstance(m, Counter):
            lines += [f"# TYPE {m.name}_total counter", f"{m.name}_total {float(m.value)}"]
        elif isinstance(m, Gauge):
            lines += [f"# TYPE {m.name} gauge", f"{m.name} {float(m.value)}"]
        elif isinstance(m, Vector):
            lines.append(f"# TYPE {m.name}_total counter")
            lines += [f'{m.name}_total{{position="{i}"}} {float(v)}' for i, v in enumerate(m.values)]
    # an info metric the way vLLM writes its *_info metrics in the text format: a gauge of 1 with labels
    lines += ["# TYPE tandem:spec_decode_draft_mode_info gauge",
              f'tandem:spec_decode_draft_mode_info{{mode="{draft_mode or "none"}"}} 1.0']
    return "\n".join(lines) + "\n"

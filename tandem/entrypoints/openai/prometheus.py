"""Engine metrics in Prometheus' text exposition format (counters as `<name>_total`, TYPE line included, as
prometheus_client writes them; the per-position accepted-token vector as one labelled counter; the draft mode as an
info gauge)."""

from __future__ import annotations

from tandem.engine.metrics import Counter, Gauge, Metric, Vector


def render_metrics(metrics: list[Metric], draft_mode: str | None) -> str:
    lines: list[str] = []
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

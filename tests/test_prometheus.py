"""/metrics text comes from prometheus_client and parses with its parser: counter, gauge, labelled per-position
counter, info gauge, and latency histograms with vLLM's buckets (cumulative counts, sum, count)."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tandem.engine.metrics import Counter, Gauge, Vector
from tandem.entrypoints.openai.prometheus import LATENCY_BUCKETS, Histogram, render_metrics


def test_metrics_text_parses_with_prometheus_client():
    ttft = Histogram("tandem:time_to_first_token_seconds")
    for v in (0.003, 0.003, 0.3, 500.0):
        ttft.observe(v)
    metrics = [Counter("tandem:spec_decode_num_drafts", 7), Gauge("tandem:kv_cache_usage_perc", 0.25),
               Vector("tandem:spec_decode_num_accepted_tokens_per_pos", [5.0, 2.0, 1.0])]
    families = {f.name: f for f in text_string_to_metric_families(render_metrics(metrics, "sharded", [ttft]))}
    drafts = families["tandem:spec_decode_num_drafts"]
    assert drafts.type == "counter" and [(s.name, s.value) for s in drafts.samples] == [
        ("tandem:spec_decode_num_drafts_total", 7.0)]
    assert families["tandem:kv_cache_usage_perc"].samples[0].value == 0.25
    per_pos = families["tandem:spec_decode_num_accepted_tokens_per_pos"]
    assert [(s.labels["position"], s.value) for s in per_pos.samples] == [("0", 5.0), ("1", 2.0), ("2", 1.0)]
    assert families["tandem:spec_decode_draft_mode_info"].samples[0].labels == {"mode": "sharded"}
    hist = families["tandem:time_to_first_token_seconds"]
    assert hist.type == "histogram"
    buckets = {float(s.labels["le"]): s.value for s in hist.samples if s.name.endswith("_bucket")}
    assert list(buckets) == [*LATENCY_BUCKETS, float("inf")]
    assert buckets[0.001] == 0 and buckets[0.005] == 2 and buckets[0.25] == 2 and buckets[0.5] == 3
    assert buckets[160.0] == 3 and buckets[float("inf")] == 4
    samples = {s.name: s.value for s in hist.samples}
    assert samples["tandem:time_to_first_token_seconds_count"] == 4
    assert samples["tandem:time_to_first_token_seconds_sum"] == pytest.approx(500.306)


def test_each_histogram_belongs_to_its_own_server():
    a, b = Histogram("tandem:e2e_request_latency_seconds"), Histogram("tandem:e2e_request_latency_seconds")
    a.observe(1.0)
    counts = [{s.name: s.value for f in text_string_to_metric_families(render_metrics([], None, [h]))
               for s in f.samples}["tandem:e2e_request_latency_seconds_count"] for h in (a, b)]
    assert counts == [1.0, 0.0]

"""`tandem bench serve`: a load generator for any OpenAI-compatible server, and the same load on a peer in the
same invocation (`--vs URL`). Scope: prompts, the streaming client, latency statistics and the report.

Per request (streamed completions, `max_tokens` fixed, EOS ignored where the server honours `ignore_eos`):
TTFT = first text chunk - send; ITL = gaps between chunks; TPOT = (end - first chunk) / (tokens - 1) with
tokens from the usage chunk; throughput = output tokens / wall time of the whole run.
"""

from __future__ import annotations

import http.client
import json
import statistics
import time
import urllib.parse
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any

from tandem.data.gsm8k import SHARED_GSM8K, load_jsonl, synthetic_split


@dataclass
class RequestResult:
    ttft_s: float
    itl_s: list[float]
    e2e_s: float
    output_tokens: int


@dataclass
class BenchResult:
    url: str
    num_prompts: int
    concurrency: int
    wall_s: float
    output_tokens: int
    ttft_s: dict[str, float] = field(default_factory=dict)
    tpot_s: dict[str, float] = field(default_factory=dict)
    itl_s: dict[str, float] = field(default_factory=dict)

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.wall_s

    @property
    def requests_per_s(self) -> float:
        return self.num_prompts / self.wall_s


def bench_prompts(num_prompts: int) -> list[str]:
    """GSM8K test questions when ../shared is there, else the synthetic split, in the eval's layout."""
    path = SHARED_GSM8K / "test.jsonl"
    problems = load_jsonl(path) if path.is_file() else synthetic_split("test", num_prompts)
    return [f"Question: {problems[i % len(problems)].question}\nAnswer:" for i in range(num_prompts)]


def percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    ordered = sorted(values)

    def pct(p: float) -> float:
        return ordered[min(len(ordered) - 1, round(p / 100 * (len(ordered) - 1)))]

    return {"mean": statistics.fmean(ordered), "p50": pct(50), "p90": pct(90), "p99": pct(99)}


def one_request(url: str, model: str | None, prompt: str, max_tokens: int) -> RequestResult:
    parts = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port or 80, timeout=600)
    body: dict[str, Any] = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
                            "ignore_eos": True, "stream_options": {"include_usage": True}}
    if model:
        body["model"] = model
    start = time.perf_counter()
    conn.request("POST", parts.path.rstrip("/") + "/v1/completions", json.dumps(body),
                 {"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        raise RuntimeError(f"{url}: HTTP {resp.status}: {resp.read()[:300]!r}")
    chunk_times, tokens = [], 0
    for raw in resp:
        line = raw.decode().strip()
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        event = json.loads(line[6:])
        if event.get("usage"):
            tokens = event["usage"]["completion_tokens"]
        if any(c.get("text") for c in event.get("choices", [])):
            chunk_times.append(time.perf_counter())
    end = time.perf_counter()
    conn.close()
    if not chunk_times:
        raise RuntimeError(f"{url}: a stream produced no text")
    return RequestResult(chunk_times[0] - start, [b - a for a, b in zip(chunk_times, chunk_times[1:], strict=False)],
                         end - start, tokens or len(chunk_times))


def run_bench(url: str, model: str | None, prompts: list[str], concurrency: int, max_tokens: int) -> BenchResult:
    from tqdm import tqdm

    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        futures = [pool.submit(one_request, url, model, p, max_tokens) for p in prompts]
        results = [f.result() for f in tqdm(futures, desc=url, unit="req")]
    wall = time.perf_counter() - start
    tpot = [(r.e2e_s - r.ttft_s) / (r.output_tokens - 1) for r in results if r.output_tokens > 1]
    return BenchResult(url, len(prompts), concurrency, wall, sum(r.output_tokens for r in results),
                       percentiles([r.ttft_s for r in results]), percentiles(tpot),
                       percentiles([x for r in results for x in r.itl_s]))


def report(results: list[BenchResult]) -> str:
    lines = ["| server | req/s | output tok/s | TTFT p50 / p90 / p99 ms | TPOT p50 / p90 / p99 ms | "
             "ITL p50 / p90 / p99 ms |", "|---|---|---|---|---|---|"]

    def ms(d: dict[str, float]) -> str:
        return " / ".join(f"{1000 * d[k]:.1f}" for k in ("p50", "p90", "p99")) if d else "n/a"

    for r in results:
        lines.append(f"| {r.url} | {r.requests_per_s:.2f} | {r.tokens_per_s:.1f} | {ms(r.ttft_s)} | "
                     f"{ms(r.tpot_s)} | {ms(r.itl_s)} |")
    if len(results) == 2:
        lines.append(f"\nthroughput {results[0].url} / {results[1].url}: "
                     f"{results[0].tokens_per_s / results[1].tokens_per_s:.2f}x")
    return "\n".join(lines)


def results_json(results: list[BenchResult]) -> str:
    return json.dumps([asdict(r) | {"tokens_per_s": r.tokens_per_s, "requests_per_s": r.requests_per_s}
                       for r in results], indent=2)

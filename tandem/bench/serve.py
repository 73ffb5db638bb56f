"""`tandem bench serve`: a load generator for any OpenAI-compatible server, and the same load on a peer in the
same invocation (`--vs URL`, or `--vs hf`: Hugging Face's `transformers serve`, see hf_peer.py). Scope: the
streaming client, latency statistics and the report.

Per request (streamed completions, greedy, `max_tokens` fixed; EOS ignored where `ignore_eos` is sent): TTFT =
first text chunk - send; ITL = gaps between chunks; TPOT = (end - first chunk) / (tokens - 1), tokens from the
usage chunk, else the streamed text re-tokenized with the model's tokenizer; throughput = output tokens / wall
time of the whole run. One short warm-up request (a prompt outside the measured set) precedes each run.
"""

from __future__ import annotations

import http.client
import json
import os
import statistics
import time
import urllib.parse
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tandem.bench import hf_peer
from tandem.bench.machine import machine_info

WARMUP_PROMPT = "Warm-up: count from one to three."


@dataclass
class RequestResult:
    ttft_s: float
    itl_s: list[float]
    e2e_s: float
    text: str
    output_tokens: int | None  # from the usage chunk; None when the server sent none


@dataclass
class BenchResult:
    name: str
    url: str
    num_prompts: int
    concurrency: int
    wall_s: float
    output_tokens: int
    token_counts: str  # where output_tokens came from: "usage" or "re-tokenized text"
    ttft_s: dict[str, float] = field(default_factory=dict)
    tpot_s: dict[str, float] = field(default_factory=dict)
    itl_s: dict[str, float] = field(default_factory=dict)
    texts: list[str] = field(default_factory=list)  # each request's generated text, in prompt order

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.wall_s

    @property
    def requests_per_s(self) -> float:
        return self.num_prompts / self.wall_s


def percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    ordered = sorted(values)

    def pct(p: float) -> float:
        return ordered[min(len(ordered) - 1, round(p / 100 * (len(ordered) - 1)))]

    return {"mean": statistics.fmean(ordered), "p50": pct(50), "p90": pct(90), "p99": pct(99)}


def one_request(url: str, model: str | None, prompt: str, max_tokens: int, ignore_eos: bool) -> RequestResult:
    parts = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port or 80, timeout=600)
    body: dict[str, Any] = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
                            "stream_options": {"include_usage": True}}
    if ignore_eos:
        body["ignore_eos"] = True
    if model:
        body["model"] = model
    start = time.perf_counter()
    try:
        conn.request("POST", parts.path.rstrip("/") + "/v1/completions", json.dumps(body),
                     {"Content-Type": "application/json"})
        resp = conn.getresponse()
    except OSError as e:
        raise RuntimeError(f"{url}: {e}") from e
    if resp.status != 200:
        raise RuntimeError(f"{url}: HTTP {resp.status}: {resp.read()[:300]!r}")
    chunk_times, texts, tokens = [], [], None
    for raw in resp:
        line = raw.decode().strip()
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        event = json.loads(line[6:])
        if event.get("error"):
            raise RuntimeError(f"{url}: the stream failed: {event['error']}")
        if event.get("usage"):
            tokens = event["usage"]["completion_tokens"]
        text = "".join(c.get("text") or "" for c in event.get("choices", []))
        if text:
            chunk_times.append(time.perf_counter())
            texts.append(text)
    end = time.perf_counter()
    conn.close()
    if not chunk_times:  # EOS first (without ignore_eos): no text, and the first token came at the end
        chunk_times.append(end)
    return RequestResult(chunk_times[0] - start, [b - a for a, b in zip(chunk_times, chunk_times[1:], strict=False)],
                         end - start, "".join(texts), tokens)


def run_bench(name: str, url: str, model: str | None, prompts: list[str], concurrency: int, max_tokens: int,
              ignore_eos: bool, count_tokens: Callable[[str], int]) -> BenchResult:
    """`count_tokens` counts a text's tokens for a server whose stream has no usage chunk."""
    from tqdm import tqdm

    one_request(url, model, WARMUP_PROMPT, 4, ignore_eos)
    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        futures = [pool.submit(one_request, url, model, p, max_tokens, ignore_eos) for p in prompts]
        results = [f.result() for f in tqdm(futures, desc=name, unit="req")]
    wall = time.perf_counter() - start
    counts = [r.output_tokens if r.output_tokens is not None else count_tokens(r.text) for r in results]
    source = "usage" if all(r.output_tokens is not None for r in results) else "re-tokenized text"
    tpot = [(r.e2e_s - r.ttft_s) / (n - 1) for r, n in zip(results, counts, strict=True) if n > 1]
    return BenchResult(name, url, len(prompts), concurrency, wall, sum(counts), source,
                       percentiles([r.ttft_s for r in results]), percentiles(tpot),
                       percentiles([x for r in results for x in r.itl_s]), [r.text for r in results])


def report(results: list[BenchResult]) -> str:
    """One table per concurrency level (a heading names the level when there are several)."""
    levels = sorted({r.concurrency for r in results})
    if len(levels) == 1:
        return _report_table(results)
    return "\n\n".join(f"concurrency {c}:\n" + _report_table([r for r in results if r.concurrency == c])
                       for c in levels)


def _report_table(results: list[BenchResult]) -> str:
    lines = ["| server | req/s | output tok/s | TTFT p50 / p90 / p99 ms | TPOT p50 / p90 / p99 ms | "
             "ITL p50 / p90 / p99 ms |", "|---|---|---|---|---|---|"]

    def ms(d: dict[str, float]) -> str:
        return " / ".join(f"{1000 * d[k]:.1f}" for k in ("p50", "p90", "p99")) if d else "n/a"

    for r in results:
        lines.append(f"| {r.name} | {r.requests_per_s:.2f} | {r.tokens_per_s:.1f} | {ms(r.ttft_s)} | "
                     f"{ms(r.tpot_s)} | {ms(r.itl_s)} |")
    if len(results) == 2:
        a, b = results
        lines.append(f"\nthroughput {a.name} / {b.name}: {a.tokens_per_s / b.tokens_per_s:.2f}x")
        lines.append(f"identical texts: {identical_texts(a, b)}/{a.num_prompts}; output tokens {a.output_tokens} "
                     f"({a.token_counts}) vs {b.output_tokens} ({b.token_counts})")
    return "\n".join(lines)


def peer_pairs(results: list[BenchResult]) -> list[tuple[BenchResult, BenchResult]]:
    """(server, peer) at each concurrency level where both ran."""
    by_level: dict[int, list[BenchResult]] = {}
    for r in results:
        by_level.setdefault(r.concurrency, []).append(r)
    return [(runs[0], runs[1]) for runs in by_level.values() if len(runs) == 2]


def identical_texts(a: BenchResult, b: BenchResult) -> int:
    return sum(x == y for x, y in zip(a.texts, b.texts, strict=True))


def token_counter(model_folder: str | None) -> Callable[[str], int]:
    """Counts a streamed text's tokens with the model's tokenizer (no BOS: the text is output only)."""
    path = Path(model_folder or "") / "tokenizer.json"
    loaded: list[Any] = []  # the tokenizer, read on first use (most servers send usage chunks)

    def count(text: str) -> int:
        if model_folder is None or not path.is_file():
            raise RuntimeError(f"a server sent no usage chunk and there is no tokenizer to count its text with "
                               f"({path} not found; pass --hf-model MODEL_FOLDER)")
        if not loaded:
            from tokenizers import Tokenizer

            loaded.append(Tokenizer.from_file(str(path)))
        return len(loaded[0].encode(text, add_special_tokens=False).ids)

    return count


@dataclass(frozen=True)
class Load:
    """What every run sends: the prompts, the concurrency levels swept (one run per level) and the request shape."""

    prompts: list[str]
    concurrencies: list[int]
    max_tokens: int
    ignore_eos: bool


def bench_serve(url: str, model: str | None, vs: str | None, hf: hf_peer.HFPeerConfig, load: Load,
                label: str | None = None, vs_label: str | None = None) -> dict[str, Any]:
    """The load on `url` at each concurrency level, then on the peer `vs` (a base URL, or "hf": `transformers
    serve` started here, once for all levels); `label` and `vs_label` name the two in the report and plot."""
    info = machine_info()
    folder = hf.model or (hf_peer.served_model_root(url) if vs == "hf" else None)
    count = token_counter(folder)

    def sweep(name: str, base_url: str, model_id: str | None) -> list[BenchResult]:
        return [run_bench(name, base_url, model_id, load.prompts, c, load.max_tokens, load.ignore_eos, count)
                for c in load.concurrencies]

    results = sweep(label or url, url, model)
    config: dict[str, Any] = {"url": url, "vs": vs, "num_prompts": len(load.prompts),
                              "concurrency": load.concurrencies[0] if len(load.concurrencies) == 1
                              else load.concurrencies, "max_tokens": load.max_tokens, "ignore_eos": load.ignore_eos}
    if vs == "hf":
        assert folder is not None
        cb = hf_peer.use_continuous_batching(folder, hf.continuous_batching)
        name = vs_label or hf_peer.peer_name(cb)
        print(f"peer: {name}, model {folder}, dtype {hf.dtype}")
        blocks = hf_peer.cb_num_blocks(load.prompts, max(load.concurrencies), load.max_tokens)
        with hf_peer.hf_server(folder, hf.dtype, cb, hf.startup_timeout_s, blocks) as hf_url:
            # No model field: a forced-model `transformers serve` takes requests without one.
            results += sweep(name, hf_url, None)
        config |= {"peer": name, "hf_model": folder, "hf_dtype": hf.dtype, "hf_continuous_batching": cb,
                   "hf_cb_num_blocks": blocks if cb else None}
    elif vs:
        results += sweep(vs_label or vs, vs, model)
    info["load_avg_1m_at_end"] = os.getloadavg()[0]
    out: dict[str, Any] = {"machine": info, "config": config, "results": results}
    if pairs := peer_pairs(results):
        out["identical_texts"] = sum(identical_texts(a, b) for a, b in pairs)
    return out


def plot_concurrency(bench: dict[str, Any], model: str, path: str | Path) -> Path:
    """Output tokens/s and TTFT p50 against the concurrency level, one line per server."""
    from tandem.bench.plot import Panel, lines_by, machine_caption, plot_lines

    rows = [asdict(r) | {"tokens_per_s": r.tokens_per_s} for r in bench["results"]]

    def name(row: dict[str, Any]) -> str:
        return row["name"]

    def ttft_ms(row: dict[str, Any]) -> float | None:
        return 1000 * row["ttft_s"]["p50"] if row["ttft_s"] else None

    cfg = bench["config"]
    return plot_lines(path, [Panel("output tokens/s", lines_by(rows, "concurrency", "tokens_per_s", name), y_min=0),
                             Panel("TTFT p50 (ms)", lines_by(rows, "concurrency", ttft_ms, name), y_min=0)],
                      title=f"tandem bench serve: {cfg['num_prompts']} streamed requests x {cfg['max_tokens']} "
                            "tokens, by requests in flight",
                      x_label="concurrent requests", subtitle=machine_caption(bench["machine"], model), log2_x=True)


def results_json(bench: dict[str, Any]) -> str:
    results = [asdict(r) | {"tokens_per_s": r.tokens_per_s, "requests_per_s": r.requests_per_s}
               for r in bench["results"]]
    return json.dumps(bench | {"results": results}, indent=2)

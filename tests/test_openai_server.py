"""`tandem serve` with the official `openai` client: completions and chat completions, streamed and not; streamed
greedy text equals the non-streamed result; /v1/models, /health, Prometheus /metrics (parsed with
prometheus_client, spec-decode counters as `llm.get_metrics()` defines them); OpenAI-style 400s that leave the
server serving. The server runs in this process (uvicorn in a thread) on a free loopback port."""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.error
import urllib.request

import pytest

from tandem.entrypoints.engine_args import EngineArgs
from tandem.entrypoints.openai.api_server import build_app
from tandem.entrypoints.openai.async_engine import AsyncEngine

NAME = "tiny-dsv3"


@pytest.fixture(scope="module")
def server(tiny_checkpoints):
    import uvicorn

    path = str(tiny_checkpoints("deepseek_v3", num_mtp_layers=1))
    engine = AsyncEngine(EngineArgs(model=path, dtype="float32",
                                    speculative_config={"method": "mtp", "num_speculative_tokens": 2}))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    srv = uvicorn.Server(uvicorn.Config(build_app(engine, NAME, path), host="127.0.0.1", port=port,
                                        log_level="warning"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    for _ in range(100):
        try:
            urllib.request.urlopen(url + "/health", timeout=1)
            break
        except OSError:
            time.sleep(0.1)
    yield url, engine
    srv.should_exit = True
    thread.join(timeout=10)
    engine.shutdown()


def _client(url: str):
    import openai

    return openai.OpenAI(base_url=url + "/v1", api_key="none")


def test_completions_streamed_and_not(server):
    url, _ = server
    client = _client(url)
    full = client.completions.create(model=NAME, prompt="The quick brown fox", max_tokens=12, temperature=0,
                                     extra_body={"ignore_eos": True})
    assert full.choices[0].finish_reason == "length" and full.usage.completion_tokens == 12
    parts, usage = [], None
    for event in client.completions.create(model=NAME, prompt="The quick brown fox", max_tokens=12, temperature=0,
                                           stream=True, stream_options={"include_usage": True},
                                           extra_body={"ignore_eos": True}):
        if event.choices:
            parts.append(event.choices[0].text)
        if event.usage is not None:
            usage = event.usage
    assert "".join(parts) == full.choices[0].text
    assert usage is not None and usage.completion_tokens == 12


def test_chat_completions_streamed_and_not(server):
    url, _ = server
    client = _client(url)
    messages = [{"role": "user", "content": "Hello world! How are you today?"}]
    full = client.chat.completions.create(model=NAME, messages=messages, max_tokens=10, temperature=0)
    assert full.choices[0].message.role == "assistant"
    streamed = "".join(e.choices[0].delta.content or "" for e in client.chat.completions.create(
        model=NAME, messages=messages, max_tokens=10, temperature=0, stream=True) if e.choices)
    assert streamed == full.choices[0].message.content


def test_concurrent_streams_match_and_free_the_cache(server):
    url, engine = server
    client = _client(url)
    prompts = [f"Once upon a time {i}" for i in range(12)]
    expect = [client.completions.create(model=NAME, prompt=p, max_tokens=8, temperature=0).choices[0].text
              for p in prompts]
    got: dict[int, str] = {}

    def stream(i: int) -> None:
        got[i] = "".join(e.choices[0].text for e in client.completions.create(
            model=NAME, prompt=prompts[i], max_tokens=8, temperature=0, stream=True) if e.choices)

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert [got[i] for i in range(len(prompts))] == expect
    time.sleep(0.3)  # the engine thread refreshes the metrics after its last step
    usage = {m.name: getattr(m, "value", None) for m in engine.metrics()}["tandem:kv_cache_usage_perc"]
    assert usage == 0.0


def test_models_health_and_metrics(server):
    from prometheus_client.parser import text_string_to_metric_families

    url, engine = server
    models = json.loads(urllib.request.urlopen(url + "/v1/models").read())
    assert [m["id"] for m in models["data"]] == [NAME]
    assert urllib.request.urlopen(url + "/health").status == 200
    text = urllib.request.urlopen(url + "/metrics").read().decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    ours = {m.name: getattr(m, "value", None) for m in engine.metrics()}
    drafts = families["tandem:spec_decode_num_drafts"].samples[0].value
    assert drafts == ours["tandem:spec_decode_num_drafts"] > 0
    accepted = families["tandem:spec_decode_num_accepted_tokens"].samples[0].value
    proposed = families["tandem:spec_decode_num_draft_tokens"].samples[0].value
    rate = families["tandem:spec_decode_acceptance_rate"].samples[0].value
    assert rate == pytest.approx(accepted / proposed)
    assert families["tandem:spec_decode_mean_acceptance_length"].samples[0].value == pytest.approx(
        1 + accepted / drafts)
    assert families["tandem:spec_decode_draft_mode_info"].samples[0].labels["mode"] == "sharded"
    for name in ("tandem:time_to_first_token_seconds", "tandem:e2e_request_latency_seconds",
                 "tandem:time_per_output_token_seconds"):
        samples = {s.name: s for s in families[name].samples if not s.name.endswith("_bucket")}
        assert families[name].type == "histogram" and samples[name + "_count"].value > 0, name
    assert families["tandem:request_success"].samples[0].value >= 1


@pytest.mark.parametrize("body,match", [
    (b"{not json", "invalid request"),
    (json.dumps({"model": "gpt-9", "prompt": "hi"}).encode(), "model 'gpt-9' does not exist"),
    (json.dumps({"model": NAME, "prompt": "hi", "max_tokens": 0}).encode(), "max_tokens=0"),
    (json.dumps({"model": NAME, "prompt": "hi", "temperature": -1}).encode(), "temperature"),
    (json.dumps({"model": NAME, "prompt": list(range(3, 600))}).encode(), "max_model_len"),
])
def test_bad_requests_get_400_and_the_server_keeps_serving(server, body, match):
    url, _ = server
    req = urllib.request.Request(url + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(req)
    assert err.value.code == 400
    message = json.loads(err.value.read())["error"]["message"]
    assert match in message, message
    ok = _client(url).completions.create(model=NAME, prompt="still here", max_tokens=2, temperature=0)
    assert ok.choices[0].text is not None


def test_256_concurrent_streams_complete_and_equal_non_streamed(server):
    """Every one of 256 concurrent streaming greedy requests completes with the text the non-streamed
    request gives; afterwards nothing runs and the KV cache is empty."""
    import asyncio

    import openai

    url, engine = server
    prompts = [f"Count {i % 16}: one two" for i in range(256)]
    sync = _client(url)
    expect = {p: sync.completions.create(model=NAME, prompt=p, max_tokens=6, temperature=0).choices[0].text
              for p in sorted(set(prompts))}

    async def run() -> list[str]:
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=300)

        async def one(prompt: str) -> str:
            parts = []
            async for e in await client.completions.create(model=NAME, prompt=prompt, max_tokens=6, temperature=0,
                                                           stream=True):
                parts += [c.text for c in e.choices]
            return "".join(parts)

        try:
            return await asyncio.gather(*(one(p) for p in prompts))
        finally:
            await client.close()

    got = asyncio.run(run())
    assert got == [expect[p] for p in prompts]
    _assert_idle(engine)


def test_clients_that_disconnect_mid_stream_free_their_blocks(server):
    """32 clients read the first chunk of a long stream and hang up: their requests are aborted, their KV
    blocks freed, and the server goes on serving."""
    import http.client

    url, engine = server
    host, port = url.removeprefix("http://").split(":")
    body = json.dumps({"model": NAME, "prompt": "Once upon a time", "max_tokens": 400, "temperature": 0,
                       "ignore_eos": True, "stream": True})
    conns = []
    for _ in range(32):
        conn = http.client.HTTPConnection(host, int(port), timeout=60)
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 200 and resp.readline().startswith(b"data: ")
        conns.append(conn)
    for conn in conns:
        conn.sock.shutdown(socket.SHUT_RDWR)
        conn.close()
    _assert_idle(engine)
    ok = _client(url).completions.create(model=NAME, prompt="still here", max_tokens=2, temperature=0)
    assert ok.usage.completion_tokens >= 1


def _assert_idle(engine: AsyncEngine, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        m = {x.name: getattr(x, "value", None) for x in engine.metrics()}
        if m["tandem:num_requests_running"] == 0 and m["tandem:num_requests_waiting"] == 0 \
                and m["tandem:kv_cache_usage_perc"] == 0.0:
            return
        time.sleep(0.2)
    raise AssertionError(f"engine not idle after {timeout_s} s: {m}")


def test_bench_serve_measures_a_server_and_a_peer(server, capsys, tmp_path):
    from tandem.entrypoints import cli

    url, _ = server
    code = cli.main(["bench", "serve", "--url", url, "--vs", url, "--num-prompts", "8", "--concurrency", "4",
                     "--max-tokens", "6", "--output-json", str(tmp_path / "b.json")])
    assert code == 0
    out = capsys.readouterr().out
    assert "| server | req/s | output tok/s | TTFT p50 / p90 / p99 ms" in out and "x" in out.splitlines()[-1]
    rows = json.loads((tmp_path / "b.json").read_text())
    assert len(rows) == 2 and all(r["output_tokens"] == 8 * 6 and r["ttft_s"]["p50"] > 0 for r in rows)

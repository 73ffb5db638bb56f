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
from pathlib import Path

import pytest
from server_utils import alive, descendants, rank_pids, serve_subprocess, server_in_thread

from tandem.entrypoints.engine_args import EngineArgs
from tandem.entrypoints.openai.async_engine import AsyncEngine

NAME = "tiny-dsv3"


@pytest.fixture(scope="module")
def server(tiny_checkpoints):
    path = str(tiny_checkpoints("deepseek_v3", num_mtp_layers=1))
    args = EngineArgs(model=path, dtype="float32", speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    with server_in_thread(args, NAME) as (url, engine):
        yield url, engine


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


def test_n_choices_streamed_and_not_follow_seed_plus_index(server):
    url, _ = server
    client = _client(url)
    kw = {"model": NAME, "prompt": "The quick brown fox", "max_tokens": 8, "temperature": 1.0,
          "extra_body": {"ignore_eos": True}}
    full = client.completions.create(n=3, seed=5, **kw)
    assert [c.index for c in full.choices] == [0, 1, 2] and full.usage.completion_tokens == 24
    for i, choice in enumerate(full.choices):
        assert choice.text == client.completions.create(seed=5 + i, **kw).choices[0].text, f"choice {i}"
    streamed: dict[int, str] = {}
    finish: dict[int, str | None] = {}
    for event in client.completions.create(n=3, seed=5, stream=True, **kw):
        for c in event.choices:
            streamed[c.index] = streamed.get(c.index, "") + c.text
            finish[c.index] = c.finish_reason or finish.get(c.index)
    assert [streamed[i] for i in range(3)] == [c.text for c in full.choices]
    assert finish == {0: "length", 1: "length", 2: "length"}
    messages = [{"role": "user", "content": "Hello there"}]
    chat = client.chat.completions.create(model=NAME, messages=messages, n=2, seed=9, max_tokens=6,
                                          temperature=1.0)
    chat_streamed: dict[int, str] = {}
    for event in client.chat.completions.create(model=NAME, messages=messages, n=2, seed=9, max_tokens=6,
                                                temperature=1.0, stream=True):
        for c in event.choices:
            chat_streamed[c.index] = chat_streamed.get(c.index, "") + (c.delta.content or "")
    assert [chat_streamed[i] for i in range(2)] == [c.message.content for c in chat.choices]


def test_a_batch_of_prompts_numbers_choices_prompt_major(server):
    url, engine = server
    client = _client(url)
    prompts = ["Once upon a time", "The quick brown fox", "Hello"]
    kw = {"model": NAME, "max_tokens": 6, "temperature": 1.0, "seed": 3, "extra_body": {"ignore_eos": True}}
    batch = client.completions.create(prompt=prompts, n=2, **kw)
    assert [c.index for c in batch.choices] == list(range(6)) and batch.usage.completion_tokens == 36
    single = [client.completions.create(prompt=p, n=2, **kw) for p in prompts]
    assert [c.text for c in batch.choices] == [c.text for s in single for c in s.choices]
    assert batch.usage.prompt_tokens == sum(s.usage.prompt_tokens for s in single)
    streamed: dict[int, str] = {}
    usage = None
    for event in client.completions.create(prompt=prompts, n=2, stream=True,
                                           stream_options={"include_usage": True}, **kw):
        for c in event.choices:
            streamed[c.index] = streamed.get(c.index, "") + c.text
        usage = event.usage or usage
    assert [streamed[i] for i in range(6)] == [c.text for c in batch.choices]
    assert usage is not None and usage.completion_tokens == 36
    ids = [engine.tokenizer.encode(p) for p in prompts[:2]]
    by_ids = client.completions.create(prompt=ids, **kw | {"temperature": 0})
    assert [c.text for c in by_ids.choices] == [client.completions.create(prompt=p, **kw | {"temperature": 0})
                                                .choices[0].text for p in prompts[:2]]
    bad = json.dumps({"model": NAME, "prompt": [[5, 6, 7], list(range(3, 600))]}).encode()
    req = urllib.request.Request(url + "/v1/completions", data=bad, headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(req)
    assert err.value.code == 400 and "max_model_len" in json.loads(err.value.read())["error"]["message"]
    _assert_idle(engine)


def test_logprobs_streamed_equal_non_streamed(server):
    url, _ = server
    client = _client(url)
    kw = {"model": NAME, "prompt": "Once upon a time", "max_tokens": 7, "temperature": 0, "logprobs": 2,
          "extra_body": {"ignore_eos": True}}
    full = client.completions.create(**kw).choices[0]
    lp = full.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 7
    raw = b"".join(bytes.fromhex(t[6:].replace("\\x", "")) if t.startswith("bytes:") else t.encode()
                   for t in lp.tokens)
    assert raw.decode(errors="replace") == full.text and lp.text_offset[0] == 0
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert value <= 0 and top[token] == value and value == max(top.values())  # greedy: the most likely
    tokens, values = [], []
    for event in client.completions.create(stream=True, **kw):
        for c in event.choices:
            if c.logprobs is not None:
                tokens += c.logprobs.tokens
                values += c.logprobs.token_logprobs
    assert tokens == lp.tokens and values == pytest.approx(lp.token_logprobs, abs=1e-6)

    messages = [{"role": "user", "content": "Hello world"}]
    ckw = {"model": NAME, "messages": messages, "max_tokens": 5, "temperature": 0, "logprobs": True,
           "top_logprobs": 3}
    chat = client.chat.completions.create(**ckw)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    assert all(len(e.top_logprobs) == 3 and e.top_logprobs[0].logprob == e.logprob for e in content)
    streamed = [e for event in client.chat.completions.create(stream=True, **ckw) for c in event.choices
                if c.logprobs is not None for e in c.logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in content]
    plain = client.chat.completions.create(model=NAME, messages=messages, max_tokens=5, temperature=0)
    assert plain.choices[0].logprobs is None


def test_chat_without_max_tokens_runs_to_eos_or_the_context(server):
    url, _ = server
    chat = _client(url).chat.completions.create(model=NAME, messages=[{"role": "user", "content": "Hi"}],
                                                temperature=0)
    choice = chat.choices[0]
    assert choice.finish_reason == "stop" or chat.usage.completion_tokens > 16, (choice.finish_reason, chat.usage)
    assert chat.usage.total_tokens <= 512  # the tiny model's context


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
    (json.dumps({"model": NAME, "prompt": "hi", "n": 0}).encode(), "n=0"),
    (json.dumps({"model": NAME, "prompt": "hi", "logprobs": 21}).encode(), "logprobs=21"),
])
def test_bad_requests_get_400_and_the_server_keeps_serving(server, body, match):
    url, _ = server
    req = urllib.request.Request(url + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(req)
    assert err.value.code == (404 if b"gpt-9" in body else 400)  # an unknown model is a 404, as in vLLM
    message = json.loads(err.value.read())["error"]["message"]
    assert match in message, message
    ok = _client(url).completions.create(model=NAME, prompt="still here", max_tokens=2, temperature=0)
    assert ok.choices[0].text is not None


def test_chat_top_logprobs_without_logprobs_is_a_400(server):
    url, _ = server
    body = json.dumps({"model": NAME, "messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}).encode()
    req = urllib.request.Request(url + "/v1/chat/completions", data=body, headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(req)
    assert err.value.code == 400 and "top_logprobs needs logprobs" in json.loads(err.value.read())["error"]["message"]


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


def test_non_streamed_requests_whose_clients_hang_up_are_aborted_and_end(server):
    """A hung-up non-streamed request (n = 2, a batch of two prompts) is aborted, frees its blocks, and its
    handler finishes (no reader left waiting on a stream that will never end)."""
    import http.client

    url, engine = server
    host, port = url.removeprefix("http://").split(":")
    body = json.dumps({"model": NAME, "prompt": ["Once upon a time", "Hello"], "n": 2, "max_tokens": 400,
                       "temperature": 1.0, "ignore_eos": True})
    conns = []
    for _ in range(4):
        conn = http.client.HTTPConnection(host, int(port), timeout=60)
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        conns.append(conn)
    deadline = time.monotonic() + 30
    while engine.num_open_streams < 8 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert engine.num_open_streams == 8  # 4 requests x 2 prompts, each generating
    for conn in conns:
        conn.sock.shutdown(socket.SHUT_RDWR)
        conn.close()
    _assert_idle(engine)
    deadline = time.monotonic() + 10
    while engine.num_open_streams and time.monotonic() < deadline:
        time.sleep(0.05)
    assert engine.num_open_streams == 0, "a handler still waits on an aborted request"


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
    rows = json.loads((tmp_path / "b.json").read_text())["results"]
    assert len(rows) == 2 and all(r["output_tokens"] == 8 * 6 and r["ttft_s"]["p50"] > 0 for r in rows)


def test_logprob_token_names_are_distinct_and_reassemble_the_text():
    from tandem.assets import default_model
    from tandem.tokenizer import Tokenizer

    tok = Tokenizer(str(default_model()))
    text = "héllo → 世界"
    ids = tok.encode(text)[1:]  # without BOS
    names = [tok.token_text(t) for t in ids]
    assert any(n.startswith("bytes:\\x") for n in names), names  # byte-level pieces of the CJK characters
    assert b"".join(tok.token_bytes(t) for t in ids).decode() == text
    partial = [t for t, n in zip(ids, names, strict=True) if n.startswith("bytes:")]
    assert len({tok.token_text(t) for t in partial}) == len(set(partial)), "two byte tokens share a name"


@pytest.mark.parametrize("signum", ["SIGTERM", "SIGINT"])
def test_serve_shuts_down_with_its_ranks_on_a_signal(tiny_checkpoints, signum):
    import signal

    path = str(tiny_checkpoints("llama"))
    proc, url = serve_subprocess(path, "-pcp", "2")
    try:
        ok = _client(url).completions.create(model=Path(path).name, prompt="hello", max_tokens=3, temperature=0)
        assert ok.usage.completion_tokens == 3
        ranks = descendants(proc.pid)
        assert ranks, "no rank processes found under the server"
        proc.send_signal(getattr(signal, signum))
        assert proc.wait(timeout=60) == 0, proc.stderr.read().decode()[-2000:] if proc.stderr else ""
        _assert_gone(ranks)
    finally:
        if proc.poll() is None:
            proc.kill()


def _assert_gone(pids: list[int], timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while any(alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [pid for pid in pids if alive(pid)], "a rank outlived the server"


def test_vllm_extra_sampling_parameters_and_version(server, tiny_checkpoints):
    from tandem import LLM, SamplingParams

    url, _ = server
    client = _client(url)
    reference = LLM(str(tiny_checkpoints("deepseek_v3", num_mtp_layers=1)), dtype="float32").generate(
        "The quick brown fox", SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    ids = reference[0].outputs[0].token_ids
    stop_id = ids[2]
    stopped = client.completions.create(model=NAME, prompt="The quick brown fox", max_tokens=8, temperature=0,
                                        extra_body={"ignore_eos": True, "stop_token_ids": [stop_id]})
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.usage.completion_tokens == ids.index(stop_id) + 1
    longer = client.completions.create(model=NAME, prompt="The quick brown fox", max_tokens=8, temperature=0,
                                       extra_body={"stop_token_ids": [stop_id], "ignore_eos": True,
                                                   "min_tokens": 8})
    assert longer.usage.completion_tokens == 8
    version = json.loads(urllib.request.urlopen(url + "/version").read())
    assert isinstance(version["version"], str) and version["version"]


def test_a_killed_rank_fails_open_streams_and_ends_the_server(tiny_checkpoints):
    import os

    proc, url = serve_subprocess(str(tiny_checkpoints("llama")), "-pcp", "2")
    try:
        ranks = descendants(proc.pid)
        body = json.dumps({"prompt": "hello", "max_tokens": 500, "ignore_eos": True, "stream": True}).encode()
        resp = urllib.request.urlopen(urllib.request.Request(url + "/v1/completions", data=body,
                                                             headers={"Content-Type": "application/json"}))
        assert resp.readline().startswith(b"data: ")  # tokens are flowing
        victim = rank_pids(proc.pid)[0]
        os.kill(victim, 9)
        start = time.monotonic()
        events = [line.decode() for line in resp if line.startswith(b"data: ")]
        assert time.monotonic() - start < 60
        assert any('"error"' in e and "engine stopped" in e for e in events), events[-3:]
        assert proc.wait(timeout=60) == 1
        stderr = proc.stderr.read().decode() if proc.stderr else ""
        assert "engine stopped" in stderr and "rank" in stderr, stderr[-2000:]
        _assert_gone(ranks)
    finally:
        if proc.poll() is None:
            proc.kill()


def test_echo_prepends_the_prompt_streamed_and_not(server):
    url, _ = server
    client = _client(url)
    kw = {"model": NAME, "max_tokens": 5, "temperature": 0, "extra_body": {"ignore_eos": True}}
    plain = client.completions.create(prompt="Once upon a time", **kw).choices[0].text
    echoed = client.completions.create(prompt="Once upon a time", echo=True, **kw).choices[0].text
    assert echoed == "Once upon a time" + plain
    streamed = "".join(e.choices[0].text for e in client.completions.create(
        prompt="Once upon a time", echo=True, stream=True, **kw) if e.choices)
    assert streamed == echoed
    body = json.dumps({"model": NAME, "prompt": "hi", "echo": True, "logprobs": 1, "stream": True}).encode()
    req = urllib.request.Request(url + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(req)
    assert err.value.code == 400 and "echo with logprobs" in json.loads(err.value.read())["error"]["message"]


def test_echo_with_logprobs_scores_the_prompt_as_lm_eval_asks(server):
    """lm-eval's loglikelihood request: echo, logprobs=1, max_tokens=1, temperature 0 -> every prompt token's
    logprob (None for the first), equal to the engine's own prompt_logprobs, then the completion's."""
    from tandem import LLM, SamplingParams

    url, engine = server
    prompt = "Once upon a time there was"
    res = _client(url).completions.create(model=NAME, prompt=prompt, echo=True, logprobs=1, max_tokens=1,
                                          temperature=0).choices[0]
    ids = engine.tokenizer.encode(prompt)
    lp = res.logprobs
    assert len(lp.tokens) == len(ids) + 1 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert res.text.startswith(prompt) and lp.text_offset[0] == 0
    assert lp.text_offset[len(ids)] == len(prompt)  # the completion starts where the echoed prompt ends
    ref = LLM(engine.engine.config.model_config.model, dtype="float32").generate(
        prompt, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1), use_tqdm=False)[0]
    expect = [None] + [ref.prompt_logprobs[p][ids[p]] for p in range(1, len(ids))]
    assert lp.token_logprobs[:len(ids)] == pytest.approx(expect[:1] + expect[1:], abs=1e-5)
    assert all(v <= 0 for v in lp.token_logprobs[1:])

"""Issue 12: no request, no model folder and no configuration can take tandem down. One test per row of the issue
(grouped where natural): each bad input fails alone with an error naming the field, and the engine, offline or
served, keeps serving the next request. The server runs in this process on the bundled model."""

from __future__ import annotations

import json
import logging
import multiprocessing
import shutil
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch
from server_utils import free_port, server_in_thread, wait_healthy

from tandem import LLM, SamplingParams
from tandem.assets import default_model
from tandem.config import ConfigError
from tandem.entrypoints.cli import main as cli_main
from tandem.entrypoints.engine_args import EngineArgs
from tandem.entrypoints.openai.api_server import build_app
from tandem.entrypoints.openai.async_engine import short_error
from tandem.entrypoints.openai.limits import API_KEY_ENV, ServerLimits
from tandem.layers.sampler import SamplingMetadata, sample

NAME = "bundled"
I64 = 2**63
LIMITS = ServerLimits(max_n=128, max_prompts_per_request=8, max_request_bytes=1 << 20)


@pytest.fixture(scope="module")
def llm():
    llm = LLM(default_model(), dtype="float32", max_model_len=256)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def server():
    args = EngineArgs(model=default_model(), dtype="float32", max_model_len=256)
    with server_in_thread(args, NAME, LIMITS) as (url, engine):
        yield url, engine


def _post(url: str, path: str, body: dict | bytes, headers: dict | None = None) -> tuple[int, dict | str]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url + path, data=data, headers={"Content-Type": "application/json",
                                                                 **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            text = resp.read().decode()
            status = resp.status
    except urllib.error.HTTPError as e:
        text, status = e.read().decode(), e.code
    try:
        return status, json.loads(text)
    except json.JSONDecodeError:
        return status, text


def _assert_error(status: int, body, expected_status: int, *words: str) -> None:
    assert status == expected_status, (status, body)
    assert isinstance(body, dict) and set(body["error"]) >= {"message", "type", "code"}, body
    assert body["error"]["code"] == expected_status
    for word in words:
        assert word in body["error"]["message"], (word, body["error"]["message"])


def _assert_serving(url: str) -> None:
    """/health ok and a streamed request runs to its end: the engine thread survived whatever came before."""
    assert urllib.request.urlopen(url + "/health", timeout=10).read() == b"ok"
    status, text = _post(url, "/v1/completions", {"prompt": "hello", "max_tokens": 3, "ignore_eos": True,
                                                  "stream": True})
    assert status == 200 and text.rstrip().endswith("data: [DONE]") and '"error"' not in text, text


# -- rows 1, 9, 16, 18 (offline): SamplingParams checks types and ranges ------------------------------------------

@pytest.mark.parametrize("kwargs,field", [
    ({"seed": I64}, "seed"), ({"seed": -I64 - 1}, "seed"), ({"seed": 2**64}, "seed"),
    ({"seed": I64 - 1, "n": 2}, "seed"), ({"top_k": I64}, "top_k"), ({"n": I64 - 1}, "n"), ({"n": 10**6}, "n"),
    ({"max_tokens": I64}, "max_tokens"), ({"min_tokens": I64}, "min_tokens"),
    ({"logprobs": -1}, "logprobs"), ({"prompt_logprobs": I64}, "prompt_logprobs"),
    ({"stop_token_ids": [I64]}, "stop_token_ids"),
    ({"temperature": "hot"}, "temperature"), ({"stop": 5}, "stop"), ({"max_tokens": 1.5}, "max_tokens"),
    ({"n": True}, "n"), ({"top_k": 2.0}, "top_k"), ({"ignore_eos": "yes"}, "ignore_eos"),
    ({"temperature": float("inf")}, "temperature"), ({"temperature": float("nan")}, "temperature"),
    ({"top_p": float("nan")}, "top_p"), ({"min_p": float("inf")}, "min_p"), ({"stop": [3]}, "stop"),
])
def test_sampling_params_reject_out_of_range_and_mistyped_values(kwargs, field):
    with pytest.raises(ValueError, match=rf"SamplingParams\.{field}=.* is invalid: "):
        SamplingParams(**kwargs)


def test_sampling_params_accept_the_int64_edges():
    assert SamplingParams(seed=I64 - 1).seed == I64 - 1
    assert SamplingParams(seed=-I64, n=3).seed == -I64
    assert SamplingParams(seed=I64 - 2, n=2, top_k=I64 - 1, logprobs=20, prompt_logprobs=20).n == 2


def test_a_failed_call_never_poisons_the_llm(llm, monkeypatch):
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    expected = llm.generate("hello world", params, use_tqdm=False)[0].outputs[0].token_ids
    # row 16: a float token id is a ValueError at submission, and nothing of that call stays queued
    with pytest.raises(ValueError, match=r"prompt_token_ids=\[1\.5\] is invalid"):
        llm.generate(["hello world", {"prompt_token_ids": [1.5]}], params, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    # row 9: more logprobs than the vocabulary is a ValueError at submission (it used to fail the step)
    for name in ("logprobs", "prompt_logprobs"):
        with pytest.raises(ValueError, match=rf"SamplingParams\.{name}=5000 is invalid: at most the vocabulary"):
            llm.generate(["hello world", "good night"], SamplingParams(max_tokens=2, **{name: 5000}), use_tqdm=False)
        assert not llm.engine.has_unfinished_requests()
    # a step that raises (as logprobs=5000 used to, deep in the runner) aborts that call's requests
    real = llm.engine.executor.execute
    monkeypatch.setattr(llm.engine.executor, "execute", lambda plan: (_ for _ in ()).throw(RuntimeError("boom")))
    with pytest.raises(RuntimeError, match="boom"):
        llm.generate(["hello world", "good night"], params, use_tqdm=False)
    monkeypatch.setattr(llm.engine.executor, "execute", real)
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.scheduler.block_manager.usage() == 0
    assert llm.generate("hello world", params, use_tqdm=False)[0].outputs[0].token_ids == expected


# -- row 11: a top_p that underflows float32 keeps the top token --------------------------------------------------

def test_tiny_top_p_keeps_the_top_token(llm):
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0], [5.0, 0.0, 1.0, 4.9]])
    for top_p in (1e-46, 1e-300):
        meta = SamplingMetadata(temperature=torch.tensor([1.0, 0.7]), top_k=torch.tensor([0, 0]),
                                top_p=torch.tensor([top_p, top_p], dtype=torch.float32),
                                min_p=torch.tensor([0.0, 0.0]), seeds=torch.tensor([1, 2]),
                                positions=torch.tensor([5, 9]), max_num_logprobs=None, all_greedy=False)
        assert sample(logits, meta).tolist() == [1, 0], top_p
    greedy = llm.generate("Once upon a time", SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
                          use_tqdm=False)[0].outputs[0]
    tiny = llm.generate("Once upon a time", SamplingParams(temperature=1.0, top_p=1e-300, max_tokens=6, seed=3,
                                                           ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert tiny.token_ids == greedy.token_ids and tiny.text


# -- row 14: TP that does not divide the heads fails before any rank starts ---------------------------------------

def test_tp_that_does_not_divide_the_heads_is_a_config_error_before_ranks_start():
    start = time.monotonic()
    with pytest.raises(ConfigError, match=r"tensor_parallel_size=3 is not allowed: .*num_attention_heads \(4\)"):
        LLM(default_model(), tensor_parallel_size=3)
    assert multiprocessing.active_children() == [] and time.monotonic() - start < 30


# -- row 15: broken model folders and flags get the one-line error, exit 2 ----------------------------------------

def _folder(tmp_path: Path) -> Path:
    folder = tmp_path / "m"
    shutil.copytree(default_model(), folder)
    return folder


@pytest.mark.parametrize("case", ["empty_weights", "truncated_weights", "config_list", "config_no_hidden",
                                  "spec_k_string", "device_cuda", "port"])
def test_cli_reports_broken_folders_and_flags_in_one_line(case, tmp_path, capsys):
    folder = _folder(tmp_path)
    weights, config = folder / "model.safetensors", folder / "config.json"
    argv = ["generate", str(folder), "-p", "hi", "--max-tokens", "1"]
    if case == "empty_weights":
        weights.write_bytes(b"")
        named = str(weights)
    elif case == "truncated_weights":
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
        named = str(weights)
    elif case == "config_list":
        config.write_text("[1, 2]")
        named = f"{config}: must be a JSON object"
    elif case == "config_no_hidden":
        cfg = json.loads(config.read_text())
        del cfg["hidden_size"]
        config.write_text(json.dumps(cfg))
        named = "hidden_size=None"
    elif case == "spec_k_string":
        argv += ["--speculative-config", '{"method": "mtp", "num_speculative_tokens": "3"}']
        named = "speculative_config.num_speculative_tokens='3'"
    elif case == "device_cuda":
        if torch.cuda.is_available():
            argv += ["--device", "cuda:99"]
        else:
            argv += ["--device", "cuda"]
        named = "device='cuda"
    else:
        argv = ["serve", str(folder), "--port", "-1"]
        named = "--port=-1"
    assert cli_main(argv) == 2
    err = capsys.readouterr().err
    assert "error:" in err and named in err and "Traceback" not in err, err


# -- rows 1, 2, 18 (server): every integer field range-checked; the engine thread survives ------------------------

COMPLETION_INTS = [("seed", I64), ("seed", -I64 - 1), ("top_k", I64), ("n", I64 - 1), ("n", 10**6), ("n", 129),
                   ("max_tokens", I64), ("min_tokens", I64), ("logprobs", I64), ("logprobs", 21)]
CHAT_INTS = [("seed", 2**64), ("top_k", I64), ("n", I64 - 1), ("max_tokens", I64),
             ("max_completion_tokens", I64), ("min_tokens", -1), ("top_logprobs", I64)]


@pytest.mark.parametrize("field,value", COMPLETION_INTS)
def test_completions_integer_fields_are_range_checked(server, field, value):
    url, _ = server
    status, body = _post(url, "/v1/completions", {"prompt": "hi", "max_tokens": 2, field: value})
    _assert_error(status, body, 400, f"{field}=")


@pytest.mark.parametrize("field,value", CHAT_INTS)
def test_chat_integer_fields_are_range_checked(server, field, value):
    url, _ = server
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, field: value}
    if field == "top_logprobs":
        body["logprobs"] = True
    status, answer = _post(url, "/v1/chat/completions", body)
    _assert_error(status, answer, 400, f"{field}=")


def test_bad_integers_leave_the_server_serving(server):
    url, _ = server
    for body in ({"prompt": "hi", "seed": I64 - 1, "n": 2}, {"prompt": "hi", "stop_token_ids": [I64]},
                 {"prompt": [I64, 5]}, {"prompt": [[-1]]}, {"prompt": "hi", "seed": I64, "stream": True}):
        status, answer = _post(url, "/v1/completions", {"max_tokens": 2, **body})
        assert status == 400, (body, answer)
    _assert_serving(url)


def test_prompts_per_request_are_bounded(server):
    url, _ = server
    status, body = _post(url, "/v1/completions", {"prompt": ["hi"] * 9, "max_tokens": 1})
    _assert_error(status, body, 400, "9 prompts", "at most 8", "--max-prompts-per-request")
    status, body = _post(url, "/v1/completions", {"prompt": ["hi"] * 10**5, "max_tokens": 1})
    _assert_error(status, body, 400, "100000 prompts")


def test_unknown_model_empty_prompts_and_non_finite_numbers(server):
    url, _ = server
    status, body = _post(url, "/v1/completions", {"model": "gpt-9", "prompt": "hi"})
    _assert_error(status, body, 404, "'gpt-9' does not exist")
    assert body["error"]["type"] == "NotFoundError"
    for prompt in ("", [""], ["hi", ""]):
        status, body = _post(url, "/v1/completions", {"prompt": prompt, "max_tokens": 1})
        _assert_error(status, body, 400, "prompt is empty")
    for raw in (b'{"prompt": "hi", "temperature": Infinity}', b'{"prompt": "hi", "temperature": NaN}',
                b'{"prompt": "hi", "top_p": -Infinity}'):
        status, body = _post(url, "/v1/completions", raw)
        _assert_error(status, body, 400, "finite")


# -- row 4: oversized bodies get 413 early; tokenizing a long prompt leaves the event loop free --------------------

def test_oversized_bodies_get_413_before_they_are_read(server):
    url, _ = server
    import http.client

    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    start = time.monotonic()
    # announces 50 MB but sends none of it: the answer comes from the header alone
    conn.putrequest("POST", "/v1/completions")
    conn.putheader("Content-Type", "application/json")
    conn.putheader("Content-Length", str(50 << 20))
    conn.endheaders()
    resp = conn.getresponse()
    assert resp.status == 413 and time.monotonic() - start < 5
    assert "--max-request-bytes" in json.loads(resp.read())["error"]["message"]
    conn.close()
    conn = http.client.HTTPConnection(host, int(port), timeout=30)  # chunked: counted while read
    chunk = b"x" * (256 << 10)
    conn.request("POST", "/v1/completions", body=iter([chunk] * 8), headers={"Content-Type": "application/json"},
                 encode_chunked=True)
    assert conn.getresponse().status == 413
    conn.close()
    _assert_serving(url)


def test_a_long_prompt_is_tokenized_off_the_event_loop(server):
    url, _ = server
    text = "hello world, " * 75_000  # ~1 MB, ~450k tokens: seconds of tokenizing, then a 400 (too long)
    result = {}
    thread = threading.Thread(target=lambda: result.update(answer=_post(url, "/v1/completions",
                                                                        {"prompt": text, "max_tokens": 1})))
    thread.start()
    time.sleep(0.3)
    slowest = 0.0
    while thread.is_alive():
        start = time.monotonic()
        urllib.request.urlopen(url + "/health", timeout=30).read()
        slowest = max(slowest, time.monotonic() - start)
        time.sleep(0.05)
    status, body = result["answer"]
    _assert_error(status, body, 400, "tokens", "max_model_len")
    assert slowest < 1.0, f"/health took {slowest:.2f} s while a prompt was tokenized"


# -- row 6: --api-key ----------------------------------------------------------------------------------------------

def test_api_key_guards_v1_only(server, monkeypatch):
    import uvicorn

    url, engine = server
    monkeypatch.setenv(API_KEY_ENV, "from-env")
    assert ServerLimits.with_env_key(None).api_key == "from-env"
    assert ServerLimits.with_env_key("flag").api_key == "flag"
    port = free_port()
    srv = uvicorn.Server(uvicorn.Config(build_app(engine, NAME, default_model(), ServerLimits(api_key="sekret")),
                                        host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    keyed = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(keyed)  # /health needs no key
        body = {"prompt": "hi", "max_tokens": 1}
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sekret"}):
            status, answer = _post(keyed, "/v1/completions", body, headers)
            _assert_error(status, answer, 401, "API key")
        with pytest.raises(urllib.error.HTTPError, match="401"):
            urllib.request.urlopen(keyed + "/v1/models")
        status, answer = _post(keyed, "/v1/completions", body, {"Authorization": "Bearer sekret"})
        assert status == 200 and answer["choices"], answer
    finally:
        srv.should_exit = True
        thread.join(timeout=10)


# -- rows 7, 8, 10: chat messages, unimplemented fields, lone surrogates -------------------------------------------

def test_chat_content_parts_are_joined_and_bad_messages_named(server):
    url, _ = server
    kw = {"max_tokens": 4, "temperature": 0}
    _, plain = _post(url, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi\nthere"}], **kw})
    parts = [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]
    status, joined = _post(url, "/v1/chat/completions", {"messages": [{"role": "user", "content": parts}], **kw})
    assert status == 200 and joined["choices"][0]["message"] == plain["choices"][0]["message"]
    bad = [([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
            "content[0] of type 'image_url'"),
           ([{"content": "hi"}], "messages[0].role=None"), ([{"role": "wizard", "content": "hi"}], "'wizard'"),
           ([], "messages=[]"), ([{"role": "user", "content": None}], "messages[0].content=None"),
           ([{"role": "user", "content": {"text": "hi"}}], "messages[0].content={'text': 'hi'}"),
           ([{"role": "user", "content": "ok"}, {"role": "robot", "content": "x"}], "messages[1].role='robot'")]
    for messages, named in bad:
        status, body = _post(url, "/v1/chat/completions", {"messages": messages, **kw})
        _assert_error(status, body, 400, named)


@pytest.mark.parametrize("field,value", [
    ("functions", [{"name": "f"}]), ("logit_bias", {"5": 100}), ("presence_penalty", 1.0),
])
def test_unimplemented_fields_are_a_400_not_ignored(server, field, value):
    url, _ = server
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, field: value}
    status, answer = _post(url, "/v1/chat/completions", body)
    _assert_error(status, answer, 400, f"{field}=", "not supported")
    status, answer = _post(url, "/v1/chat/completions", {**body, field: None})  # explicit null means "off"
    assert status == 200, answer


def test_lone_surrogates_are_a_400_in_openai_shape(server):
    url, _ = server
    for path, body in [("/v1/completions", {"prompt": "a\ud800b"}),
                       ("/v1/completions", {"prompt": "a\ud800", "echo": True}),
                       ("/v1/completions", {"prompt": "hi", "stop": ["\udfff"]}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x\ud800"}]})]:
        status, answer = _post(url, path, json.dumps({"max_tokens": 1, **body}).encode())  # "\\ud800" escapes
        _assert_error(status, answer, 400, "lone surrogate")
    _assert_serving(url)


# -- rows 12, 17: hang-ups are one INFO line and counted; crashes reach clients as one short line ------------------

def _metric(url: str, name: str) -> float:
    text = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
    return next(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " "))


def test_a_client_hanging_up_mid_stream_is_one_info_line_and_counted(server, caplog):
    import socket

    url, _ = server
    host, port = url.removeprefix("http://").split(":")
    before = _metric(url, "tandem:request_aborted_total")
    caplog.set_level(logging.INFO)
    for _ in range(3):
        sock = socket.create_connection((host, int(port)))
        body = json.dumps({"prompt": "hello", "max_tokens": 200, "ignore_eos": True, "stream": True}).encode()
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        received = b""
        while b"data: " not in received:  # tokens are flowing
            chunk = sock.recv(4096)
            assert chunk, received
            received += chunk
        sock.close()
    deadline = time.monotonic() + 30
    while _metric(url, "tandem:num_requests_running") or _metric(url, "tandem:request_aborted_total") < before + 3:
        assert time.monotonic() < deadline, "aborts not counted or requests still running"
        time.sleep(0.05)
    time.sleep(0.3)  # a traceback would be logged as the handler unwinds
    errors = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert not errors, [r.getMessage() for r in errors]
    aborted = [r for r in caplog.records if r.levelno == logging.INFO and "aborted" in r.getMessage()]
    assert len(aborted) == 3, [r.getMessage() for r in aborted]


def test_engine_failures_reach_clients_as_one_short_line():
    try:
        raise RuntimeError("boom\n  File \"/abs/path/tandem/worker/x.py\", line 3")
    except RuntimeError as e:
        assert short_error(e) == "RuntimeError: boom"
    from tandem.executor.multiproc import EngineDeadError

    assert short_error(EngineDeadError("engine stopped: rank 1 died (exit code -9)")) == "rank 1 died (exit code -9)"
    args = EngineArgs(model=default_model(), dtype="float32", max_model_len=128)
    with server_in_thread(args, NAME) as (url, engine):
        def crash(plan):
            raise ValueError(f"bad state\nTraceback (most recent call last):\n  File \"{Path(__file__)}\"")

        engine.engine.executor.execute = crash
        for stream in (True, False):  # the step that crashes, then a request to the stopped engine
            status, body = _post(url, "/v1/completions", {"prompt": "hi", "max_tokens": 2, "stream": stream})
            _assert_error(status, body, 500)
            assert body["error"]["message"] == "the engine stopped: ValueError: bad state", body
        with pytest.raises(urllib.error.HTTPError) as failed:
            urllib.request.urlopen(url + "/health", timeout=10)
        assert json.loads(failed.value.read())["error"]["message"] == "engine stopped: ValueError: bad state"


# -- row 13: SIGTERM under load ends open streams with an error event, exit 0, no traceback -------------------------

def test_sigterm_under_load_tells_open_streams_and_exits_cleanly():
    import os
    import signal

    from server_utils import serve_subprocess

    proc, url = serve_subprocess(default_model(), "--max-model-len", "512")
    try:
        body = json.dumps({"prompt": "hello", "max_tokens": 400, "ignore_eos": True, "stream": True}).encode()
        streams = [urllib.request.urlopen(urllib.request.Request(url + "/v1/completions", data=body, headers={
            "Content-Type": "application/json"}), timeout=60) for _ in range(3)]
        for resp in streams:
            assert resp.readline().startswith(b"data: ")  # tokens are flowing
        os.kill(proc.pid, signal.SIGTERM)
        for resp in streams:
            events = [line.decode() for line in resp if line.startswith(b"data: ")]
            assert any('"error"' in e and "shutting down" in e for e in events), events[-2:]
        assert proc.wait(timeout=30) == 0
        stderr = proc.stderr.read().decode() if proc.stderr else ""
        assert "Traceback" not in stderr and "Event loop is closed" not in stderr, stderr[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()

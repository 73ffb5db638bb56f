"""Issue 12 must-show 2: a seeded fuzz of `tandem serve`. 2,000 requests to both endpoints mix valid, edge and
invalid values for every field (types, int64 and float edges, unicode and lone surrogates, sizes within a small
cap), streamed and not, 8 at a time. Pinned: no 5xx and no error event, every request answered, every all-valid
request a 200 with the choices it asked for, /health ok throughout, running/waiting/KV usage back to 0 at the end,
and the server's RSS within 10% of its warmed-up size."""

from __future__ import annotations

import json
import random
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from server_utils import serve_subprocess

from tandem.assets import default_model

SEED = 12
NUM_REQUESTS = 2000
NUM_WARMUP = 150
CONCURRENCY = 8
VOCAB = 2048  # the bundled model's
MAX_MODEL_LEN = 128
OMIT = object()

TEXTS = ["hello", "The quick brown fox", "héllo wörld", "世界 🙂 مرحبا", "a\u0301e\u0308", "tab\tnew\nline",
         "1 + 1 =", "<s> </s> [INST]"]
BAD_TEXTS = ["", "\ud800", "x\udfff", "\x00" * 3, "word " * 400]  # empty, lone surrogates, NULs, too long
INT_EDGES = [-1, 0, 2**31, 2**63 - 1, -(2**63), 2**63, 2**64, 10**6, 129]
WRONG_TYPES = ["3", 1.5, True, None, [], {}, "hot"]
FLOAT_EDGES = [0.0, 1e-46, 1e-300, 0.999999, 1.0, 2.0, -0.5, float("inf"), float("nan"), 1e308]
STRUCTURED = [("response_format", {"type": "json_object"}), ("response_format", {"type": "text"}),
              ("response_format", {"type": "json_schema", "json_schema": {"name": "p", "schema": {
                  "type": "object", "properties": {"a": {"type": "integer"}, "b": {"enum": ["x", "y"]}},
                  "required": ["b"]}}}),
              ("structured_outputs", {"choice": ["yes", "no", "世界"]}), ("structured_outputs", {"regex": r"\d{1,4}"}),
              ("structured_outputs", {"grammar": 'root ::= "a" root | "b"'})]
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {
    "type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}}},
         {"type": "function", "function": {"name": "g"}}]
BAD_STRUCTURED = [("response_format", {"type": "json_schema"}), ("response_format", {"type": "xml"}),
                  ("response_format", "json"), ("structured_outputs", {"regex": "(unclosed"}),
                  ("structured_outputs", {"grammar": "root ::= nowhere"}),
                  ("structured_outputs", {"json": {"$ref": "#"}}),
                  ("structured_outputs", {"choice": [str(i) for i in range(100_000)]}),
                  ("structured_outputs", {"json": {"type": "object"}, "regex": "a"}), ("structured_outputs", [1]),
                  ("structured_outputs", {"json": {"type": "florp"}}), ("structured_outputs", {"guided_json": {}})]


class Fuzzer:
    """Bodies for one endpoint: each field is omitted, valid, edge or of a wrong type; `clean` requests draw
    valid values only, and must succeed."""

    def __init__(self, rng: random.Random):
        self.rng = rng

    def pick(self, valid: list[Any], edge: list[Any], clean: bool) -> Any:
        r = self.rng.random()
        if clean or r < 0.75:
            return self.rng.choice(valid)
        return self.rng.choice(edge + WRONG_TYPES) if r < 0.95 else OMIT

    def sampling(self, clean: bool) -> dict[str, Any]:
        p = self.pick
        fields = {
            "max_tokens": p([1, 2, 4, 6], INT_EDGES, clean), "temperature": p([0, 0.7, 1.0], FLOAT_EDGES, clean),
            "top_p": p([1.0, 0.9, 1e-46], FLOAT_EDGES, clean), "top_k": p([0, -1, 1, 50], INT_EDGES, clean),
            "min_p": p([0.0, 0.1], FLOAT_EDGES, clean), "n": p([1, 1, 2, 3], INT_EDGES, clean),
            "seed": p([None, 0, 7, 2**63 - 4, -(2**63)], INT_EDGES, clean),
            "stop": p([None, "\n", ["the", "é"]], [[""], 5, ["\ud800"], ["x"] * 50, "a" * 300], clean),
            "ignore_eos": p([True, False], ["yes", 1], clean), "stop_token_ids": p([None, [], [1, 5]],
                                                                                 [[-1], [2**63], ["a"]], clean),
            "min_tokens": p([0, 1], INT_EDGES, clean), "include_stop_str_in_output": p([False, True], [2], clean),
            "skip_special_tokens": p([True, False], ["no"], clean), "stream": p([False, True], [1, "yes"], clean),
            "stream_options": p([None, {"include_usage": True}], ["yes", {"include_usage": "maybe"}], clean),
            "model": p([None, "bundled"], ["gpt-9", "", 5], clean),
        }
        if self.rng.random() < 0.1:  # a constraint: valid ones run (max_tokens may cut them: "length"), bad ones 400
            name, value = self.rng.choice(STRUCTURED if clean else STRUCTURED + BAD_STRUCTURED)
            fields[name] = value
        if not clean and self.rng.random() < 0.1:  # a field tandem does not implement, or an unknown one
            name, value = self.rng.choice([("tools", [{"x": 1}]),
                                           ("logit_bias", {"1": 5}), ("suffix", "x"), ("best_of", 3),
                                           ("presence_penalty", 0.5), ("foo", "bar"), ("tool_choice", "auto")])
            fields[name] = value
        return fields

    def prompt(self, clean: bool) -> Any:
        rng = self.rng
        valid = [rng.choice(TEXTS), [rng.randrange(3, VOCAB) for _ in range(rng.randint(1, 12))],
                 [rng.choice(TEXTS) for _ in range(rng.randint(1, 3))],
                 [[rng.randrange(3, VOCAB) for _ in range(rng.randint(1, 6))] for _ in range(rng.randint(1, 3))]]
        edge = [*BAD_TEXTS, [], [""], [VOCAB], [-1], [2**63], [1.5], [[]], ["hi"] * 5, 123, None, {"a": 1},
                [[1], "mixed"], ["\ud800"]]
        return self.pick(valid, edge, clean)

    def messages(self, clean: bool) -> Any:
        rng = self.rng

        def content() -> Any:
            return self.pick([rng.choice(TEXTS), [{"type": "text", "text": rng.choice(TEXTS)}] * rng.randint(1, 2)],
                             [*BAD_TEXTS, None, {"text": "x"}, [{"type": "image_url", "image_url": {"url": "x"}}],
                              [{"type": "text"}], 5], clean)

        valid_roles = ["system", "user", "assistant"]
        msgs = [{k: v for k, v in (("role", self.pick(valid_roles, [None, "wizard", "tool", 3, ""], clean)),
                                   ("content", content())) if v is not OMIT} for _ in range(rng.randint(1, 3))]
        if clean:
            msgs[-1]["role"] = "user"
        return self.pick([msgs], [[], "hi", [{"content": "no role"}], [5], None], clean)

    def body(self, endpoint: str) -> tuple[dict[str, Any], bool]:
        clean = self.rng.random() < 0.4
        fields = self.sampling(clean)
        if endpoint == "completions":
            fields["prompt"] = self.prompt(clean)
            fields["logprobs"] = self.pick([None, 0, 2, 5], [21, *INT_EDGES], clean)
            fields["echo"] = self.pick([False, True], ["yes"], clean)
            if clean and fields["echo"] and fields["logprobs"] is not None and fields["stream"]:
                fields["echo"] = False  # echo + logprobs is answered non-streamed only: a 400 by design
        else:
            fields["messages"] = self.messages(clean)
            fields["logprobs"] = self.pick([False, True], [1, "yes"], clean)
            fields["top_logprobs"] = self.pick([None, 3], [21, *INT_EDGES], clean)
            if clean and fields["top_logprobs"] is not None:
                fields["logprobs"] = True
            fields["max_completion_tokens"] = self.pick([None, 3], INT_EDGES, clean)
            if self.rng.random() < 0.1 and not {"response_format", "structured_outputs"} & set(fields):
                fields["tools"] = TOOLS  # forced calls run; "auto" is a 400 here (no --enable-auto-tool-choice)
                fields["tool_choice"] = self.pick(["required", "none", {"type": "function", "function": {"name": "f"}}],
                                                  ["auto", "sometimes", {"type": "function"}], clean)
        body = {k: v for k, v in fields.items() if v is not OMIT}
        return body, clean


def _num_prompts(prompt: Any) -> int:
    return len(prompt) if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int) else 1


def _send(url: str, endpoint: str, body: dict[str, Any]) -> tuple[int, str]:
    path = "/v1/completions" if endpoint == "completions" else "/v1/chat/completions"
    req = urllib.request.Request(url + path, data=json.dumps(body).encode(),  # NaN/Infinity as JSON extensions
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def _check(endpoint: str, body: dict[str, Any], clean: bool, status: int, text: str) -> str | None:
    """What is wrong with one answer, or None."""
    if status >= 500 or status not in (200, 400, 404):
        return f"status {status}"
    if status != 200:
        error = json.loads(text).get("error", {})
        if not error.get("message") or error.get("code") != status:
            return f"error not in OpenAI's shape: {text[:200]}"
        return f"a valid request got {status}: {error['message']}" if clean else None
    # pydantic's lax mode reads 1 and "yes" as true, so the answer's shape says whether it streamed
    stream = body.get("stream") is True or text.startswith("data: ")
    if stream:
        events = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
        if not events or events[-1] != "[DONE]":
            return "stream did not end with [DONE]"
        if any('"error"' in e[:12] for e in events):
            return f"error event in a stream: {[e for e in events if 'error' in e][:1]}"
        choices = {c["index"] for e in events[:-1] for c in json.loads(e)["choices"]}
    else:
        choices = {c["index"] for c in json.loads(text)["choices"]}
    expected = (body.get("n") or 1) * (_num_prompts(body.get("prompt")) if endpoint == "completions" else 1)
    if clean and len(choices) != expected:
        return f"{len(choices)} choices, asked for {expected}"
    return None


def _rss_kib(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmRSS:")))


def _metrics(url: str) -> dict[str, float]:
    text = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
    return {line.split()[0]: float(line.split()[-1]) for line in text.splitlines()
            if line and not line.startswith("#") and "{" not in line}


def test_fuzzed_requests_never_take_the_server_down():
    rng = random.Random(SEED)
    fuzzer = Fuzzer(rng)
    requests = [(endpoint, *fuzzer.body(endpoint)) for endpoint in
                (rng.choice(["completions", "chat"]) for _ in range(NUM_WARMUP + NUM_REQUESTS))]
    proc, url = serve_subprocess(default_model(), "--max-model-len", str(MAX_MODEL_LEN),
                                 "--served-model-name", "bundled")
    log: list[str] = []  # the server's stderr, drained so that a full pipe never blocks it
    threading.Thread(target=lambda: log.extend(line.decode(errors="replace") for line in proc.stderr),
                     daemon=True).start()
    health_failures: list[str] = []
    done = threading.Event()

    def watch_health() -> None:
        while not done.is_set():
            start = time.monotonic()
            try:
                ok = urllib.request.urlopen(url + "/health", timeout=10).read() == b"ok"
            except OSError as e:
                ok = False
                health_failures.append(repr(e))
            if not ok or time.monotonic() - start > 5:
                health_failures.append(f"/health slow or failing ({time.monotonic() - start:.1f} s)")
            done.wait(0.5)

    try:
        with ThreadPoolExecutor(CONCURRENCY) as pool:
            warm = list(pool.map(lambda r: _send(url, r[0], r[1]), requests[:NUM_WARMUP]))
            rss_before = _rss_kib(proc.pid)
            watcher = threading.Thread(target=watch_health, daemon=True)
            watcher.start()
            start = time.monotonic()
            answers = list(pool.map(lambda r: _send(url, r[0], r[1]), requests[NUM_WARMUP:]))
            elapsed = time.monotonic() - start
        done.set()
        watcher.join()
        problems = [f"{endpoint} {json.dumps(body)[:300]}: {problem}"
                    for (endpoint, body, clean), (status, text) in zip(requests, warm + answers, strict=True)
                    if (problem := _check(endpoint, body, clean, status, text)) is not None]
        tracebacks = [i for i, line in enumerate(log) if line.startswith("Traceback")]
        assert not problems, f"{len(problems)} bad answers, e.g.\n" + "\n".join(problems[:5]) + \
            "\nserver log:\n" + "".join(log[tracebacks[0] + 30: tracebacks[0] + 60] if tracebacks else log[-20:])
        assert not tracebacks, "".join(log[tracebacks[0]: tracebacks[0] + 40]) if tracebacks else ""
        assert not health_failures, health_failures[:5]
        statuses = [status for status, _ in answers]
        assert statuses.count(200) >= NUM_REQUESTS // 3 and statuses.count(400) >= NUM_REQUESTS // 5, \
            {s: statuses.count(s) for s in set(statuses)}
        deadline = time.monotonic() + 20
        while True:
            m = _metrics(url)
            idle = (m["tandem:num_requests_running"], m["tandem:num_requests_waiting"], m["tandem:kv_cache_usage_perc"])
            if idle == (0, 0, 0):
                break
            assert time.monotonic() < deadline, f"running, waiting, KV usage stuck at {idle}"
            time.sleep(0.2)
        rss_after = _rss_kib(proc.pid)
        print(f"fuzz: {NUM_REQUESTS} requests in {elapsed:.1f} s, statuses "
              f"{ {s: statuses.count(s) for s in sorted(set(statuses))} }, RSS {rss_before / 1024:.0f} -> "
              f"{rss_after / 1024:.0f} MiB")
        assert rss_after <= 1.10 * rss_before, f"RSS grew from {rss_before} to {rss_after} KiB"
        assert elapsed < 120, f"{NUM_REQUESTS} requests took {elapsed:.0f} s"
        assert proc.poll() is None and urllib.request.urlopen(url + "/health", timeout=10).read() == b"ok"
    finally:
        done.set()
        proc.kill()
        proc.wait(timeout=30)

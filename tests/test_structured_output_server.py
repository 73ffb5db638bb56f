"""Structured output through `tandem serve` with the official openai client, on each grammar backend (xgrammar,
llguidance): response_format json_schema and json_object, chat.completions.parse with pydantic models, vLLM's
structured_outputs field on completions, streamed and not, under MTP drafts; hostile constraints are a prompt 400
naming the problem while the server stays healthy; a grammar cut by max_tokens ends with "length"."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from enum import StrEnum
from typing import Annotated

import jsonschema
import pytest
from json_schemas import random_schema
from pydantic import BaseModel, Field
from server_utils import server_in_thread

from tandem.entrypoints.engine_args import EngineArgs

NAME = "tiny-dsv3"
NUM_SCHEMAS = 10


@pytest.fixture(scope="module", params=["xgrammar", "llguidance"])
def server(tiny_checkpoints, request):
    path = str(tiny_checkpoints("deepseek_v3", num_mtp_layers=1))
    args = EngineArgs(model=path, dtype="float32", speculative_config={"method": "mtp", "num_speculative_tokens": 2},
                      structured_outputs_config={"backend": request.param, "disable_any_whitespace": True})
    with server_in_thread(args, NAME) as (url, engine):
        yield url, engine


def _client(url: str):
    import openai

    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=300)


def _parse(text: str) -> object:
    return json.loads(text, strict=False)  # see test_structured_output._parse: xgrammar's counted strings


def _post(url: str, path: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(url + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_json_schema_response_format_validates(server):
    url, _ = server
    client = _client(url)
    for seed in range(NUM_SCHEMAS):
        schema = random_schema(seed)
        kwargs = {"model": NAME, "messages": [{"role": "user", "content": f"object {seed}"}], "max_tokens": 400,
                  "temperature": 1.0, "seed": seed,
                  "response_format": {"type": "json_schema", "json_schema": {"name": f"s{seed}", "schema": schema,
                                                                             "strict": True}}}
        if seed % 2:
            chunks = list(client.chat.completions.create(**kwargs, stream=True))
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            reason = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
        else:
            choice = client.chat.completions.create(**kwargs).choices[0]
            text, reason = choice.message.content, choice.finish_reason
        assert reason == "stop", f"schema {seed}: {reason} {text!r}"
        jsonschema.validate(_parse(text), schema)


class Color(StrEnum):
    red = "red"
    green = "green"


class Part(BaseModel):
    name: Annotated[str, Field(max_length=8)]
    count: Annotated[int, Field(ge=0, le=99)]


class Order(BaseModel):
    color: Color
    urgent: bool
    parts: Annotated[list[Part], Field(min_length=1, max_length=2)]


def test_parse_with_pydantic_model(server):
    url, _ = server
    client = _client(url)
    for seed in range(3):
        completion = client.chat.completions.parse(model=NAME, messages=[{"role": "user", "content": "an order"}],
                                                   response_format=Order, max_tokens=300, seed=seed,
                                                   temperature=1.0)
        assert isinstance(completion.choices[0].message.parsed, Order)


def test_json_object_and_structured_outputs_on_completions(server):
    url, _ = server
    client = _client(url)
    chat = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "json"}],
                                          response_format={"type": "json_object"}, max_tokens=300, temperature=0)
    assert isinstance(_parse(chat.choices[0].message.content), dict)
    out = client.completions.create(model=NAME, prompt="pick", max_tokens=20, temperature=1.0, seed=3,
                                    extra_body={"structured_outputs": {"choice": ["left", "right"]}})
    assert out.choices[0].text in ("left", "right")
    streamed = client.completions.create(model=NAME, prompt="number", max_tokens=20, stream=True, temperature=1.0,
                                         extra_body={"structured_outputs": {"regex": r"[1-9]\d{2}"}})
    assert len("".join(c.choices[0].text for c in streamed)) == 3


def test_grammar_cut_by_max_tokens_ends_with_length(server):
    url, engine = server
    grammars = ['root ::= "a" root', 'root ::= ("a" | "b") root']  # no end: only max_tokens stops them
    if engine.engine.config.structured_outputs_config.backend == "llguidance":  # refuses a forced endless output
        status, body = _post(url, "/v1/chat/completions", {
            "messages": [{"role": "user", "content": "x"}], "max_tokens": 3,
            "structured_outputs": {"grammar": grammars.pop(0)}})
        assert status == 400 and "forces more than" in body["error"]["message"], body
    for grammar in grammars:
        status, body = _post(url, "/v1/chat/completions", {
            "messages": [{"role": "user", "content": "x"}], "max_tokens": 3, "temperature": 0,
            "structured_outputs": {"grammar": grammar}})
        assert status == 200 and body["choices"][0]["finish_reason"] == "length", body
        assert body["choices"][0]["message"]["content"][0] in "ab"


# (extra request fields, what the 400 names: one text, or {backend: text} where the backends' words differ; None:
# this backend may compile it, a 200 or a bounded 400)
HOSTILE = [
    ({"structured_outputs": {"choice": [f"c{i}" for i in range(100_000)]}}, "at most 1024"),
    ({"structured_outputs": {"json": {"type": "string", "description": "x" * 100_000}}}, "characters"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "deep", "schema": json.loads(
        '{"type": "object", "properties": {"a": ' * 60 + '{"type": "string"}' + "}}" * 60)}}}, "levels deep"),
    ({"structured_outputs": {"json": {"$ref": "#"}}}, {"xgrammar": "Circular", "llguidance": None}),
    ({"structured_outputs": {"regex": "(unclosed"}}, {"xgrammar": "parenthesis", "llguidance": "unclosed group"}),
    ({"structured_outputs": {"regex": "((a{50}){50}){50}"}}, None),  # compiles: 200, or a bounded 400
    ({"structured_outputs": {"grammar": "root ::= nowhere"}}, {"xgrammar": "not defined", "llguidance": "not found"}),
    ({"structured_outputs": {"json": {"type": "florp"}}}, "florp"),
    ({"response_format": {"type": "json_schema"}}, "schema is missing"),
    ({"response_format": {"type": "xml"}}, "not supported"),
    ({"structured_outputs": {"guided_json": {}}}, "unknown keys"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "both set"),
]


@pytest.mark.parametrize("extra,named", HOSTILE, ids=range(len(HOSTILE)))
def test_hostile_constraints_are_a_prompt_400(server, extra, named):
    url, engine = server
    if isinstance(named, dict):
        named = named[engine.engine.config.structured_outputs_config.backend]
    start = time.monotonic()
    status, body = _post(url, "/v1/chat/completions",
                         {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2, **extra})
    assert time.monotonic() - start < 15, "a hostile constraint must be answered within a bounded time"
    if named is None:
        assert status in (200, 400), body
    else:
        assert status == 400 and named in body["error"]["message"], body
    ok, answer = _post(url, "/v1/completions", {"prompt": "still there", "max_tokens": 2})
    assert ok == 200, answer
    assert urllib.request.urlopen(url + "/health", timeout=5).status == 200

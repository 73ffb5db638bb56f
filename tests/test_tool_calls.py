"""Tool calling: each parser on its family's exact format, malformed output returned as content; through `tandem
serve` with the openai client, a two-tool conversation where tool_choice "required" and a named function always
produce a valid call to a listed tool (streamed and not, finish_reason "tool_calls"), "auto" gives content or a
call, tool results are accepted as messages, and a tool_choice the server cannot honour is a 400."""

from __future__ import annotations

import json

import jsonschema
import pytest
from server_utils import server_in_thread

from tandem.entrypoints.engine_args import EngineArgs
from tandem.entrypoints.openai.tool_calls import ToolServing
from tandem.entrypoints.openai.tool_parsers import parse_hermes, parse_llama3_json

NAME = "tiny-dsv3"
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                            "unit": {"enum": ["c", "f"]}},
           "required": ["city", "unit"], "additionalProperties": False}
ADD = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                        "b": {"type": "integer", "minimum": 0, "maximum": 99}},
       "required": ["a", "b"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "description": "Add two numbers", "parameters": ADD}}]
SCHEMAS = {"get_weather": WEATHER, "add": ADD}


def test_hermes_parser_reads_qwen_calls():
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}\n'
            '</tool_call>\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>')
    content, calls = parse_hermes(text)
    assert content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Oslo", "unit": "c"}), ("add", {"a": 1, "b": 2})]
    assert parse_hermes("no calls here") == ("no calls here", [])


@pytest.mark.parametrize("text", [
    '<tool_call>\n{"name": "add", "arguments": {"a": 1,}}\n</tool_call>',  # bad JSON
    '<tool_call>\n{"arguments": {"a": 1}}\n</tool_call>',  # no name
    '<tool_call>\n{"name": "add", "arguments": [1, 2]}\n</tool_call>',  # arguments not an object
    '<tool_call>\n{"name": "add", "arguments": {"a": 1}}',  # cut short: parsed, as the block is complete JSON
])
def test_hermes_malformed_calls_come_back_as_content(text):
    content, calls = parse_hermes(text)
    if calls:
        assert text.endswith("}}") and calls[0].name == "add"
    else:
        assert content == text


def test_llama3_json_parser_reads_llama_calls():
    content, calls = parse_llama3_json('<|python_tag|>{"name": "add", "parameters": {"a": 1, "b": 2}}; '
                                       '{"name": "get_weather", "parameters": {"city": "Rome", "unit": "f"}}')
    assert content is None and [c.name for c in calls] == ["add", "get_weather"]
    assert json.loads(calls[1].arguments) == {"city": "Rome", "unit": "f"}
    for bad in ['{"name": "add", "parameters": {"a": 1}', '{"parameters": {}}', '{"name": "add"} trailing',
                "plain answer", '{"name": "add", "parameters": "x"}']:
        assert parse_llama3_json(bad) == (bad, []), bad


@pytest.fixture(scope="module")
def server(tiny_checkpoints):
    path = str(tiny_checkpoints("deepseek_v3", num_mtp_layers=1))
    args = EngineArgs(model=path, dtype="float32", structured_outputs_config={"disable_any_whitespace": True})
    with server_in_thread(args, NAME, tool_serving=ToolServing(True, "hermes")) as (url, engine):
        yield url, engine


def _client(url: str):
    import openai

    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=300)


CONVERSATION = [
    {"role": "user", "content": "What is 2 + 3, and the weather in Oslo?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "5"},
    {"role": "user", "content": "And the weather?"},
]


def _assert_valid_calls(calls, only: str | None = None) -> None:
    assert calls, "no tool call"
    for call in calls:
        assert call.type == "function" and call.id
        assert call.function.name in SCHEMAS and (only is None or call.function.name == only)
        jsonschema.validate(json.loads(call.function.arguments, strict=False), SCHEMAS[call.function.name])


def _streamed_calls(stream) -> tuple[list, str | None]:
    calls: dict[int, dict] = {}
    finish = None
    for chunk in stream:
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            for delta in choice.delta.tool_calls or []:
                entry = calls.setdefault(delta.index, {"name": "", "arguments": "", "id": delta.id})
                entry["name"] += delta.function.name or ""
                entry["arguments"] += delta.function.arguments or ""
    return list(calls.values()), finish


@pytest.mark.parametrize("seed", range(4))
def test_required_and_named_always_call_a_listed_tool(server, seed):
    url, _ = server
    client = _client(url)
    kw = {"model": NAME, "messages": CONVERSATION, "tools": TOOLS, "max_tokens": 200, "temperature": 1.0,
          "seed": seed}
    for choice, only in [("required", None), ({"type": "function", "function": {"name": "get_weather"}},
                                              "get_weather")]:
        reply = client.chat.completions.create(**kw, tool_choice=choice).choices[0]
        assert reply.finish_reason == "tool_calls", reply
        _assert_valid_calls(reply.message.tool_calls, only)
        calls, finish = _streamed_calls(client.chat.completions.create(**kw, tool_choice=choice, stream=True))
        assert finish == "tool_calls" and calls
        for call in calls:
            assert call["name"] in SCHEMAS and (only is None or call["name"] == only)
            jsonschema.validate(json.loads(call["arguments"], strict=False), SCHEMAS[call["name"]])


def test_auto_returns_content_or_a_call(server):
    url, _ = server
    client = _client(url)
    for seed in range(3):
        reply = client.chat.completions.create(model=NAME, messages=CONVERSATION, tools=TOOLS, max_tokens=30,
                                               temperature=1.0, seed=seed).choices[0]
        if reply.message.tool_calls:
            assert reply.finish_reason == "tool_calls"
        else:
            assert reply.message.content is not None and reply.finish_reason in ("stop", "length")


@pytest.mark.parametrize("body,named", [
    ({"tool_choice": "required"}, "needs tools"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "not in tools"),
    ({"tools": [{"type": "function"}], "tool_choice": "required"}, r"tools\[0\]"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "invalid"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "forces"),
])
def test_bad_tool_requests_are_a_400(server, body, named):
    import openai

    url, _ = server
    with pytest.raises(openai.BadRequestError, match=named):
        _client(url).chat.completions.create(model=NAME, messages=CONVERSATION, max_tokens=5, **body)


def test_auto_needs_the_server_flags(tiny_checkpoints):
    import openai

    args = EngineArgs(model=str(tiny_checkpoints("deepseek_v3", num_mtp_layers=1)), dtype="float32")
    with server_in_thread(args, NAME) as (url, _):
        with pytest.raises(openai.BadRequestError, match="enable-auto-tool-choice"):
            _client(url).chat.completions.create(model=NAME, messages=CONVERSATION, tools=TOOLS, max_tokens=5)
        reply = _client(url).chat.completions.create(model=NAME, messages=CONVERSATION, tools=TOOLS, max_tokens=3,
                                                     tool_choice="none")
        assert reply.choices[0].message.tool_calls is None

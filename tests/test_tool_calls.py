"""Tool calling: each parser on its family's exact format, malformed output returned as content, and streamed
piece by piece to the same message; through `tandem serve` with the openai client, a two-tool conversation where
tool_choice "required" and a named function always produce a valid call to a listed tool (streamed and not,
finish_reason "tool_calls"), streamed deltas rebuild the non-streamed call, "auto" gives content or a call, tool
results are accepted as messages, and a tool_choice the server cannot honour is a 400."""

from __future__ import annotations

import json

import jsonschema
import pytest
from server_utils import server_in_thread

from tandem.entrypoints.engine_args import EngineArgs
from tandem.entrypoints.openai.tool_calls import ToolServing
from tandem.entrypoints.openai.tool_parsers import TOOL_PARSERS, NamedParser, RequiredParser
from tandem.entrypoints.openai.tool_stream import ToolStream

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


def parse_hermes(text: str):
    return TOOL_PARSERS["hermes"](TOOLS).parse(text)


def parse_llama3_json(text: str):
    return TOOL_PARSERS["llama3_json"](TOOLS).parse(text)


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


DS_BEGIN, DS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"


def _ds_call(name: str, args: str, kind: str = "function") -> str:
    return f"<｜tool▁call▁begin｜>{kind}<｜tool▁sep｜>{name}\n```json\n{args}\n```<｜tool▁call▁end｜>"


def test_deepseek_v3_parser_reads_deepseek_calls():
    text = ("Checking both.\n" + DS_BEGIN + _ds_call("get_weather", '{"city": "Oslo", "unit": "c"}') + "\n"
            + _ds_call("add", '{\n  "a": 1,\n  "b": 2\n}') + DS_END)
    content, calls = TOOL_PARSERS["deepseek_v3"](TOOLS).parse(text)
    assert content == "Checking both."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Oslo", "unit": "c"}), ("add", {"a": 1, "b": 2})]
    assert calls[0].arguments == '{"city": "Oslo", "unit": "c"}'  # the model's text, as vLLM passes it on


@pytest.mark.parametrize("text", [
    DS_BEGIN + _ds_call("add", '{"a": 1,}') + DS_END,  # bad JSON
    DS_BEGIN + _ds_call("add", "[1, 2]") + DS_END,  # arguments not an object
    DS_BEGIN + _ds_call("", '{"a": 1}') + DS_END,  # no name
    DS_BEGIN + _ds_call("add", '{"a": 1}', kind="code") + DS_END,  # not a function
    DS_BEGIN + _ds_call("add", '{"a": 1}').replace("\n```<", "<") + DS_END,  # no closing fence
    DS_BEGIN + _ds_call("add", '{"a": 1}')[:-20],  # cut by max_tokens
    DS_BEGIN + "no call block" + DS_END,
])
def test_deepseek_v3_malformed_calls_come_back_as_content(text):
    assert TOOL_PARSERS["deepseek_v3"](TOOLS).parse(text) == (text, [])
    assert TOOL_PARSERS["deepseek_v3"](TOOLS).parse("plain answer") == ("plain answer", [])


def test_glm45_parser_reads_glm_calls_typed_by_the_schema():
    text = ("I will call.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>123</arg_value>\n"
            "<arg_key>unit</arg_key>\n<arg_value>c</arg_value>\n</tool_call>\n"
            "<tool_call>add\n<arg_key>a</arg_key>\n<arg_value>4</arg_value>\n<arg_key>b</arg_key>\n"
            "<arg_value>x5</arg_value>\n</tool_call>")
    content, calls = TOOL_PARSERS["glm45"](TOOLS).parse(text)
    assert content == "I will call."
    # city is a string in its schema, so "123" stays text; a is an integer and parses; "x5" is no JSON: text
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "123", "unit": "c"}), ("add", {"a": 4, "b": "x5"})]
    glm47 = "<tool_call>add<arg_key>a</arg_key><arg_value>1</arg_value><arg_key>b</arg_key><arg_value>2</arg_value>" \
            "</tool_call>"  # GLM-4.7: no newlines
    assert [(c.name, json.loads(c.arguments)) for c in TOOL_PARSERS["glm45"](TOOLS).parse(glm47)[1]] == [
        ("add", {"a": 1, "b": 2})]
    assert TOOL_PARSERS["glm45"](TOOLS).parse("<tool_call>now</tool_call>")[1][0].arguments == "{}"


@pytest.mark.parametrize("text", [
    "<tool_call>\n<arg_key>a</arg_key><arg_value>1</arg_value></tool_call>",  # no name
    "<tool_call>add\n<arg_key>a</arg_key><arg_value>1</arg_value>\nstray text</tool_call>",  # not a pair
    "<tool_call>add\n<arg_key>a</arg_key><arg_value>1</arg_value><arg_key>a</arg_key><arg_value>2</arg_value>"
    "</tool_call>",  # a key twice
    "<tool_call>add\n<arg_key>a</arg_key><arg_value>1",  # cut by max_tokens
])
def test_glm45_malformed_calls_come_back_as_content(text):
    assert TOOL_PARSERS["glm45"](TOOLS).parse(text) == (text, [])


STREAMED = [
    ("hermes", 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}\n'
               '</tool_call>\n<tool_call>\n{"arguments": {"a": 1, "b": {}}, "name": "add"}\n</tool_call>'),
    ("hermes", 'Plain answer with a < sign and <tool_ but no call.  '),
    ("hermes", '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2'),  # cut: the name went out, content
    ("llama3_json", '<|python_tag|>{"name": "add", "parameters": {"a": 1, "b": {"c": [1, 2]}}}; '
                    '{"name": "get_weather", "parameters": {"city": "Rome", "unit": "f"}}'),
    ("llama3_json", "  not json at all"),
    ("deepseek_v3", "Sure." + DS_BEGIN + _ds_call("get_weather", '{"city": "Oslo", "unit": "c"}')
     + _ds_call("add", '{"a": 1, "b": 2}') + DS_END),
    ("glm45", "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Oslo</arg_value>\n<arg_key>unit</arg_key>\n"
              "<arg_value>c</arg_value>\n</tool_call>"),
    ("required", '[{"name": "add", "parameters": {"a": 1, "b": 2}}, {"name": "get_weather", "parameters": '
                 '{"city": "Oslo", "unit": "f"}}]'),
    ("named", '{"city": "Oslo", "unit": "c"}'),
]


def _parser(name: str):
    if name == "required":
        return RequiredParser(TOOLS)
    if name == "named":
        return NamedParser(TOOLS, "get_weather")
    return TOOL_PARSERS[name](TOOLS)


def _accumulate(deltas: list[dict]) -> tuple[str | None, list[dict]]:
    """What a client that appends by index (the openai package does) makes of the deltas."""
    content, calls = None, {}
    for delta in deltas:
        if "content" in delta:
            content = (content or "") + delta["content"]
        for entry in delta.get("tool_calls", []):
            call = calls.setdefault(entry["index"], {"name": "", "arguments": "", "ids": 0})
            call["ids"] += "id" in entry
            call["name"] += entry.get("function", {}).get("name", "")
            call["arguments"] += entry.get("function", {}).get("arguments", "")
    return content, [calls[i] for i in sorted(calls)]


@pytest.mark.parametrize("parser,text", STREAMED, ids=[f"{p}-{i}" for i, (p, _) in enumerate(STREAMED)])
@pytest.mark.parametrize("piece", [1, 3, 7])
def test_streamed_deltas_rebuild_the_parsed_message(parser, text, piece):
    """Fed a few characters at a time, the stream sends names before arguments and its deltas add up to the parsed
    message (a call broken after its name went out: the text as content and no "tool_calls" finish)."""
    stream = ToolStream(_parser(parser))
    deltas = [d for at in range(0, len(text), piece) if (d := stream.push(text[at:at + piece])) is not None]
    last, finish = stream.finish(text, "stop")
    content, calls = _accumulate([*deltas, last])
    want_content, want_calls = _parser(parser).parse(text)
    if not want_calls:  # content as written: what was held back or streamed as call deltas comes last as content
        assert finish == "stop" and content == text, (content, calls)
        return
    assert finish == "tool_calls" and content == want_content
    assert [(c["name"], c["arguments"]) for c in calls] == [(c.name, c.arguments) for c in want_calls]
    assert all(c["ids"] == 1 for c in calls), "each call's id goes out once, with its name"
    if len(text) > 40 and piece == 1:  # arguments went out in more than one piece, after the name
        assert sum("tool_calls" in d for d in deltas) > len(want_calls), deltas


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


def _final_via_client_stream(client, **kw):
    """The openai package's own accumulation of a streamed chat completion (`chat.completions.stream`)."""
    with client.chat.completions.stream(**kw) as stream:
        events = [e.type for e in stream]
        return stream.get_final_completion().choices[0], events


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "add"}}],
                         ids=["required", "named"])
def test_client_stream_accumulation_equals_non_streamed_call(server, choice):
    url, _ = server
    client = _client(url)
    kw = {"model": NAME, "messages": CONVERSATION, "tools": TOOLS, "max_tokens": 200, "temperature": 0,
          "tool_choice": choice}
    whole = client.chat.completions.create(**kw).choices[0]
    streamed, events = _final_via_client_stream(client, **kw)
    assert streamed.finish_reason == whole.finish_reason == "tool_calls"
    assert [(c.function.name, c.function.arguments) for c in streamed.message.tool_calls] == \
        [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]
    assert events.count("tool_calls.function.arguments.delta") > 1, "arguments arrive in pieces as they form"


def test_auto_streams_content_then_the_call_as_it_forms(server):
    """The model's output forced to a hermes call (a one-choice grammar): content first, then the call's name in a
    chunk of its own before its arguments arrive in pieces, and the client rebuilds the non-streamed message."""
    forced = 'Sure.\n<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
    url, _ = server
    client = _client(url)
    kw = {"model": NAME, "messages": CONVERSATION, "tools": TOOLS, "max_tokens": 100, "temperature": 0,
          "extra_body": {"structured_outputs": {"choice": [forced]}}}
    whole = client.chat.completions.create(**kw).choices[0]
    assert whole.finish_reason == "tool_calls" and whole.message.content == "Sure."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in whole.message.tool_calls] == [
        ("add", {"a": 2, "b": 3})]
    chunks = [c.choices[0] for c in client.chat.completions.create(**kw, stream=True) if c.choices]
    kinds = [("content" if c.delta.content else "") + ("name" if c.delta.tool_calls and
                                                       c.delta.tool_calls[0].function.name else "")
             + ("args" if c.delta.tool_calls and c.delta.tool_calls[0].function.arguments else "") for c in chunks]
    named = kinds.index(next(k for k in kinds if "name" in k))
    assert "content" in kinds[:named] and kinds.count("args") > 1 and named < len(kinds) - 2, kinds
    streamed, _ = _final_via_client_stream(client, **kw)
    assert streamed.message.content == whole.message.content and streamed.finish_reason == "tool_calls"
    assert [(c.function.name, c.function.arguments) for c in streamed.message.tool_calls] == \
        [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]

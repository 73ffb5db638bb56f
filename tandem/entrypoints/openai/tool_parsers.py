"""Tool-call parsers (`--tool-call-parser`): a model family's written tool calls -> OpenAI's `tool_calls`, the text
around them kept as content. A call that does not parse (malformed JSON, a missing name) leaves the whole output as
content: the client sees what the model wrote, never a 500.

    hermes       (Qwen2.5/Qwen3, Hermes)  <tool_call>{"name": ..., "arguments": {...}}</tool_call>, one block per call
    llama3_json  (Llama 3.1+)             [<|python_tag|>]{"name": ..., "parameters": {...}}, calls joined by ";"
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it

    def to_openai(self, index: int | None = None) -> dict[str, Any]:
        call: dict[str, Any] = {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                                "function": {"name": self.name, "arguments": self.arguments}}
        return call if index is None else {"index": index, **call}


Parsed = tuple[str | None, list[ToolCall]]  # (content, calls)
_HERMES = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)


def _call(obj: Any, arguments_key: str) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    arguments = obj.get(arguments_key, {})
    if not isinstance(arguments, dict):
        return None
    return ToolCall(obj["name"], json.dumps(arguments, ensure_ascii=False))


def parse_hermes(text: str) -> Parsed:
    if "<tool_call>" not in text:
        return text, []
    calls = []
    for block in _HERMES.findall(text):
        try:
            call = _call(json.loads(block.strip()), "arguments")
        except json.JSONDecodeError:
            call = None
        if call is None:
            return text, []  # one malformed call: the output goes back as written
        calls.append(call)
    content = text[:text.index("<tool_call>")].strip()
    return content or None, calls


def parse_llama3_json(text: str) -> Parsed:
    body = text.strip().removeprefix("<|python_tag|>").strip()
    if not body.startswith("{"):
        return text, []
    calls, decoder, at = [], json.JSONDecoder(), 0
    while at < len(body):
        try:
            obj, end = decoder.raw_decode(body, at)
        except json.JSONDecodeError:
            return text, []
        call = _call(obj, "parameters" if isinstance(obj, dict) and "parameters" in obj else "arguments")
        if call is None:
            return text, []
        calls.append(call)
        at = end
        rest = body[at:].lstrip()
        if not rest:
            break
        if not rest.startswith(";"):
            return text, []
        at = len(body) - len(rest) + 1
        while at < len(body) and body[at].isspace():
            at += 1
    return None, calls


TOOL_PARSERS: dict[str, Callable[[str], Parsed]] = {"hermes": parse_hermes, "llama3_json": parse_llama3_json}

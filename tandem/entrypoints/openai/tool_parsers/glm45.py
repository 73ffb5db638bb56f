"""glm45 (GLM-4.5/4.6/4.7): each call is a block of key/value pairs after the content; the name ends at the first
newline (GLM-4.5) or at the first pair (GLM-4.7 writes none):

    <tool_call>get_weather
    <arg_key>city</arg_key>
    <arg_value>Oslo</arg_value>
    </tool_call>

A value is text when the tool's schema types the parameter "string", else JSON where it parses (numbers, booleans,
objects) and text where it does not, as vLLM reads it. The arguments stream one whole pair at a time.
"""

from __future__ import annotations

import json
import re
from typing import Any

from tandem.entrypoints.openai.tool_parsers.base import CallDraft
from tandem.entrypoints.openai.tool_parsers.json_calls import BlockParser

_PAIR = re.compile(r"\s*<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)
_NAME_END = re.compile(r"\n|<arg_key>")


class Glm45Parser(BlockParser):
    BEGIN, END = "<tool_call>", "</tool_call>"

    def body(self, text: str, whole: bool) -> CallDraft | None:
        cut = _NAME_END.search(text)
        if cut is None and not whole:
            return None
        name = text[:cut.start() if cut else len(text)].strip()
        if not name:
            return None
        pos, pairs, keys = cut.start() if cut else len(text), [], set()
        while (pair := _PAIR.match(text, pos)) is not None:
            key = pair.group(1).strip()
            if key in keys:
                return None  # a key twice: no JSON object says that
            keys.add(key)
            value = json.dumps(self._value(name, key, pair.group(2).strip()), ensure_ascii=False)
            pairs.append(f"{json.dumps(key, ensure_ascii=False)}: {value}")
            pos = pair.end()
        if whole and text[pos:].strip():
            return None  # text that is not a pair
        return CallDraft(name, "{" + ", ".join(pairs) + ("}" if whole else ""))

    def _value(self, name: str, key: str, raw: str) -> Any:
        if self._type(name, key) == "string":
            return raw
        try:
            return json.loads(raw)
        except json.JSONDecodeError:
            return raw

    def _type(self, name: str, key: str) -> Any:
        for tool in self.tools:
            function = tool.get("function", {})
            if function.get("name") == name:
                return (function.get("parameters") or {}).get("properties", {}).get(key, {}).get("type")
        return None

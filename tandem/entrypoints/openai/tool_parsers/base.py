"""What every tool-call parser shares: the call and scan shapes, and the two reads a parser writes, which serve both
the whole output (`parse`) and a stream of it (tool_stream.py), so a streamed call is the parsed call.

`find_calls` settles the content before the first call; `scan_calls` reads the calls from a position on. While
streaming (`final=False`) they report only what no later text can change: content up to a possible partial marker
(and trailing whitespace, which is dropped before a call), a call's name once it is whole, its arguments text up to
what might still turn out to be the call's closing (a trailing `}`, a partial end marker). On the whole output
(`final=True`) a call that does not parse marks the scan malformed, and the output goes back as content, as written.
"""

from __future__ import annotations

import json
import re
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it

    def to_openai(self, index: int | None = None) -> dict[str, Any]:
        call: dict[str, Any] = {"id": new_call_id(), "type": "function",
                                "function": {"name": self.name, "arguments": self.arguments}}
        return call if index is None else {"index": index, **call}


Parsed = tuple[str | None, list[ToolCall]]  # (content, calls)


@dataclass
class CallDraft:
    name: str | None  # None until the whole name is known
    arguments: str  # the arguments text so far: a prefix of the final arguments (all of them once complete)
    complete: bool = False


@dataclass
class Scan:
    calls: list[CallDraft] = field(default_factory=list)  # from the scan's start on
    resume: int = 0  # where the next scan starts (the call after the first `skip` calls, or their start)
    skip: int = 0  # calls of this scan before `resume`: settled
    malformed: bool = False  # no later text can make these calls parse (always checked when final)


class ToolParser(ABC):
    """One model family's written calls. `tools` are the request's (OpenAI's shape), for parsers that need the
    parameters' types."""

    def __init__(self, tools: list[dict[str, Any]]):
        self.tools = tools

    @abstractmethod
    def find_calls(self, text: str, at: int) -> tuple[int, int | None]:
        """(content_end, calls_at): text[:content_end] is settled content, searched from `at` (the content settled
        so far); calls_at is where the calls begin, None while they have not (the content is final once they do)."""

    @abstractmethod
    def scan_calls(self, text: str, at: int, final: bool) -> Scan:
        """The calls from `at` (find_calls' calls_at, or a previous scan's `resume`) on."""

    def parse(self, text: str) -> Parsed:
        """The whole output: (content or None, calls); (text, []) when it calls nothing or any call is malformed."""
        content_end, calls_at = self.find_calls(text, 0)
        if calls_at is None:
            return text, []
        scan = self.scan_calls(text, calls_at, final=True)
        if scan.malformed or not scan.calls or not all(c.complete and c.name for c in scan.calls):
            return text, []
        return text[:content_end] or None, [ToolCall(str(c.name), c.arguments) for c in scan.calls]


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def held_back(text: str, marker: str) -> int:
    """How many trailing characters of `text` could be the start of `marker` (held back until they settle)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def content_before(text: str, at: int, marker: str) -> tuple[int, int | None]:
    """find_calls for calls that begin at a marker: the content is the text before it, rstripped."""
    start = text.find(marker, at)
    if start >= 0:
        return len(text[:start].rstrip()), start
    end = len(text) - held_back(text, marker)
    return max(len(text[:end].rstrip()), at), None


_NAME_FIRST = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(arguments|parameters)"\s*:\s*')
DECODER = json.JSONDecoder()


def json_value_end(text: str, pos: int) -> int | None:
    """End of the JSON value at `pos`, or None while it is unfinished (or not JSON)."""
    try:
        return DECODER.raw_decode(text, pos)[1]
    except json.JSONDecodeError:
        return None


def json_call(text: str, whole: bool) -> CallDraft | None:
    """A call written as one JSON object `{"name": ..., "arguments" | "parameters": {...}}`; `whole`: the object
    must be complete. Name first, the arguments stream as their raw text; another key order is read once the object
    is whole (its arguments re-serialized). None: malformed (whole), or nothing known yet."""
    head = _NAME_FIRST.match(text)
    start = len(text) - len(text.lstrip())
    end = json_value_end(text, start)
    if end is not None and not text[end:].strip():
        obj = json.loads(text)
        name = obj.get("name") if isinstance(obj, dict) else None
        args = obj.get("arguments", obj.get("parameters", {})) if isinstance(obj, dict) else None
        if not isinstance(name, str) or not name or not isinstance(args, dict):
            return None
        if head is None or head.group(2) not in obj:
            return CallDraft(name, json.dumps(args, ensure_ascii=False), complete=True)
        return CallDraft(name, text[head.end():json_value_end(text, head.end())], complete=True)
    if whole or head is None:
        return None
    rest = text[head.end():]
    if not rest.startswith("{"):
        return CallDraft(json.loads(f'"{head.group(1)}"'), "")
    args_end = json_value_end(rest, 0)  # the arguments may be whole before the object's closing comes
    return CallDraft(json.loads(f'"{head.group(1)}"'),
                     rest[:args_end] if args_end is not None else rest.rstrip("} \t\r\n"))


def skip_space(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in " \t\r\n":
        pos += 1
    return pos

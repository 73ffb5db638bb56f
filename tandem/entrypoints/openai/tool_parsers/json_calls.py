"""Calls written as JSON objects `{"name": ..., "arguments" | "parameters": {...}}`:

    hermes       (Qwen2.5/Qwen3, Hermes)  <tool_call>{"name": ..., "arguments": {...}}</tool_call>, one block per call
    llama3_json  (Llama 3.1+)             [<|python_tag|>]{"name": ..., "parameters": {...}}, calls joined by ";"
    required     (tool_choice "required") [{"name": ..., "parameters": {...}}, ...], as its grammar forces
    named        (a named function)       the arguments object alone, as its grammar forces
"""

from __future__ import annotations

from abc import abstractmethod
from typing import Any

from tandem.entrypoints.openai.tool_parsers.base import (
    CallDraft,
    Scan,
    ToolParser,
    content_before,
    json_call,
    json_value_end,
    skip_space,
)


class BlockParser(ToolParser):
    """Calls in BEGIN ... END blocks after the content, which ends at CONTENT_END (BEGIN unless the family wraps its
    calls); text between and after blocks is dropped. A last block cut before its END counts when its body is
    whole."""

    CONTENT_END = BEGIN = END = ""

    def find_calls(self, text: str, at: int) -> tuple[int, int | None]:
        return content_before(text, at, self.CONTENT_END or self.BEGIN)

    @abstractmethod
    def body(self, text: str, whole: bool) -> CallDraft | None:
        """One call from its block's body (None: malformed when whole, else nothing known yet)."""

    def scan_calls(self, text: str, at: int, final: bool) -> Scan:
        scan = Scan(resume=at)
        start = text.find(self.BEGIN, at)
        while start >= 0:
            body_start = start + len(self.BEGIN)
            end = text.find(self.END, body_start)
            whole = end >= 0 or final
            call = self.body(text[body_start:end if end >= 0 else len(text)], whole)
            if call is None:
                scan.malformed = whole
                return scan
            call.complete = whole
            scan.calls.append(call)
            if end < 0:
                return scan
            scan.resume, scan.skip = end + len(self.END), len(scan.calls)
            start = text.find(self.BEGIN, scan.resume)
        scan.malformed = final and not scan.calls
        return scan


class HermesParser(BlockParser):
    BEGIN, END = "<tool_call>", "</tool_call>"

    def body(self, text: str, whole: bool) -> CallDraft | None:
        return json_call(text, whole)


class JsonSequenceParser(ToolParser):
    """Calls as JSON objects one after another: `OPEN`, objects joined by `SEP`, `CLOSE`."""

    OPEN, SEP, CLOSE = "", ";", ""

    def find_calls(self, text: str, at: int) -> tuple[int, int | None]:
        if at:  # content was sent: the output is plain text
            return len(text), None
        body = text.lstrip()
        lead = self.lead(body)
        if lead is None:
            return len(text), None
        return 0, (len(text) - len(body) + lead if lead >= 0 else None)

    def lead(self, body: str) -> int | None:
        """Characters before the first object (-1: not known yet; None: the output is not calls)."""
        if not body or self.OPEN.startswith(body):
            return -1
        return len(self.OPEN) if body.startswith(self.OPEN) else None

    def scan_calls(self, text: str, at: int, final: bool) -> Scan:
        scan = Scan(resume=at)
        pos = skip_space(text, at)
        while pos < len(text):
            end = json_value_end(text, pos)
            call = json_call(text[pos:end if end is not None else len(text)], whole=end is not None or final)
            if call is None:
                scan.malformed = end is not None or final
                return scan
            call.complete = end is not None
            scan.calls.append(call)
            if end is None:
                return scan
            pos = skip_space(text, end)
            if text.startswith(self.SEP, pos):
                pos = skip_space(text, pos + len(self.SEP))
                scan.resume, scan.skip = pos, len(scan.calls)
                continue
            rest = text[pos:].rstrip()
            scan.malformed = (bool(rest) and rest != self.CLOSE) or (final and rest != self.CLOSE)
            return scan
        scan.malformed = final and (not scan.calls or bool(self.CLOSE))  # ended after OPEN or SEP
        return scan


class Llama3JsonParser(JsonSequenceParser):
    PYTHON_TAG = "<|python_tag|>"

    def lead(self, body: str) -> int | None:
        if body.startswith(self.PYTHON_TAG):
            return len(self.PYTHON_TAG)
        if self.PYTHON_TAG.startswith(body):
            return -1
        return 0 if body.startswith("{") else None


class RequiredParser(JsonSequenceParser):
    """tool_choice "required": the grammar forces a JSON list of calls."""

    OPEN, SEP, CLOSE = "[", ",", "]"


class NamedParser(ToolParser):
    """A named function: the grammar forces the arguments object; the name is the request's."""

    def __init__(self, tools: list[dict[str, Any]], name: str):
        super().__init__(tools)
        self.name = name

    def find_calls(self, text: str, at: int) -> tuple[int, int | None]:
        return 0, 0

    def scan_calls(self, text: str, at: int, final: bool) -> Scan:
        if not final:
            return Scan([CallDraft(self.name, text.rstrip())])
        end = json_value_end(text, len(text) - len(text.lstrip()))
        whole = end is not None and not text[end:].strip()
        return Scan([CallDraft(self.name, text, complete=True)], malformed=not whole)

"""Streamed tool calls in OpenAI's delta shape, as they form: the content before the calls, then per call a first
delta with `index`, `id`, `type` and the whole `name`, then `arguments` fragments; the official client (and any
that appends fragments by index) rebuilds the call the non-streamed response holds.

Each push re-reads the text from the first call not yet settled (the parser's `resume`), never from the start.
The final text is parsed whole; what it adds is sent with the finish reason. A call the model broke after its name
went out (cut by max_tokens, malformed JSON) cannot be taken back: the final chunk then carries the text not yet
sent as content and the request's own finish reason, as the non-streamed response does (content, no calls).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tandem.entrypoints.openai.tool_parsers import ToolParser
from tandem.entrypoints.openai.tool_parsers.base import CallDraft, ToolCall, new_call_id


@dataclass
class _SentCall:
    name: str
    arguments: str  # sent so far


class ToolStream:
    def __init__(self, parser: ToolParser):
        self.parser = parser
        self.text = ""
        self.num_content = 0  # characters of content sent
        self.calls_at: int | None = None  # where the calls begin, once they do
        self.resume = 0  # where the next scan starts
        self.num_settled = 0  # calls before `resume`
        self.sent: list[_SentCall] = []

    def push(self, new_text: str) -> dict[str, Any] | None:
        """The delta ({"content"?, "tool_calls"?}) that `new_text` settles, or None."""
        self.text += new_text
        delta: dict[str, Any] = {}
        if self.calls_at is None:
            content_end, self.calls_at = self.parser.find_calls(self.text, self.num_content)
            self._content(delta, self.text[self.num_content:content_end])
            if self.calls_at is None:
                return delta or None
            self.resume = self.calls_at
        scan = self.parser.scan_calls(self.text, self.resume, final=False)
        entries = [e for j, call in enumerate(scan.calls) if (e := self._entry(self.num_settled + j, call))]
        if entries:
            delta["tool_calls"] = entries
        self.resume, self.num_settled = scan.resume, self.num_settled + scan.skip
        return delta or None

    def finish(self, final_text: str, finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
        """The last delta of the whole output and the finish reason ("tool_calls" when it calls)."""
        content, calls = self.parser.parse(final_text)
        delta: dict[str, Any] = {}
        if calls and self._consistent(content, calls):
            self._content(delta, (content or "")[self.num_content:])
            entries = [e for i, c in enumerate(calls) if (e := self._entry(i, CallDraft(c.name, c.arguments)))]
            if entries:
                delta["tool_calls"] = entries
            return delta, "tool_calls"
        self._content(delta, final_text[self.num_content:])
        return delta, finish_reason

    def _consistent(self, content: str | None, calls: list[ToolCall]) -> bool:
        """What was streamed is a prefix of the parsed message."""
        if not (content or "").startswith(self.text[:self.num_content]) or len(self.sent) > len(calls):
            return False
        return all(c.name == s.name and c.arguments.startswith(s.arguments) for s, c in
                   zip(self.sent, calls[:len(self.sent)], strict=True))

    def _content(self, delta: dict[str, Any], text: str) -> None:
        if text:
            delta["content"] = text
            self.num_content += len(text)

    def _entry(self, index: int, call: CallDraft) -> dict[str, Any] | None:
        """The delta entry of call `index` given what is known of it, or None when nothing new is."""
        entry: dict[str, Any] = {"index": index}
        if index == len(self.sent):
            if not call.name:
                return None
            self.sent.append(_SentCall(call.name, ""))
            entry |= {"id": new_call_id(), "type": "function", "function": {"name": call.name}}
        sent = self.sent[index]
        new = call.arguments[len(sent.arguments):]
        if new:
            entry.setdefault("function", {})["arguments"] = new
            sent.arguments = call.arguments
        return entry if "function" in entry else None

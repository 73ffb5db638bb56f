"""Request checks of the OpenAI endpoints beyond the pydantic shapes: fields tandem does not implement, chat
messages, text that is not valid Unicode. Each failure is a 400 (404 for an unknown model) naming the field, the
value and what is allowed, as vLLM and OpenAI answer."""

from __future__ import annotations

import json
from typing import Any

from tandem.entrypoints.openai.serving import BadRequest


class NotFound(Exception):
    """An unknown model: 404, as OpenAI and vLLM answer."""


# field -> the values that mean "off", which are accepted (clients often send them explicitly)
_UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "functions": ([],),
    "function_call": ("none",), "logit_bias": ({},), "suffix": ("",), "best_of": (1,),
    "presence_penalty": (0, 0.0), "frequency_penalty": (0, 0.0), "repetition_penalty": (1, 1.0),
}
_ROLES = ("system", "user", "assistant", "tool")


def reject_unsupported(extra: dict[str, Any] | None) -> None:
    """A field that would change the answer but is not implemented is a 400, never silently ignored."""
    for name, value in (extra or {}).items():
        if name in _UNSUPPORTED and value is not None and value not in _UNSUPPORTED[name]:
            raise BadRequest(f"{name}={_short(value)} is not supported by tandem (allowed: omit it, null or "
                             f"{', '.join(repr(v) for v in _UNSUPPORTED[name])})")


def chat_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages as the chat template takes them: a role and a string content. A list of parts is joined (text
    parts only, "\\n" between them, as vLLM does); anything else is a 400 naming the message. An assistant turn may
    carry `tool_calls` (its content may then be null; arguments reach the template parsed, as vLLM passes them), a
    tool turn its `tool_call_id` and `name`."""
    if not messages:
        raise BadRequest("messages=[] is not allowed: at least one message")
    out = []
    for i, message in enumerate(messages):
        role = message.get("role")
        if role not in _ROLES:
            raise BadRequest(f"messages[{i}].role={_short(role)} is not allowed: one of {', '.join(_ROLES)}")
        calls = message.get("tool_calls") if role == "assistant" else None
        content = message.get("content")
        entry: dict[str, Any] = {"role": role, "content": "" if content is None and calls else _content(i, content)}
        if calls:
            entry["tool_calls"] = _tool_calls(i, calls)
        if role == "tool":
            entry |= {k: message[k] for k in ("tool_call_id", "name") if isinstance(message.get(k), str)}
        out.append(entry)
    return out


def _tool_calls(i: int, calls: Any) -> list[dict[str, Any]]:
    if not isinstance(calls, list) or not all(isinstance(c, dict) and isinstance(c.get("function"), dict)
                                              for c in calls):
        raise BadRequest(f"messages[{i}].tool_calls={_short(calls)} is invalid: a list of "
                         '{"type": "function", "function": {"name": ..., "arguments": "..."}}')
    out = []
    for call in calls:
        function = dict(call["function"])
        if isinstance(function.get("arguments"), str):
            try:
                function["arguments"] = json.loads(function["arguments"])
            except json.JSONDecodeError:
                pass  # the template gets the text as it was sent
        out.append({**call, "function": function})
    return out


def _content(i: int, content: Any) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise BadRequest(f"messages[{i}].content={_short(content)} is not allowed: a string or a list of text "
                         "parts")
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else part
            raise BadRequest(f"messages[{i}].content[{j}] of type {_short(kind)} is not supported: only "
                             '{"type": "text", "text": "..."} parts')
        texts.append(part["text"])
    return "\n".join(texts)


def check_unicode(value: Any, where: str = "body") -> None:
    """JSON may carry a lone surrogate ("\\ud800"), which no tokenizer or UTF-8 response can hold: a 400."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            raise BadRequest(f"{where} is not valid Unicode: a lone surrogate {value[e.start]!r} at character "
                             f"{e.start}") from None
    elif isinstance(value, dict):
        for key, item in value.items():
            check_unicode(key, f"{where} key")
            check_unicode(item, f"{where}.{key}" if where != "body" else key)
    elif isinstance(value, list):
        for j, item in enumerate(value):
            check_unicode(item, f"{where}[{j}]")


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."

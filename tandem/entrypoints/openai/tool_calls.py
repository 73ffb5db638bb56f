"""`tools` and `tool_choice` on chat completions (OpenAI's shapes, vLLM's rules): which calls a request allows, the
grammar that forces them, and the assistant message made of the output.

    none       the tools are shown to the template; the output is content
    auto       the model decides; `--tool-call-parser` reads its calls (needs `--enable-auto-tool-choice`)
    required   a grammar forces a JSON list of one or more calls, each {"name": <a listed tool>, "parameters": ...}
    {"type": "function", "function": {"name": N}}   a grammar forces N's arguments (its parameters schema)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tandem.entrypoints.openai.serving import BadRequest
from tandem.entrypoints.openai.tool_parsers import TOOL_PARSERS, NamedParser, Parsed, RequiredParser, ToolParser
from tandem.entrypoints.openai.tool_stream import ToolStream
from tandem.structured_output.params import GrammarError, StructuredOutputsParams


@dataclass(frozen=True)
class ToolServing:
    """The server's flags: `--enable-auto-tool-choice`, `--tool-call-parser NAME`."""

    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None


@dataclass
class ToolRequest:
    tools: list[dict[str, Any]]  # as the chat template takes them
    mode: str  # "auto" | "required" | "named"
    parser: ToolParser  # reads the calls out of the output (the forced modes' own, or --tool-call-parser's)
    name: str | None = None  # the named function

    def constraint(self) -> StructuredOutputsParams | None:
        """The grammar that forces the calls (required, named); None for auto."""
        functions = {t["function"]["name"]: t["function"].get("parameters") or {"type": "object"}
                     for t in self.tools}
        if self.mode == "named":
            schema: Any = functions[str(self.name)]
        elif self.mode == "required":
            schema = {"type": "array", "minItems": 1, "items": {"anyOf": [
                {"type": "object", "properties": {"name": {"type": "string", "enum": [name]}, "parameters": params},
                 "required": ["name", "parameters"], "additionalProperties": False}
                for name, params in functions.items()]}}
        else:
            return None
        try:
            return StructuredOutputsParams(json=schema)
        except GrammarError as e:
            raise BadRequest(f"tools: {e}") from None

    def parse(self, text: str) -> Parsed:
        return self.parser.parse(text)

    def stream(self) -> ToolStream:
        """The incremental reader of one streamed choice."""
        return ToolStream(self.parser)

    def message(self, text: str, finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
        """The assistant message of an output and its finish reason ("tool_calls" when it calls)."""
        content, calls = self.parse(text)
        if not calls:
            return {"role": "assistant", "content": content}, finish_reason
        return ({"role": "assistant", "content": content, "tool_calls": [c.to_openai() for c in calls]},
                "tool_calls")


def tool_request(tools: Any, tool_choice: Any, serving: ToolServing) -> ToolRequest | None:
    """What a request's tools and tool_choice ask for (None: no tool calls to read); BadRequest naming the field."""
    if not tools:
        if tool_choice not in (None, "none"):
            raise BadRequest(f"tool_choice={_short(tool_choice)} needs tools: list the functions it may call")
        return None
    _check_tools(tools)
    names = [t["function"]["name"] for t in tools]
    choice = "auto" if tool_choice is None else tool_choice
    if choice == "none":
        return None
    if choice == "auto":
        parser = TOOL_PARSERS.get(serving.tool_call_parser or "")
        if not serving.enable_auto_tool_choice or parser is None:
            raise BadRequest('tool_choice="auto" (the default with tools) needs the server started with '
                             "--enable-auto-tool-choice and --tool-call-parser; or send tool_choice "
                             '"required", "none" or a named function')
        return ToolRequest(tools, "auto", parser(tools))
    if choice == "required":
        return ToolRequest(tools, "required", RequiredParser(tools))
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) and \
        choice.get("type") == "function" and isinstance(choice.get("function"), dict) else None
    if name is None:
        raise BadRequest(f"tool_choice={_short(tool_choice)} is invalid: none, auto, required or "
                         '{"type": "function", "function": {"name": ...}}')
    if name not in names:
        raise BadRequest(f"tool_choice names function {name!r}, which is not in tools ({', '.join(names)})")
    return ToolRequest(tools, "named", NamedParser(tools, name), name)


def _check_tools(tools: Any) -> None:
    if not isinstance(tools, list):
        raise BadRequest(f"tools={_short(tools)} is invalid: a list of function tools")
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(function, dict) \
                or not isinstance(function.get("name"), str) or not function["name"]:
            raise BadRequest(f"tools[{i}]={_short(tool)} is invalid: "
                             '{"type": "function", "function": {"name": ..., "parameters": {...}}}')
        if not isinstance(function.get("parameters", {}), dict):
            raise BadRequest(f"tools[{i}].function.parameters is invalid: a JSON schema object")


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."

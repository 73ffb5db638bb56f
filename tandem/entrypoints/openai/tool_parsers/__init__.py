"""Tool-call parsers (`--tool-call-parser`): a model family's written tool calls -> OpenAI's `tool_calls`, the text
before them kept as content. A call that does not parse (malformed JSON, a missing name, a block cut short) leaves
the whole output as content: the client sees what the model wrote, never a 500. base.py: the interface; one file a
family (json_calls.py holds the JSON-object families and the forced modes)."""

from __future__ import annotations

from tandem.entrypoints.openai.tool_parsers.base import Parsed, ToolCall, ToolParser
from tandem.entrypoints.openai.tool_parsers.deepseek_v3 import DeepSeekV3Parser
from tandem.entrypoints.openai.tool_parsers.glm45 import Glm45Parser
from tandem.entrypoints.openai.tool_parsers.json_calls import (
    HermesParser,
    Llama3JsonParser,
    NamedParser,
    RequiredParser,
)

TOOL_PARSERS: dict[str, type[ToolParser]] = {"hermes": HermesParser, "llama3_json": Llama3JsonParser,
                                             "deepseek_v3": DeepSeekV3Parser, "glm45": Glm45Parser}

__all__ = ["TOOL_PARSERS", "NamedParser", "Parsed", "RequiredParser", "ToolCall", "ToolParser"]

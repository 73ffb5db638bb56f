"""What a request constrains its output to (vLLM's `StructuredOutputsParams`) and the canonical grammar text it
compiles from. Scope: checks that cost nothing (types, one constraint, sizes); compiling is compiler.py's.

A `GrammarSpec` is the small picklable key every rank compiles the same grammar from: the kind xgrammar compiles
("json", "json_object", "regex", "grammar", "structural_tag") and its text. `choice` becomes an EBNF grammar of
literal alternatives, so two requests with the same list share one compiled grammar.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

# sizes a request may ask for: bigger texts are refused before any compiler sees them (a 2,000-property schema
# takes xgrammar half a minute); the compile time limit (StructuredOutputsConfig) catches what slips under them
MAX_GRAMMAR_CHARS = 64 * 1024
MAX_JSON_DEPTH = 32  # xgrammar's schema converter takes ~1 s at depth 200 and recurses without bound past it
MAX_CHOICES = 1024
_FIELDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


class GrammarError(ValueError):
    """A constraint that cannot be compiled: its message names the field and the problem (a 400 on the server)."""


@dataclass(frozen=True)
class GrammarSpec:
    kind: str  # "json" | "json_object" | "regex" | "grammar" | "structural_tag"
    text: str  # the schema / regex / EBNF / structural tag as compiled ("" for json_object)


@dataclass
class StructuredOutputsParams:
    """Exactly one of the fields; `json` is a JSON schema (a dict or its text)."""

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # EBNF (xgrammar's GBNF dialect)
    json_object: bool | None = None  # any JSON object
    structural_tag: str | None = None  # xgrammar's structural tag, as JSON text

    def __post_init__(self) -> None:
        given = [name for name in _FIELDS if getattr(self, name) not in (None, False)]
        if len(given) != 1:
            raise GrammarError(f"structured_outputs sets {given or 'nothing'}: exactly one of {', '.join(_FIELDS)}")
        self.spec = _spec(given[0], getattr(self, given[0]))


def _spec(name: str, value: Any) -> GrammarSpec:
    if name == "json":
        text = value if isinstance(value, str) else _dump(value, "json")
        _check_json_schema(text)
        return GrammarSpec("json", text)
    if name == "json_object":
        if value is not True:
            raise GrammarError(f"structured_outputs.json_object={value!r} is invalid: true")
        return GrammarSpec("json_object", "")
    if name == "choice":
        return GrammarSpec("grammar", _choice_grammar(value))
    if name == "structural_tag" and not isinstance(value, str):
        value = _dump(value, "structural_tag")
    if not isinstance(value, str) or not value:
        raise GrammarError(f"structured_outputs.{name}={_short(value)} is invalid: a non-empty string")
    _check_size(name, value)
    return GrammarSpec(name, value)


def _dump(value: Any, name: str) -> str:
    try:
        return json.dumps(value)
    except (TypeError, ValueError, RecursionError) as e:
        raise GrammarError(f"structured_outputs.{name} is not valid JSON: {e}") from None


def _check_size(name: str, text: str) -> None:
    if len(text) > MAX_GRAMMAR_CHARS:
        raise GrammarError(f"structured_outputs.{name} has {len(text)} characters: at most {MAX_GRAMMAR_CHARS}")


def _check_json_schema(text: str) -> None:
    _check_size("json", text)
    try:
        schema = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as e:
        raise GrammarError(f"structured_outputs.json is not valid JSON: {e}") from None
    if not isinstance(schema, dict | bool):
        raise GrammarError(f"structured_outputs.json={_short(schema)} is invalid: a JSON schema (an object)")
    depth = _depth(schema)
    if depth > MAX_JSON_DEPTH:
        raise GrammarError(f"structured_outputs.json nests {depth} levels deep: at most {MAX_JSON_DEPTH}")


def _depth(value: Any) -> int:
    """Nesting depth of a JSON value, without recursion (json.loads already bounded the text's depth)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else ()
        deepest = max(deepest, depth)
        stack.extend((child, depth + 1) for child in children if isinstance(child, dict | list))
    return deepest


def _choice_grammar(choices: Any) -> str:
    if not isinstance(choices, list | tuple) or not choices or not all(isinstance(c, str) and c for c in choices):
        raise GrammarError(f"structured_outputs.choice={_short(choices)} is invalid: a non-empty list of "
                           "non-empty strings")
    if len(choices) > MAX_CHOICES:
        raise GrammarError(f"structured_outputs.choice has {len(choices)} entries: at most {MAX_CHOICES}")
    # json.dumps quotes and escapes a literal as EBNF's string syntax does ("\"", "\\", "\n")
    grammar = "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)
    _check_size("choice", grammar)
    return grammar


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."

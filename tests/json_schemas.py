"""Seeded random JSON schemas of varied features for structured-output tests: nested objects, arrays with
minItems/maxItems, enums, patterns, integer bounds, anyOf, $defs/$ref, optional and required fields.

Every schema has a bounded longest instance (strings carry maxLength, arrays maxItems, integers both bounds), so
even a random model under the grammar ends within a known number of tokens.
"""

from __future__ import annotations

import random
from typing import Any

PATTERNS = [r"^[a-z]{2,5}$", r"^\d{3}-\d{2}$", r"^(ab|cd){1,3}$", r"^[A-Z][a-z]{0,4}$"]
WORDS = ["alpha", "beta", "gamma", "delta", "red", "green", "blue", "north", "south", "yes", "no", "on", "off"]


def random_schema(seed: int, max_depth: int = 3) -> dict[str, Any]:
    rng = random.Random(seed)
    defs: dict[str, Any] = {}
    schema = _object(rng, max_depth, defs)
    if defs:
        schema["$defs"] = defs
    return schema


def _value(rng: random.Random, depth: int, defs: dict[str, Any]) -> dict[str, Any]:
    kinds = ["string", "enum", "integer", "boolean", "pattern", "const", "null"]
    if depth > 0:
        kinds += ["object", "array", "anyOf", "ref"]
    kind = rng.choice(kinds)
    if kind == "string":
        return {"type": "string", "maxLength": rng.randint(1, 12)} | (
            {"minLength": 1} if rng.random() < 0.5 else {})
    if kind == "enum":
        return {"enum": rng.sample(WORDS, rng.randint(1, 4))}
    if kind == "integer":
        low = rng.randint(-50, 50)
        return {"type": "integer", "minimum": low, "maximum": low + rng.randint(0, 500)}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "pattern":
        return {"type": "string", "pattern": rng.choice(PATTERNS)}
    if kind == "const":
        return {"const": rng.choice(WORDS)}
    if kind == "null":
        return {"type": "null"}
    if kind == "object":
        return _object(rng, depth - 1, defs)
    if kind == "array":
        low = rng.randint(0, 2)
        return {"type": "array", "items": _value(rng, depth - 1, defs), "minItems": low,
                "maxItems": low + rng.randint(0, 2)}
    if kind == "anyOf":
        return {"anyOf": [_value(rng, depth - 1, defs) for _ in range(rng.randint(2, 3))]}
    name = f"d{len(defs)}"
    defs[name] = {}  # the name is taken before the body is built: a nested $ref gets its own (no recursion)
    defs[name] = _object(rng, depth - 1, defs)
    return {"$ref": f"#/$defs/{name}"}


def _object(rng: random.Random, depth: int, defs: dict[str, Any]) -> dict[str, Any]:
    names = rng.sample(["id", "name", "kind", "tags", "size", "flag", "owner", "items", "meta", "note"],
                       rng.randint(1, 4))
    props = {n: _value(rng, depth, defs) for n in names}
    required = [n for n in names if rng.random() < 0.7]
    return {"type": "object", "properties": props, "required": required, "additionalProperties": False}

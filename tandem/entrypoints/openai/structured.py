"""The request fields that constrain output: OpenAI's `response_format` (json_object, json_schema) and vLLM's
`structured_outputs` ({json, regex, choice, grammar, json_object, structural_tag}), read into one
StructuredOutputsParams and compiled before the request reaches the engine: off the event loop, bounded in time,
and a 400 naming the problem when it cannot be."""

from __future__ import annotations

import asyncio
from typing import Any

from tandem.entrypoints.openai.serving import BadRequest
from tandem.sampling_params import SamplingParams
from tandem.structured_output.compiler import GrammarCompiler
from tandem.structured_output.params import GrammarError, StructuredOutputsParams

_FIELDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


def structured_outputs_of(response_format: Any, structured_outputs: Any) -> StructuredOutputsParams | None:
    """The constraint a request asks for (None: free text); BadRequest for a shape tandem cannot follow."""
    from_format = _response_format(response_format)
    if structured_outputs is None:
        return from_format
    if from_format is not None:
        raise BadRequest("response_format and structured_outputs are both set: use one of them")
    if not isinstance(structured_outputs, dict):
        raise BadRequest(f"structured_outputs={_short(structured_outputs)} is invalid: an object with one of "
                         f"{', '.join(_FIELDS)}")
    unknown = sorted(set(structured_outputs) - set(_FIELDS))
    if unknown:
        raise BadRequest(f"structured_outputs has unknown keys {unknown}: allowed keys are {list(_FIELDS)}")
    return _params(**{k: v for k, v in structured_outputs.items() if v is not None})


def _response_format(value: Any) -> StructuredOutputsParams | None:
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return _params(json_object=True)
    if kind == "json_schema":
        spec = value.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise BadRequest("response_format.json_schema.schema is missing: a JSON schema object "
                             '({"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}})')
        return _params(json=schema)
    raise BadRequest(f"response_format={_short(value)} is not supported: type text, json_object or json_schema")


def _params(**fields: Any) -> StructuredOutputsParams:
    try:
        return StructuredOutputsParams(**fields)
    except GrammarError as e:
        raise BadRequest(str(e)) from None


async def compile_before_submit(compiler: GrammarCompiler, params: SamplingParams) -> None:
    """Compile the request's grammar on a worker thread, so the engine's own compile is a cache hit and a grammar
    that is invalid or too slow to compile is the client's 400, never a stalled step."""
    if params.structured_outputs is None:
        return
    try:
        await asyncio.to_thread(compiler.compile, params.structured_outputs.spec)
    except GrammarError as e:
        raise BadRequest(str(e)) from None


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."

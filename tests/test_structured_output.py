"""Structured output offline, on each grammar backend (xgrammar, llguidance): outputs follow their grammar (seeded
random JSON schemas validated by `jsonschema`, choices, regexes, EBNF), greedy speculative decoding under a grammar
equals greedy without drafts (n-gram, MTP, PCP=2), hostile constraints fail fast naming the problem, compiled
grammars are cached, and a grammar that cannot finish within max_tokens ends with "length"."""

from __future__ import annotations

import json
import re
import time

import jsonschema
import pytest
from engine_utils import random_prompts
from json_schemas import random_schema

from tandem import LLM, SamplingParams, StructuredOutputsParams
from tandem.structured_output.params import MAX_CHOICES, GrammarError

BACKENDS = ("xgrammar", "llguidance")
NUM_SCHEMAS = 12
SUITE_SCHEMAS = 50  # must-show 1's suite


def _engine(backend: str) -> dict:
    return {"dtype": "float32", "max_num_batched_tokens": 64,
            "structured_outputs_config": {"backend": backend, "disable_any_whitespace": True}}


def _parse(text: str) -> object:
    # strict=False: xgrammar 0.2.9 lets a string with minLength/maxLength hold raw control characters (its counted
    # string rule is [^"\\\r\n]), which a random model picks; everything else about the text is strict JSON
    return json.loads(text, strict=False)


def _json(schema: dict, **kwargs) -> SamplingParams:
    return SamplingParams(max_tokens=400, structured_outputs=StructuredOutputsParams(json=schema), **kwargs)


@pytest.fixture(scope="module")
def dsv3(tiny_checkpoints):
    return tiny_checkpoints("deepseek_v3", num_mtp_layers=1)


@pytest.fixture(scope="module", params=BACKENDS)
def backend(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def llm(dsv3, backend):
    engine = LLM(str(dsv3), **_engine(backend))
    yield engine
    engine.shutdown()


def _metrics(llm: LLM) -> dict:
    return {m.name: getattr(m, "value", None) for m in llm.get_metrics()}


def _texts(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> list[tuple[str, str, list[int]]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [(o.outputs[0].text, o.outputs[0].finish_reason, o.outputs[0].token_ids) for o in outs]


def test_random_json_schemas_validate(llm):
    """A random model follows any schema: every output parses and validates, greedy and sampled."""
    schemas = [random_schema(seed) for seed in range(NUM_SCHEMAS)]
    prompts = random_prompts([5 + i for i in range(NUM_SCHEMAS)], vocab_size=500, seed=3)
    params = [_json(s, temperature=0 if i % 2 else 1.0, seed=i) for i, s in enumerate(schemas)]
    for i, (text, reason, _) in enumerate(_texts(llm, prompts, params)):
        assert reason == "stop", f"schema {i} ended with {reason}: {text!r}"
        jsonschema.validate(_parse(text), schemas[i])


def test_choice_regex_and_grammar_outputs_match(llm):
    choices = ["apple pie", "banana", 'quote " and \\ slash', "日本"]
    cases = [(StructuredOutputsParams(choice=choices), lambda t: t in choices),
             (StructuredOutputsParams(regex=r"[a-c]{2,4}-\d{1,3}"), re.compile(r"[a-c]{2,4}-\d{1,3}").fullmatch),
             (StructuredOutputsParams(grammar='root ::= "(" item ("," item)* ")"\nitem ::= [0-9] | "x"'),
              re.compile(r"\(([0-9x])(,[0-9x])*\)").fullmatch)]
    prompts = random_prompts([7] * 6, vocab_size=500, seed=5)
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=300, structured_outputs=c)
              for s, (c, _) in enumerate(cases * 2)]
    for (text, reason, _), (_, check) in zip(_texts(llm, prompts, params), cases * 2, strict=True):
        assert reason == "stop" and check(text), f"{text!r} ({reason}) breaks its constraint"


def test_ended_grammar_stops_under_ignore_eos_and_min_tokens(llm):
    """A grammar that has ended allows only EOS, and that EOS ends the request with "stop" even under ignore_eos and
    min_tokens (vLLM instead lifts the mask once the grammar ends and lets such a request run on unconstrained to
    max_tokens): the output is the grammar's, never text after it. Greedy and sampled, a literal and a regex that may
    stop after 2 characters or go on to 4."""
    cases = [(StructuredOutputsParams(choice=["yes", "no"]), lambda t: t in ("yes", "no")),
             (StructuredOutputsParams(regex=r"[a-c]{2,4}"), re.compile(r"[a-c]{2,4}").fullmatch)]
    prompts = random_prompts([6] * 4, vocab_size=500, seed=4)
    params = [SamplingParams(temperature=t, seed=3, max_tokens=40, min_tokens=20, ignore_eos=True,
                             structured_outputs=c) for t in (0, 1.0) for c, _ in cases]
    for (text, reason, tokens), (_, check) in zip(_texts(llm, prompts, params), cases * 2, strict=True):
        assert reason == "stop" and check(text), f"{text!r} ended with {reason} after {len(tokens)} tokens"
        assert len(tokens) < 20, "min_tokens must not hold a request past the end of its grammar"


def test_json_object_is_an_object(llm):
    """OpenAI's json_object: an object, never a top-level array or scalar (a random model may not close it)."""
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=40,
                             structured_outputs=StructuredOutputsParams(json_object=True)) for s in range(4)]
    for text, reason, _ in _texts(llm, random_prompts([6] * 4, vocab_size=500, seed=6), params):
        assert text.startswith("{"), text
        if reason == "stop":
            assert isinstance(_parse(text), dict)


@pytest.mark.parametrize("spec", [
    {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3},
    {"method": "mtp", "num_speculative_tokens": 3},
], ids=["ngram-k3", "mtp-k3"])
def test_greedy_speculative_equals_non_speculative_under_grammar(dsv3, backend, llm, spec):
    """Every draft row gets the mask of the state after the drafts before it, and rejected drafts leave the
    matcher where the accepted tokens put it: greedy tokens equal those without drafts."""
    schemas = [random_schema(100 + i) for i in range(6)]
    prompts = random_prompts([9, 14, 21, 30, 6, 11], vocab_size=500, seed=8)
    params = [_json(s, temperature=0) for s in schemas]
    reference = _texts(llm, prompts, params)
    spec_llm = LLM(str(dsv3), **_engine(backend), speculative_config=spec)
    try:
        got = _texts(spec_llm, prompts, params)
        # sampled: a draft the grammar forbids has p = 0 under the mask, so it is never accepted
        sampled = _texts(spec_llm, prompts, [_json(s, temperature=1.0, seed=i) for i, s in enumerate(schemas)])
        metrics = _metrics(spec_llm)
    finally:
        spec_llm.shutdown()
    for i, (text, reason, _) in enumerate(sampled):
        assert reason == "stop", f"{spec['method']} sampled: schema {i} ended with {reason}"
        jsonschema.validate(_parse(text), schemas[i])
    for i, (out, ref) in enumerate(zip(got, reference, strict=True)):
        assert out[2] == ref[2], f"{spec['method']}: schema {i} diverged from non-speculative greedy"
        jsonschema.validate(_parse(out[0]), schemas[i])
    assert metrics["tandem:spec_decode_num_draft_tokens"] > 0
    if spec["method"] == "ngram":  # JSON repeats itself: some drafts must pass the grammar and the target
        assert metrics["tandem:spec_decode_num_accepted_tokens"] > 0


@pytest.mark.parametrize("draft_backend", ["PAGED_MLA", "CONTIGUOUS_MLA"], ids=["sharded-draft", "replicated-draft"])
def test_pcp2_mtp_under_grammar_equals_single_rank_no_spec(dsv3, backend, llm, draft_backend):
    """Masks are computed on every rank from the same emitted tokens: PCP=2 with MTP K=3 samples the same tokens
    as one rank without drafts (and long prompts are split over the ranks), with the drafter sharded like the
    target (a PCP-capable backend) or replicated (one that is not)."""
    schemas = [random_schema(200 + i) for i in range(3)]
    prompts = random_prompts([70, 9, 40], vocab_size=500, seed=9)
    params = [_json(s, temperature=0) for s in schemas]
    reference = _texts(llm, prompts, params)
    pcp = LLM(str(dsv3), **_engine(backend), prefill_context_parallel_size=2,
              speculative_config={"method": "mtp", "num_speculative_tokens": 3, "attention_backend": draft_backend})
    try:
        assert pcp.draft_mode == ("sharded" if draft_backend == "PAGED_MLA" else "replicated"), pcp.draft_mode
        got = _texts(pcp, prompts, params)
    finally:
        pcp.shutdown()
    assert [g[2] for g in got] == [r[2] for r in reference], "PCP=2 + MTP under a grammar != single rank"


@pytest.mark.parametrize("make,problem", [
    (lambda: StructuredOutputsParams(choice=[f"c{i}" for i in range(100_000)]), "at most"),
    (lambda: StructuredOutputsParams(json={"type": "string", "description": "x" * 100_000}), "characters"),
    (lambda: StructuredOutputsParams(json=_nested(100)), "levels deep"),
    (lambda: StructuredOutputsParams(json="{not json"), "not valid JSON"),
    (lambda: StructuredOutputsParams(json={"type": "object"}, regex="a"), "exactly one"),
    (lambda: StructuredOutputsParams(), "exactly one"),
    (lambda: StructuredOutputsParams(choice=[]), "non-empty list"),
])
def test_hostile_constraints_refused_at_construction(make, problem):
    with pytest.raises(GrammarError, match=problem):
        make()


# (constraint, {backend: what its error names}); a backend left out compiles the constraint
INVALID = [
    (StructuredOutputsParams(regex="(abc"), {"xgrammar": "parenthesis", "llguidance": "unclosed group"}),
    (StructuredOutputsParams(grammar="root ::= undefined_rule"),
     {"xgrammar": "not defined", "llguidance": "'undefined_rule' not found"}),
    (StructuredOutputsParams(json={"type": "florp"}), {"xgrammar": "florp", "llguidance": "florp"}),
    (StructuredOutputsParams(json={"$ref": "#"}), {"xgrammar": "Circular"}),  # llguidance: an empty grammar
    (StructuredOutputsParams(json={"$ref": "#/$defs/missing"}),
     {"xgrammar": "missing|\\$defs", "llguidance": "missing|\\$defs"}),
    (StructuredOutputsParams(structural_tag=json.dumps({"type": "structural_tag", "format": {
        "type": "const_string", "value": "x"}})), {"llguidance": "not supported by the llguidance backend"}),
]


@pytest.mark.parametrize("constraint,problems", INVALID, ids=range(len(INVALID)))
def test_invalid_grammar_fails_its_request_and_engine_stays_usable(llm, backend, constraint, problems):
    start = time.monotonic()
    prompt, params = [{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=3, structured_outputs=constraint)
    if backend not in problems:
        llm.generate(prompt, params, use_tqdm=False)  # this backend follows the constraint
        return
    with pytest.raises(GrammarError, match=problems[backend]):
        llm.generate(prompt, params, use_tqdm=False)
    assert time.monotonic() - start < 10
    ok = llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
    assert len(ok[0].outputs[0].token_ids) == 3


def test_compile_time_limit(dsv3):
    """A schema that takes xgrammar long to compile is refused after compile_timeout_s, not waited on."""
    wide = {"type": "object", "properties": {f"p{i}": {"enum": [f"v{j}" for j in range(20)]} for i in range(300)}}
    engine = LLM(str(dsv3), dtype="float32", structured_outputs_config={"compile_timeout_s": 0.01})
    try:
        start = time.monotonic()
        with pytest.raises(GrammarError, match="did not compile within"):
            engine.generate([{"prompt_token_ids": [5, 6]}], _json(wide), use_tqdm=False)
        assert time.monotonic() - start < 5
    finally:
        engine.shutdown()


def test_second_request_with_same_grammar_hits_the_cache(llm):
    schema = {"type": "object", "properties": {"cache": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["cache"], "additionalProperties": False}
    # the compiler is the process's (engines of one model share it): counted from a first constrained request on
    _texts(llm, [[5, 6]], [SamplingParams(max_tokens=2, structured_outputs=StructuredOutputsParams(regex="a+"))])
    before = _metrics(llm)
    for _ in range(2):
        _texts(llm, [[5, 6, 7]], [_json(schema, temperature=0)])
    after = _metrics(llm)
    assert after["tandem:grammar_compiles"] - before.get("tandem:grammar_compiles", 0) == 1
    assert after["tandem:grammar_compile_cache_hits"] - before.get("tandem:grammar_compile_cache_hits", 0) >= 1
    assert after["tandem:grammar_mask_seconds"] > 0


def test_grammar_that_cannot_finish_ends_with_length(llm, backend):
    """A schema whose every instance is longer than max_tokens runs until max_tokens: an array of at least 100 items,
    and one whose every instance is infinite, a required self-reference (xgrammar follows it; llguidance refuses it
    at compile: its forced-token expansion would fail at the first token)."""
    long_array = {"type": "array", "items": {"enum": [1, 2]}, "minItems": 100}
    endless = {"$ref": "#/$defs/n", "$defs": {"n": {"type": "object", "properties": {"c": {"$ref": "#/$defs/n"}},
                                                    "required": ["c"], "additionalProperties": False}}}
    for schema, start in [(long_array, "["), (endless, '{"c":{"c":')]:
        params = SamplingParams(temperature=0, max_tokens=25, structured_outputs=StructuredOutputsParams(json=schema))
        if backend == "llguidance" and schema is endless:
            with pytest.raises(GrammarError, match="forces more than 4096 characters"):
                _texts(llm, [[5, 6, 7]], [params])
            continue
        text, reason, tokens = _texts(llm, [[5, 6, 7]], [params])[0]
        assert reason == "length" and len(tokens) == 25, f"{reason} after {len(tokens)} tokens: {text!r}"
        assert text.replace(" ", "").startswith(start), text  # llguidance's compact JSON has no spaces


def test_choice_limit_is_exact():
    StructuredOutputsParams(choice=[f"c{i}" for i in range(MAX_CHOICES)])
    with pytest.raises(GrammarError):
        StructuredOutputsParams(choice=[f"c{i}" for i in range(MAX_CHOICES + 1)])


def _nested(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


def test_bundled_model_schema_suite_pcp2_mtp_k3_equals_no_spec():
    """Must-show 1's second half: the schema suite on the bundled model (its own MTP layer) with MTP K = 3 at
    PCP = 2 gives the tokens of one rank without drafts, greedy. Compact JSON: with free whitespace the bundled
    model writes blank lines until max_tokens."""
    from tandem.assets import DEFAULT_MODEL

    schemas = [random_schema(i) for i in range(SUITE_SCHEMAS)]  # benchmarks/structured_output.py's 50 seeds
    prompts = [f"Write a JSON record number {i}." for i in range(SUITE_SCHEMAS)]
    params = [_json(s, temperature=0) for s in schemas]
    outputs = []
    for kwargs in ({}, {"prefill_context_parallel_size": 2,
                        "speculative_config": {"method": "mtp", "num_speculative_tokens": 3}}):
        engine = LLM(str(DEFAULT_MODEL), dtype="float32", max_model_len=1024,
                     structured_outputs_config={"disable_any_whitespace": True}, **kwargs)
        try:
            outputs.append([o.outputs[0] for o in engine.generate(prompts, params, use_tqdm=False)])
        finally:
            engine.shutdown()
    reference, spec = outputs
    for i, (ref, out) in enumerate(zip(reference, spec, strict=True)):
        assert out.token_ids == ref.token_ids, f"schema {i}: PCP=2 + MTP K=3 diverged from no-spec"
        if ref.finish_reason == "stop":
            jsonschema.validate(_parse(ref.text), schemas[i])
    assert sum(o.finish_reason == "stop" for o in reference) >= SUITE_SCHEMAS // 2, [o.text for o in reference]


def test_backend_is_one_of_the_implemented(dsv3):
    """vLLM's `guidance` names llguidance; anything else is refused naming the field and what is allowed."""
    from tandem.config import ConfigError
    from tandem.entrypoints.engine_args import EngineArgs
    from tandem.structured_output.backend import make_backend
    from tandem.structured_output.llguidance_backend import LLGuidanceBackend

    config = EngineArgs(model=str(dsv3), structured_outputs_config={"backend": "guidance"}).create_engine_config()
    assert isinstance(make_backend(str(dsv3), 2048, config.structured_outputs_config), LLGuidanceBackend)
    with pytest.raises(ConfigError, match="backend.*outlines.*xgrammar, guidance, llguidance"):
        EngineArgs(model=str(dsv3), structured_outputs_config={"backend": "outlines"}).create_engine_config()

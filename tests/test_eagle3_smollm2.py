"""The bundled EAGLE-3 head on the real SmolLM2-135M-Instruct: greedy drafting is lossless (single rank at K = 1..4
and "auto", compiled, PCP=2 with the sharded and the replicated draft mode, owner-sharded KV) and the head is
accepted on held-out prompts of both kinds it was trained for (GSM8K test in chat format, everyday
instructions)."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest

from tandem import LLM, SamplingParams
from tandem.assets import SMOLLM2_EAGLE3
from tandem.data.everyday import load_everyday
from tandem.data.gsm8k import SHARED_GSM8K, load_jsonl
from tandem.entrypoints.openai.chat_template import ChatTemplate

pytestmark = pytest.mark.slow
ENGINE = {"dtype": "float32", "max_model_len": 1024, "max_num_batched_tokens": 256}
GREEDY = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)


@functools.lru_cache(maxsize=1)
def _prompts(model: Path) -> tuple[str, ...]:
    """Two held-out GSM8K test questions and two everyday instructions, as user turns of the chat template."""
    template = ChatTemplate(str(model))
    questions = [p.question for p in load_jsonl(SHARED_GSM8K / "test.jsonl")[:2]] + load_everyday()[:2]
    return tuple(template.render([{"role": "user", "content": q}]) for q in questions)


def _run(model: Path, spec: dict | None, **kwargs) -> tuple[list[list[int]], dict]:
    llm = LLM(str(model), **ENGINE, speculative_config=spec, **kwargs)
    try:
        outs = llm.generate(list(_prompts(model)), GREEDY, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs], {m.name: getattr(m, "value", None) for m in llm.get_metrics()}
    finally:
        llm.shutdown()


@functools.lru_cache(maxsize=1)
def _no_spec(model: Path) -> list[list[int]]:
    return _run(model, None)[0]


def _eagle3(k: int | str, **extra) -> dict:
    spec = {"method": "eagle3", "model": str(SMOLLM2_EAGLE3), "num_speculative_tokens": k, **extra}
    return spec | ({"max_num_speculative_tokens": 4} if k == "auto" else {})


@pytest.mark.parametrize("k", [1, 2, 3, 4, "auto"])
def test_bundled_head_is_lossless_and_accepted(smollm2, k):
    tokens, metrics = _run(smollm2, _eagle3(k))
    assert tokens == _no_spec(smollm2)
    drafts = metrics["tandem:spec_decode_num_drafts"]
    assert drafts > 0, f"K={k} drafted nothing on four prompts (\"auto\" found no K that pays on this machine now)"
    length = 1 + metrics["tandem:spec_decode_num_accepted_tokens"] / drafts
    # a useless head reads ~1.0; the bundled one read 1.51 / 1.59 / 1.61 at K = 2 / 3 / 4 on these four prompts
    # (docs/eagle3.md's figures), "auto" 1.38 (it drafts less where drafts are rejected)
    assert length > (1.4 if isinstance(k, int) and k >= 2 else 1.2), f"mean acceptance length {length:.2f} at K={k}"


@pytest.mark.parametrize("options", [
    {"pcp": 2, "backend": "PAGED_SDPA"},
    {"pcp": 2, "backend": "CONTIGUOUS_SDPA"},
    {"pcp": 2, "backend": "PAGED_SDPA", "pcp_kv_layout": "sharded"},
    {"pcp": 1, "compilation_config": {"mode": "VLLM_COMPILE", "cudagraph_mode": "PIECEWISE",
                                      "cudagraph_capture_sizes": [1, 2, 4, 8, 16]}},
], ids=["pcp2-sharded-draft", "pcp2-replicated-draft", "pcp2-sharded-kv", "compiled"])
def test_bundled_head_is_lossless_across_layouts(smollm2, options):
    options = dict(options)
    spec = _eagle3(3, **({"attention_backend": options.pop("backend")} if "backend" in options else {}))
    tokens, _ = _run(smollm2, spec, prefill_context_parallel_size=options.pop("pcp"), **options)
    assert tokens == _no_spec(smollm2)

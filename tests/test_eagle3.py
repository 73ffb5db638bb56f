"""EAGLE-3 heads end to end on tiny Llama and Qwen3 targets: drafts equal a plain re-computation every step, greedy
output equals non-speculative greedy (K = 1..4, "auto", reduced draft vocabularies, compiled), probabilistic drafts
keep their mass on the draft vocabulary, and heads that do not fit their target fail naming the field."""

from __future__ import annotations

import collections
import functools
import json
from pathlib import Path

import pytest
import torch
from eagle3_checkpoint import build_eagle3_head
from eagle3_reference import PlainEagle3
from engine_utils import assert_drafts_keep_greedy_under_grammars, random_prompts, record_steps
from json_schemas import random_schema

from tandem import LLM, SamplingParams
from tandem.config import ConfigError
from tandem.engine.spec_policy import SpecPolicy
from tandem.models.loader import WeightLoadError

# The first prompt exceeds the 32-token budget alone, so step 1 is a prompt chunk that samples nothing: its
# tokens must still reach the head's own KV cache.
LENGTHS = [45, 3, 9, 20, 5, 12, 17, 25]
ENGINE = {"dtype": "float32", "max_num_batched_tokens": 32}
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
# tiny targets have 2 layers: the default ids (2, L // 2, L - 3) do not exist, so the heads read these
AUX_IDS = [0, 1, 2]


def _prompts() -> list[list[int]]:
    return random_prompts(LENGTHS, vocab_size=500, seed=13)


def _generate(path: Path, prompts: list[list[int]], params: SamplingParams | list[SamplingParams] = GREEDY,
              **kwargs) -> tuple[LLM, list[list[int]]]:
    llm = LLM(str(path), **ENGINE, **kwargs)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return llm, [o.outputs[0].token_ids for o in outs]


def _eagle3(head: Path, k: int | str, **extra) -> dict:
    spec = {"method": "eagle3", "model": str(head), "num_speculative_tokens": k, **extra}
    return spec | ({"max_num_speculative_tokens": 4} if k == "auto" else {})


def _metrics(llm: LLM) -> dict:
    return {m.name: getattr(m, "value", None) for m in llm.get_metrics()}


@functools.lru_cache(maxsize=4)
def _baseline(path: Path) -> list[list[int]]:
    return _generate(path, _prompts())[1]


@pytest.fixture(scope="module")
def pair(tiny_checkpoints, tmp_path_factory):
    """arch -> (target, head). The head's draft vocabulary is the 8 ids the target emits most on the test prompts
    (so a random head's drafts are sometimes accepted), mapped by d2t; "llama4" is a 4-layer target whose head
    reads the default aux layers and drafts over the full vocabulary."""
    built: dict[str, tuple[Path, Path]] = {}

    def get(arch: str) -> tuple[Path, Path]:
        if arch not in built:
            if arch == "llama4":
                target = tiny_checkpoints("llama", overrides={"num_hidden_layers": 4})
                head = build_eagle3_head(target, tmp_path_factory.mktemp("eagle3-llama4"))
            else:
                target = tiny_checkpoints(arch)
                counts = collections.Counter(t for out in _baseline(target) for t in out)
                head = build_eagle3_head(target, tmp_path_factory.mktemp(f"eagle3-{arch}"), aux_layer_ids=AUX_IDS,
                                         draft_token_ids=[t for t, _ in counts.most_common(8)])
            built[arch] = (target, head)
        return built[arch]

    return get


class _Scripted(SpecPolicy):
    """"auto" with K from a fixed schedule: K = 0 steps defer the head's step 0, the next drafting step catches up."""

    SCHEDULE = (3, 0, 0, 2, 0, 1, 0, 0, 0, 3)

    def __init__(self, max_k: int):
        super().__init__(max_k)
        self.calls = 0

    def choose(self, num_rows: int) -> int:
        self.calls += 1
        return self.SCHEDULE[(self.calls - 1) % len(self.SCHEDULE)]


@pytest.mark.parametrize("arch,k", [("llama", 3), ("qwen3", 3), ("llama4", 3), ("llama", "auto")])
def test_drafts_equal_plain_recomputation_every_step(pair, arch, k, monkeypatch):
    """Every step's drafts equal the head recomputed from scratch for its context; with "auto" on a K schedule
    whose K = 0 steps defer the head's step 0, the drafts right after them too (the catch-up left nothing out)."""
    target, head = pair(arch)
    prompts = _prompts()[:4]
    monkeypatch.setattr("tandem.engine.llm_engine.SpecPolicy", _Scripted)
    llm = LLM(str(target), **ENGINE, speculative_config=_eagle3(head, k))
    steps = record_steps(llm, monkeypatch)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=16,
                        ignore_eos=True), use_tqdm=False)
    full = {o.request_id: o.prompt_token_ids + o.outputs[0].token_ids for o in outs}
    num_emitted = {rid: 0 for rid in full}
    reference = PlainEagle3(target, head)
    checked = after_zero = 0
    previous_k = None
    for plan, out in steps:
        sampling_rows = [r for r in plan.rows if r.sampling is not None]
        for row, emitted, drafts in zip(sampling_rows, out.sampled_token_ids, out.draft_token_ids, strict=True):
            rid = row.request_id
            num_emitted[rid] += len(emitted)
            context = full[rid][: len(prompts[int(rid)]) + num_emitted[rid]]
            if len(context) < len(full[rid]) and plan.num_spec_tokens:  # the last step drafts past max_tokens
                assert drafts == reference.drafts(context, plan.num_spec_tokens), \
                    f"{arch} request {rid} after {len(context)} tokens"
                checked += 1
                after_zero += previous_k == 0
        previous_k = plan.num_spec_tokens
    assert checked >= 4 * 3, f"only {checked} request-steps checked"
    if k == "auto":
        metrics = _metrics(llm)
        assert after_zero >= 4 and metrics["tandem:spec_decode_eagle3_caught_up_tokens"] > 0, (after_zero, metrics)


@pytest.mark.parametrize("k", [1, 2, 4])
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_greedy_eagle3_equals_non_speculative(pair, arch, k):
    target, head = pair(arch)
    llm, outs = _generate(target, _prompts(), speculative_config=_eagle3(head, k))
    assert outs == _baseline(target)
    m = _metrics(llm)
    assert m["tandem:spec_decode_num_draft_tokens"] > 0
    assert m["tandem:spec_decode_num_accepted_tokens"] > 0, "no draft was accepted: the accept path is untested"


@pytest.mark.parametrize("options", [
    {"k": "auto"},
    {"k": 3, "compilation_config": {"mode": "VLLM_COMPILE", "cudagraph_mode": "PIECEWISE",
                                    "cudagraph_capture_sizes": [1, 2, 4, 8, 16, 32]}},
    {"k": 2, "enable_prefix_caching": False, "max_num_seqs": 3},
], ids=["auto", "compiled-piecewise", "few-seqs"])
def test_greedy_eagle3_equals_non_speculative_across_engine_modes(pair, options):
    target, head = pair("llama")
    options = dict(options)
    k = options.pop("k")
    _, outs = _generate(target, _prompts(), speculative_config=_eagle3(head, k), **options)
    assert outs == _baseline(target)


@pytest.mark.parametrize("options", [{}, {"compilation_config": {
    "mode": "VLLM_COMPILE", "cudagraph_mode": "PIECEWISE", "cudagraph_capture_sizes": [1, 2, 4, 8, 16, 32]}}],
    ids=["eager", "compiled-piecewise"])
def test_bfloat16_head_under_a_float32_target_stays_exact(pair, options):
    """draft_dtype "bfloat16": the head computes and caches in bf16 under a float32 target; greedy output is still
    exactly non-speculative greedy, and its drafts are still accepted."""
    target, head = pair("llama")
    llm, outs = _generate(target, _prompts(), speculative_config=_eagle3(head, 3, draft_dtype="bfloat16"), **options)
    assert outs == _baseline(target)
    assert _metrics(llm)["tandem:spec_decode_num_accepted_tokens"] > 0


def test_prefix_cache_hits_keep_greedy_exact(pair):
    """A cached block's head KV was computed from the token after the block: hits must not change drafts' context."""
    target, head = pair("qwen3")
    shared = _prompts()[0][:40]
    prompts = [shared + p for p in _prompts()[1:5]]
    _, plain = _generate(target, prompts, enable_prefix_caching=False)
    llm = LLM(str(target), **ENGINE, speculative_config=_eagle3(head, 3))
    outs = [llm.generate([{"prompt_token_ids": p}], GREEDY, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    assert outs == plain
    assert _metrics(llm)["tandem:prefix_cache_hits"] > 0


def test_probabilistic_drafts_stay_on_the_draft_vocabulary(pair):
    target, head = pair("llama")
    spec = _eagle3(head, 3, draft_sample_method="probabilistic")
    sampled = SamplingParams(temperature=0.8, max_tokens=12, seed=7, ignore_eos=True)
    llm, outs = _generate(target, _prompts()[:4], [sampled, GREEDY, sampled, GREEDY], speculative_config=spec)
    for i in (1, 3):  # greedy requests verify against sampled drafts with their q: the output must not move
        assert outs[i] == _baseline(target)[i], f"greedy prompt {i} changed"
    runner = llm.engine.executor.runner
    vocab = json.loads((head / "config.json").read_text())["vocab_size"]
    on_vocab = torch.zeros(vocab, dtype=torch.bool)
    on_vocab[runner.proposer.head.draft_to_target] = True
    for q in runner.draft_probs.values():  # [K, V] each: the last proposal's draft distributions
        assert q[:, ~on_vocab].abs().max() == 0 and torch.allclose(q.sum(-1), torch.ones(q.shape[0]))


def _bad_head(target: Path, tmp_path: Path, **kwargs) -> Path:
    return build_eagle3_head(target, tmp_path / "head", aux_layer_ids=kwargs.pop("aux", AUX_IDS), **kwargs)


@pytest.mark.parametrize("case,match", [
    ({"overrides": {"target_hidden_size": 48}}, "target_hidden_size=48 does not match"),
    ({"overrides": {"vocab_size": 1000}}, "vocab_size=1000 does not match"),
    ({"aux": [0, 1, 7]}, r"eagle_aux_hidden_state_layer_ids=\[0, 1, 7\] is not allowed"),
    ({"overrides": {"architectures": ["LlamaForCausalLM"]}}, "architectures="),
    ({"overrides": {"num_hidden_layers": 2}}, "num_hidden_layers=2 is not allowed"),
    ({"overrides": {"num_key_value_heads": 3}}, "num_key_value_heads=3 is not allowed"),
    ({"overrides": {"norm_before_fc": True}}, "norm_before_fc=true is not supported"),
    ({"overrides": {"eagle_config": {"use_aux_hidden_state": False}}}, "use_aux_hidden_state=False"),
])
def test_head_that_does_not_fit_its_target_is_named(tiny_checkpoints, tmp_path, case, match):
    target = tiny_checkpoints("llama")
    head = _bad_head(target, tmp_path, **case)
    with pytest.raises(ConfigError, match=match):
        LLM(str(target), **ENGINE, speculative_config=_eagle3(head, 2))


@pytest.mark.parametrize("case,match", [
    ({"draft_token_ids": [3, 5, 7], "drop": ("d2t",)}, "d2t is missing"),
    ({"drop": ("fc.weight",)}, "missing from the checkpoint: fc.weight"),
])
def test_head_with_bad_tensors_is_named(tiny_checkpoints, tmp_path, case, match):
    target = tiny_checkpoints("llama")
    head = _bad_head(target, tmp_path, **case)
    with pytest.raises(WeightLoadError, match=match):
        LLM(str(target), **ENGINE, speculative_config=_eagle3(head, 2))


def test_d2t_outside_the_target_vocabulary_is_named(tiny_checkpoints, tmp_path):
    from safetensors.torch import load_file, save_file

    target = tiny_checkpoints("llama")
    head = _bad_head(target, tmp_path, draft_token_ids=[3, 5, 7])
    tensors = load_file(str(head / "model.safetensors"))
    tensors["d2t"] = torch.tensor([3, 4, 600])  # draft id 2 -> target id 602 of 512
    save_file(tensors, str(head / "model.safetensors"))
    with pytest.raises(WeightLoadError, match="d2t maps draft id 2 to target id 602, outside"):
        LLM(str(target), **ENGINE, speculative_config=_eagle3(head, 2))


def test_draft_dtype_is_checked(pair):
    target, head = pair("llama")
    with pytest.raises(ConfigError, match="speculative_config.draft_dtype='float16' is not allowed: one of auto, "
                                          "float32, bfloat16"):
        LLM(str(target), **ENGINE, speculative_config=_eagle3(head, 2, draft_dtype="float16"))
    with pytest.raises(ConfigError, match="speculative_config.draft_dtype='bfloat16' is not allowed: 'auto' with "
                                          "method 'ngram'"):
        LLM(str(target), **ENGINE, speculative_config={"method": "ngram", "num_speculative_tokens": 2,
                                                       "draft_dtype": "bfloat16"})


def test_eagle3_needs_a_head_folder_and_a_supported_target(tiny_checkpoints, tmp_path):
    with pytest.raises(ConfigError, match="speculative_config.model"):
        LLM(str(tiny_checkpoints("llama")), **ENGINE, speculative_config={"method": "eagle3",
                                                                          "num_speculative_tokens": 2})
    head = _bad_head(tiny_checkpoints("llama"), tmp_path)
    with pytest.raises(ConfigError, match="not supported for DeepseekV3ForCausalLM"):
        LLM(str(tiny_checkpoints("deepseek_v3")), **ENGINE, speculative_config=_eagle3(head, 2))


@pytest.mark.parametrize("backend", ["xgrammar", "llguidance"])
def test_greedy_eagle3_under_a_grammar_equals_non_speculative(pair, backend):
    """Structured output with an EAGLE-3 drafter: greedy tokens equal those without drafts under JSON schemas."""
    target, head = pair("llama4")
    assert_drafts_keep_greedy_under_grammars(target, _prompts()[:4], [random_schema(200 + i) for i in range(4)],
                                             backend, _eagle3(head, 3), **ENGINE)

"""DSpark end to end: greedy DSpark output equals non-speculative greedy (MLA+MoE and GQA+MoE, chunked prefill), drafts
equal a plain re-computation every step, confidences and bad drafter folders, and PCP=2 equals PCP=1."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from dspark_checkpoint import build_dspark_drafter
from engine_utils import assert_drafts_keep_greedy_under_grammars, random_prompts, record_steps
from hf_oracle import load_hf_model
from json_schemas import random_schema
from safetensors.torch import load_file

from tandem import LLM, SamplingParams
from tandem.config import ConfigError
from tandem.models.loader import WeightLoadError

ARCHS = ["deepseek_v3", "glm4_moe"]
# The first prompt exceeds the 32-token budget alone, so step 1 is a prompt chunk that samples nothing: its
# context K/V must still reach the drafter's cache.
LENGTHS = [45, 3, 9, 20, 5, 12, 17, 25, 31, 33, 38, 41, 50, 57, 63, 8]
ENGINE = {"dtype": "float32", "max_num_batched_tokens": 32}
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
BLOCK = 4  # the test drafters' block_size


def _prompts() -> list[list[int]]:
    return random_prompts(LENGTHS, vocab_size=500, seed=13)


def _generate(path: Path, prompts: list[list[int]], params: SamplingParams | list[SamplingParams] = GREEDY,
              **kwargs) -> tuple[LLM, list]:
    llm = LLM(str(path), **ENGINE, **kwargs)
    return llm, llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


def _dspark(drafter: Path, k: int) -> dict:
    return {"method": "dspark", "num_speculative_tokens": k, "model": str(drafter)}


def _metrics(llm: LLM) -> dict:
    return {m.name: getattr(m, "value", None) for m in llm.get_metrics()}


@functools.lru_cache(maxsize=4)
def _baseline(path: Path) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in _generate(path, _prompts())[1]]


@pytest.fixture(scope="module")
def pair(tiny_checkpoints, tmp_path_factory):
    """arch -> (target, drafter): the drafter's Markov head memorised the target's greedy bigrams on the test
    prompts with a boost that wins only sometimes, so drafts are partly accepted and partly decided by context."""
    built: dict[str, tuple[Path, Path]] = {}

    def get(arch: str) -> tuple[Path, Path]:
        if arch not in built:
            target = tiny_checkpoints(arch)
            bigrams: dict[int, int] = {}
            for prompt, out in zip(_prompts(), _baseline(target), strict=True):
                seq = prompt[-1:] + out
                for prev, nxt in zip(seq, seq[1:], strict=False):
                    bigrams.setdefault(prev, nxt)
            drafter = build_dspark_drafter(target, tmp_path_factory.mktemp(f"dspark-{arch}"), bigrams=bigrams,
                                           boost=20.0)
            built[arch] = (target, drafter)
        return built[arch]

    return get


@pytest.mark.parametrize("k", [2, BLOCK], ids=["k2", "k-block"])
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_dspark_equals_non_speculative(pair, arch, k):
    target, drafter = pair(arch)
    llm, outs = _generate(target, _prompts(), speculative_config=_dspark(drafter, k))
    for i, (out, ref) in enumerate(zip(outs, _baseline(target), strict=True)):
        assert out.outputs[0].token_ids == ref, f"{arch} K={k}: prompt {i} diverged from non-speculative greedy"
    m = _metrics(llm)
    assert 0 < m["tandem:spec_decode_num_accepted_tokens"] < m["tandem:spec_decode_num_draft_tokens"], \
        f"{arch} K={k}: expected some but not all drafts accepted, got {m}"


def _dspark_reference(target: Path, drafter: Path):
    """DSpark's drafts from scratch for a context ending in the anchor: the context features from HF's hidden
    states, the block attention over them without any cache, and left-to-right Markov sampling."""
    hf = load_hf_model(target)
    cfg = json.loads((drafter / "config.json").read_text())
    w = load_file(str(drafter / "model.safetensors"))
    nh, nkv, d, b = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"], cfg["block_size"]

    def rms(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + cfg["rms_norm_eps"]))

    def rope(x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:  # x: [N, heads, D], neox halves
        angle = pos[:, None].double() / cfg["rope_theta"] ** (torch.arange(0, d, 2).double() / d)
        cos, sin = angle.cos().float()[:, None], angle.sin().float()[:, None]
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

    @torch.inference_mode()
    def drafts(context: list[int], k: int) -> list[int]:
        p = len(context) - 2  # the last valid target token; context[-1] is the anchor at p + 1
        states = hf.model(torch.tensor([context[: p + 1]]), output_hidden_states=True).hidden_states
        # HF's hidden_states[l + 1] is decoder layer l's output (the last entry is final-normed: not used here)
        aux = torch.cat([states[layer + 1][0] for layer in cfg["target_layer_ids"]], dim=-1)  # [p + 1, n * H]
        c = rms(aux @ w["fc.weight"].T, w["hidden_norm.weight"])
        ctx_pos, blk_pos = torch.arange(p + 1), torch.arange(p + 1, p + 1 + b)
        x = hf.model.embed_tokens.weight[torch.tensor([context[-1]] + [cfg["noise_token_id"]] * (b - 1))]  # [B, H]
        for i in range(cfg["num_hidden_layers"]):
            lw = {n[len(f"layers.{i}."):-len(".weight")]: t for n, t in w.items() if n.startswith(f"layers.{i}.")}
            h = rms(x, lw["input_layernorm"])
            q = rope((h @ lw["self_attn.q_proj"].T).view(b, nh, d), blk_pos)
            keys = torch.cat((rope((c @ lw["self_attn.k_proj"].T).view(-1, nkv, d), ctx_pos),
                              rope((h @ lw["self_attn.k_proj"].T).view(b, nkv, d), blk_pos)))
            values = torch.cat(((c @ lw["self_attn.v_proj"].T).view(-1, nkv, d),
                                (h @ lw["self_attn.v_proj"].T).view(b, nkv, d)))
            keys, values = keys.repeat_interleave(nh // nkv, 1), values.repeat_interleave(nh // nkv, 1)
            att = torch.softmax(torch.einsum("qhd,khd->hqk", q, keys) * d**-0.5, dim=-1)  # no mask: all of it
            x = x + torch.einsum("hqk,khd->qhd", att, values).reshape(b, nh * d) @ lw["self_attn.o_proj"].T
            h = rms(x, lw["post_attention_layernorm"])
            x = x + (F.silu(h @ lw["mlp.gate_proj"].T) * (h @ lw["mlp.up_proj"].T)) @ lw["mlp.down_proj"].T
        logits = rms(x, w["norm.weight"]) @ hf.lm_head.weight.T  # [B, V]
        out, prev = [], context[-1]
        for j in range(k):
            markov = w["markov_head.markov_w2.weight"] @ w["markov_head.markov_w1.weight"][prev]
            prev = int((logits[j] + markov).argmax())
            out.append(prev)
        return out

    return drafts


@pytest.mark.parametrize("arch", ARCHS)
def test_dspark_drafts_equal_plain_recomputation_every_step(pair, arch, monkeypatch):
    target, drafter = pair(arch)
    prompts = _prompts()[:4]
    llm = LLM(str(target), **ENGINE, speculative_config=_dspark(drafter, BLOCK))
    steps = record_steps(llm, monkeypatch)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=8,
                        ignore_eos=True), use_tqdm=False)
    full = {o.request_id: o.prompt_token_ids + o.outputs[0].token_ids for o in outs}
    num_emitted = {rid: 0 for rid in full}
    reference = _dspark_reference(target, drafter)
    checked = accepted = 0
    for plan, out in steps:
        sampling_rows = [r for r in plan.rows if r.sampling is not None]
        for row, emitted, drafts in zip(sampling_rows, out.sampled_token_ids, out.draft_token_ids, strict=True):
            rid = row.request_id
            num_emitted[rid] += len(emitted)
            accepted += len(emitted) - 1
            context = full[rid][: len(prompts[int(rid)]) + num_emitted[rid]]
            assert drafts == reference(context, BLOCK), f"{arch} request {rid} after {len(context)} tokens"
            checked += 1
    assert checked >= 4 * 3 and accepted > 0, f"{checked} request-steps checked, {accepted} drafts accepted"


def test_probabilistic_dspark_keeps_greedy_requests_exact(pair):
    target, drafter = pair("glm4_moe")
    prompts = _prompts()[:4]
    sampled = SamplingParams(temperature=0.8, max_tokens=12, seed=7, ignore_eos=True)
    spec = {**_dspark(drafter, BLOCK), "draft_sample_method": "probabilistic"}
    llm, outs = _generate(target, prompts, [sampled, GREEDY, sampled, GREEDY], speculative_config=spec)
    for i in (1, 3):  # greedy requests verify against sampled drafts with their q; the output must not move
        assert outs[i].outputs[0].token_ids == _baseline(target)[i], f"greedy prompt {i} changed"
    assert _metrics(llm)["tandem:spec_decode_num_accepted_tokens"] > 0


def test_confidence_is_one_probability_per_draft(pair):
    target, drafter = pair("glm4_moe")
    # 3 + 9 + 20 prompt tokens fit one step, so the one proposal covers all three requests
    llm, _ = _generate(target, _prompts()[1:4], SamplingParams(temperature=0, max_tokens=1, ignore_eos=True),
                       speculative_config=_dspark(drafter, 3))
    proposer = llm.engine.executor.runner.proposer
    conf = proposer.last_confidence
    assert conf.shape == (3, 3), f"one confidence per draft of each of the 3 rows expected, got {tuple(conf.shape)}"
    assert bool(((conf > 0) & (conf < 1)).all()), f"confidences outside (0, 1): {conf}"
    assert 0 < llm.engine.spec_stats.mean_confidence < 1
    # exported with the engine's metrics: the mean over every draft proposed, here exactly this proposal's
    exported = _metrics(llm)["tandem:spec_decode_dspark_mean_confidence"]
    assert exported == pytest.approx(float(conf.mean()), rel=1e-5)


@pytest.mark.parametrize("change,k,error,match", [
    ({"drop": ("layers.1.mlp.down_proj.weight",)}, 2, WeightLoadError, r"missing .*layers\.1\.mlp\.down_proj"),
    ({}, BLOCK + 1, ConfigError, rf"num_speculative_tokens={BLOCK + 1} .*block_size \({BLOCK}\)"),
    ({"overrides": {"vocab_size": 300, "noise_token_id": 299}}, 2, ConfigError, r"vocab_size=300 .*512"),
], ids=["missing-weight", "k-above-block", "vocab-mismatch"])
def test_bad_drafter_is_rejected_naming_the_problem(tiny_checkpoints, tmp_path, change, k, error, match):
    target = tiny_checkpoints("glm4_moe")
    drafter = build_dspark_drafter(target, tmp_path / "drafter", **change)
    with pytest.raises(error, match=match):
        LLM(str(target), **ENGINE, speculative_config=_dspark(drafter, k))


def test_pcp2_dspark_matches_single_rank(pair):
    target, drafter = pair("deepseek_v3")
    prompts = random_prompts([70, 9, 45, 20], vocab_size=500, seed=5)
    results = []
    for pcp in (1, 2):
        llm, outs = _generate(target, prompts, speculative_config=_dspark(drafter, BLOCK),
                              prefill_context_parallel_size=pcp)
        results.append(([o.outputs[0].token_ids for o in outs], _metrics(llm)))
        llm.shutdown()
    (single, m1), (pcp2, m2) = results
    for i, (got, ref) in enumerate(zip(pcp2, single, strict=True)):
        assert got == ref, f"PCP=2 prompt {i} (len {len(prompts[i])}) gave {got}, PCP=1 {ref}"
    key = "tandem:spec_decode_num_accepted_tokens"
    assert m2[key] == m1[key], f"replicated drafter proposed differently: {m2[key]} vs {m1[key]} accepted"


@pytest.mark.parametrize("backend", ["xgrammar", "llguidance"])
def test_greedy_dspark_under_a_grammar_equals_non_speculative(pair, backend):
    """Structured output with DSpark's block drafts: greedy tokens equal those without drafts under JSON schemas."""
    target, drafter = pair("deepseek_v3")
    assert_drafts_keep_greedy_under_grammars(target, _prompts()[:4], [random_schema(400 + i) for i in range(4)],
                                             backend, _dspark(drafter, BLOCK), **ENGINE)

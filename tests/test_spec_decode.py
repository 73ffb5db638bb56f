"""Speculative decoding end to end: greedy speculative output equals non-speculative greedy (MTP K=1..3,
single- and multi-module, n-gram) on MLA+MoE+MTP and GQA+MoE+MTP checkpoints with chunked prefill; MTP
drafts equal a plain re-computation; dynamic K follows its schedule; accepted drafts earn the bonus."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
import torch
from engine_utils import random_prompts, record_steps
from hf_oracle import load_hf_model
from safetensors import safe_open

import tandem.spec_decode.ngram as ngram
from tandem import LLM, SamplingParams
from tandem.config import ConfigError
from tandem.spec_decode.metrics import SpecDecodeStats
from tandem.spec_decode.ngram import propose_ngram

ARCHS = ["deepseek_v3", "glm4_moe"]
LENGTHS = [3, 5, 8, 12, 17, 20, 25, 31, 38, 44, 50, 57, 63, 70, 81, 95]
GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
ENGINE = {"dtype": "float32", "max_num_batched_tokens": 32}


def _prompts(n: int = 16) -> list[list[int]]:
    prompts = random_prompts(LENGTHS[:n], vocab_size=500, seed=13)
    # a few repetitive prompts, so the n-gram drafter gets accepted now and then
    prompts[1] = [7, 8, 9, 10] * 6
    if n > 5:
        prompts[5] = [11, 12, 13] * 9
    return prompts


def _generate(path: Path, prompts: list[list[int]], params: SamplingParams = GREEDY, **kwargs) -> tuple[LLM, list]:
    llm = LLM(str(path), **ENGINE, **kwargs)
    return llm, llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


@functools.lru_cache(maxsize=4)
def _baseline(path: Path) -> list[list[int]]:
    _, outs = _generate(path, _prompts())
    return [o.outputs[0].token_ids for o in outs]


def _metrics(llm: LLM) -> dict:
    return {m.name: getattr(m, "value", getattr(m, "values", None)) for m in llm.get_metrics()}


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("num_mtp_layers,spec", [
    (1, {"method": "mtp", "num_speculative_tokens": 1}),
    (1, {"method": "mtp", "num_speculative_tokens": 2}),
    (1, {"method": "mtp", "num_speculative_tokens": 3}),
    (2, {"method": "mtp", "num_speculative_tokens": 3}),
    (1, {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}),
], ids=["mtp-k1", "mtp-k2", "mtp-k3", "mtp2modules-k3", "ngram-k3"])
def test_greedy_speculative_equals_non_speculative(tiny_checkpoints, arch, num_mtp_layers, spec):
    path = tiny_checkpoints(arch, num_mtp_layers=num_mtp_layers)
    llm, outs = _generate(path, _prompts(), speculative_config=spec)
    for i, (out, ref) in enumerate(zip(outs, _baseline(path), strict=True)):
        assert out.outputs[0].token_ids == ref, f"{arch} {spec}: prompt {i} diverged from non-speculative greedy"
    m = _metrics(llm)
    k = spec["num_speculative_tokens"]
    assert m["tandem:spec_decode_num_drafts"] > 0
    assert m["tandem:spec_decode_num_draft_tokens"] <= k * m["tandem:spec_decode_num_drafts"]
    if spec["method"] == "ngram":
        assert m["tandem:spec_decode_num_accepted_tokens"] > 0, "repetitive prompts should accept some drafts"


@pytest.mark.parametrize("k", [2, 3])
def test_prompt_admitted_whole_drafts_into_reserved_slots(tiny_checkpoints, monkeypatch, k):
    """A prompt admitted and prefilled in one step samples at once, so its MTP draft decodes write and read
    positions past the prompt: the scheduler must reserve them (the look-ahead) at admission too. Prompts
    ending on a block boundary (block 16) made the draft read a block it never got. The first drafts must
    equal those of the same prompts prefilled in chunks, whose last chunk is scheduled as a running row."""
    path = tiny_checkpoints("deepseek_v3", num_mtp_layers=1)
    prompts = random_prompts([16, 40, 31, 32], vocab_size=500, seed=21)
    spec = {"method": "mtp", "num_speculative_tokens": k}
    first_drafts = []
    for budget in (2048, 8):
        llm = LLM(str(path), dtype="float32", max_num_batched_tokens=budget, speculative_config=spec)
        steps = record_steps(llm, monkeypatch)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
        drafts: dict[str, list[int]] = {}
        for plan, out in steps:
            sampling_rows = [r for r in plan.rows if r.sampling is not None]
            for row, d in zip(sampling_rows, out.draft_token_ids, strict=True):
                drafts.setdefault(row.request_id, d)  # the drafts made right after the prompt
        first_drafts.append([drafts[str(i)] for i in range(len(prompts))])
        alone = llm.generate([{"prompt_token_ids": prompts[0]}], GREEDY, use_tqdm=False)  # a one-block table
        assert alone[0].outputs[0].token_ids == outs[0].outputs[0].token_ids
        assert [o.outputs[0].token_ids for o in outs] == [
            o.outputs[0].token_ids for o in LLM(str(path), dtype="float32").generate(
                [{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)]
    assert first_drafts[0] == first_drafts[1], "drafts after a whole-prompt prefill differ from chunked ones"


def test_mtp_prefix_hit_recomputes_the_last_block(tiny_checkpoints, monkeypatch):
    """B shares A's first 32 tokens (two blocks) and then differs: the MTP layer's entry at position 31 was
    computed from A's token 32, so B recomputes the second block (a 16-token hit, not 32), and B's drafts
    equal B's on a fresh engine."""
    path = tiny_checkpoints("deepseek_v3", num_mtp_layers=1)
    shared, a_tail, b_tail = random_prompts([32, 9, 9], vocab_size=500, seed=5)
    spec = {"method": "mtp", "num_speculative_tokens": 2}
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)

    def drafts_of_b(llm: LLM) -> tuple[list, int]:
        steps = record_steps(llm, monkeypatch)
        out = llm.generate([{"prompt_token_ids": shared + b_tail}], params, use_tqdm=False)[0]
        return [d for plan, o in steps for d in o.draft_token_ids], out.num_cached_tokens

    warm = LLM(str(path), dtype="float32", speculative_config=spec)
    warm.generate([{"prompt_token_ids": shared + a_tail}], params, use_tqdm=False)
    after_a, hit = drafts_of_b(warm)
    fresh, fresh_hit = drafts_of_b(LLM(str(path), dtype="float32", speculative_config=spec))
    assert after_a == fresh
    assert (hit, fresh_hit) == (16, 0)


def _mtp_reference(path: Path):
    """A plain re-computation of MTP draft 1 from scratch for a context: the target's final-normed hidden
    states (HF), the MTP layer's own tensors, and HF's decoder layer as the MTP block."""
    from transformers import AutoConfig, AutoModelForCausalLM

    trunk = load_hf_model(path)
    cfg = AutoConfig.from_pretrained(path)
    num_layers = cfg.num_hidden_layers
    cfg.num_hidden_layers = num_layers + 1  # load the MTP layer's decoder block as one more trunk layer
    long = AutoModelForCausalLM.from_pretrained(path, config=cfg, dtype=torch.float32,
                                                attn_implementation="eager", experts_implementation="eager")
    block = long.model.layers[num_layers].eval()
    prefix = f"model.layers.{num_layers}."
    with safe_open(str(next(path.glob("*.safetensors"))), framework="pt") as f:
        w = {k[len(prefix):]: f.get_tensor(k) for k in f.keys() if k.startswith(prefix)}
    eps = cfg.rms_norm_eps

    def rms(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))

    @torch.inference_mode()
    def draft(context: list[int]) -> int:
        ids = torch.tensor(context)
        n = len(context) - 1
        hidden = trunk.model(ids[None, :n]).last_hidden_state[0]  # [n, H] at positions 0..n-1
        positions = torch.arange(n)
        emb = w["embed_tokens.weight"][ids[1:]] * (positions != 0)[:, None]  # embedding zeroed at position 0
        x = torch.cat((rms(emb, w["enorm.weight"]), rms(hidden, w["hnorm.weight"])), -1) @ w["eh_proj.weight"].T
        mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
        y = block(x[None], attention_mask=mask, position_embeddings=long.model.rotary_emb(x[None], positions[None]))
        y = y[0] if isinstance(y, tuple) else y
        logits = rms(y[0, -1], w["shared_head.norm.weight"]) @ w["shared_head.head.weight"].T
        return int(logits.argmax())

    return draft


def _with_distinct_mtp_copies(path: Path, dest: Path) -> Path:
    """A copy of the checkpoint whose MTP layer's embedding and shared head differ from the trunk's (released
    checkpoints save exact copies, which the engine shares; a checkpoint whose copies were trained apart must keep
    its own)."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(path, dest)
    (file,) = dest.glob("*.safetensors")
    tensors = load_file(str(file))
    layer = json.loads((dest / "config.json").read_text())["num_hidden_layers"]
    g = torch.Generator().manual_seed(5)
    for name in ("embed_tokens.weight", "shared_head.head.weight"):
        t = tensors[f"model.layers.{layer}.{name}"]
        tensors[f"model.layers.{layer}.{name}"] = t + 0.5 * t.std() * torch.randn(t.shape, generator=g, dtype=t.dtype)
    save_file(tensors, str(file), metadata={"format": "pt"})
    return dest


@pytest.mark.parametrize("copies", ["exact", "distinct"])
@pytest.mark.parametrize("arch", ARCHS)
def test_mtp_drafts_equal_plain_recomputation_every_step(tiny_checkpoints, arch, copies, monkeypatch, tmp_path):
    path = tiny_checkpoints(arch, num_mtp_layers=1)
    if copies == "distinct":
        path = _with_distinct_mtp_copies(path, tmp_path / "distinct")
    # 44 and 63 tokens exceed the 32-token budget: steps that only prefill must keep the MTP cache current
    prompts = [_prompts()[i] for i in (0, 1, 9, 12)]
    llm = LLM(str(path), **ENGINE, speculative_config={"method": "mtp", "num_speculative_tokens": 1})
    model = llm.engine.executor.runner.model
    shared = (model.mtp.layers[0].embed_tokens is model.model.embed_tokens,
              model.mtp.layers[0].shared_head.head is model.lm_head)
    assert shared == ((True, True) if copies == "exact" else (False, False))
    steps = record_steps(llm, monkeypatch)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=8,
                        ignore_eos=True), use_tqdm=False)
    full = {o.request_id: o.prompt_token_ids + o.outputs[0].token_ids for o in outs}
    emitted_so_far = {rid: 0 for rid in full}
    reference = _mtp_reference(path)
    checked = 0
    for plan, out in steps:
        sampling_rows = [r for r in plan.rows if r.sampling is not None]
        for row, emitted, drafts in zip(sampling_rows, out.sampled_token_ids, out.draft_token_ids, strict=True):
            rid = row.request_id
            prompt_len = len(full[rid]) - len(outs[int(rid)].outputs[0].token_ids)
            emitted_so_far[rid] += len(emitted)
            context = full[rid][: prompt_len + emitted_so_far[rid]]
            assert drafts == [reference(context)], f"{arch} request {rid} after {len(context)} tokens"
            checked += 1
    assert checked >= 4 * 8, f"only {checked} request-steps were checked"


def test_dynamic_k_follows_the_batch_size_schedule(tiny_checkpoints, monkeypatch):
    path = tiny_checkpoints("deepseek_v3", num_mtp_layers=1)
    schedule = [[2, 3], [4, 2], [6, 1]]
    llm = LLM(str(path), **ENGINE, speculative_config={"method": "mtp", "num_speculative_tokens_per_batch_size":
                                                       schedule})
    seen = []
    scheduler = llm.engine.scheduler
    schedule_step = scheduler.schedule

    def recording_schedule():
        running = len(scheduler.running)  # K follows the running requests at the start of the step
        plan = schedule_step()
        seen.append((running, [r.num_draft_tokens for r in plan.rows if r.sampling is not None]))
        return plan

    monkeypatch.setattr(scheduler, "schedule", recording_schedule)
    prompts = _prompts(8)
    llm.generate([{"prompt_token_ids": p} for p in prompts],
                 [SamplingParams(temperature=0, max_tokens=4 + 3 * i, ignore_eos=True) for i in range(8)],
                 use_tqdm=False)

    def k_for(running: int) -> int:
        return next((k for bound, k in schedule if running <= bound), 0)

    total = 0
    for running, drafts in seen:
        assert all(d <= k_for(running) for d in drafts), f"{running} running requests but drafts {drafts}"
        total += sum(drafts)
    assert {k_for(r) for r, d in seen if any(d)} >= {0, 1, 2, 3} - {0}, "every schedule step should occur"
    m = _metrics(llm)
    assert m["tandem:spec_decode_num_draft_tokens"] == total
    assert m["tandem:spec_decode_num_drafts"] == sum(1 for _, d in seen for x in d if x)


def test_all_accepted_drafts_earn_the_bonus_token(tiny_checkpoints, monkeypatch):
    path = tiny_checkpoints("glm4_moe", num_mtp_layers=1)
    prompts = _prompts(4)
    future = {tuple(p): ref for p, ref in zip(prompts, _generate(path, prompts)[1], strict=True)}
    known = {p: list(p) + out.outputs[0].token_ids for p, out in future.items()}

    def perfect_drafter(tokens: list[int], k: int, *_: int) -> list[int]:
        for prompt, full in known.items():
            if tuple(tokens[: len(prompt)]) == prompt and full[: len(tokens)] == tokens:
                return full[len(tokens):len(tokens) + k]
        raise AssertionError("unknown sequence")

    monkeypatch.setattr(ngram, "propose_ngram", perfect_drafter)
    llm, outs = _generate(path, prompts, speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    for out, prompt in zip(outs, prompts, strict=True):
        assert out.outputs[0].token_ids == future[tuple(prompt)].outputs[0].token_ids
    m = _metrics(llm)
    assert m["tandem:spec_decode_num_accepted_tokens"] == m["tandem:spec_decode_num_draft_tokens"] > 0
    # every verify step emitted all its drafts plus one bonus token
    assert m["tandem:spec_decode_mean_acceptance_length"] == pytest.approx(
        1 + m["tandem:spec_decode_num_draft_tokens"] / m["tandem:spec_decode_num_drafts"])
    assert m["tandem:spec_decode_mean_acceptance_length"] > 3


def test_acceptance_metrics_match_their_definitions():
    stats = SpecDecodeStats()
    stats.observe(3, 3)  # all accepted: 3 drafts + bonus
    stats.observe(3, 1)
    stats.observe(2, 0)
    stats.observe(0, 0)  # a step without drafts is not a draft
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (3, 8, 4)
    assert stats.accepted_per_pos == [2, 1, 1]
    assert stats.acceptance_rate == pytest.approx(4 / 8)
    assert stats.mean_acceptance_length == pytest.approx(1 + 4 / 3)


@pytest.mark.parametrize("spec,field", [
    ({"method": "mtp"}, "num_speculative_tokens"),
    ({"method": "mtp", "num_speculative_tokens": 2, "draft_sample_method": "beam"}, "draft_sample_method"),
    ({"method": "dspark", "num_speculative_tokens": 2}, "speculative_config.model"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
     "prompt_lookup_min"),
    ({"num_speculative_tokens": 2}, "speculative_config.method"),
    ({"method": "mtp", "num_speculative_tokens_per_batch_size": [[8, 3], [4, 1]]}, "per_batch_size"),
])
def test_invalid_speculative_config_is_rejected(tiny_checkpoints, spec, field):
    with pytest.raises(ConfigError, match=field):
        LLM(str(tiny_checkpoints("deepseek_v3", num_mtp_layers=1)), speculative_config=spec)


def test_mtp_without_mtp_layers_is_rejected(tiny_checkpoints):
    with pytest.raises(ConfigError, match="num_nextn_predict_layers"):
        LLM(str(tiny_checkpoints("deepseek_v3")), speculative_config={"method": "mtp", "num_speculative_tokens": 1})


def test_cli_summary_reports_acceptance(tiny_checkpoints, capsys):
    from tandem.entrypoints.cli import main as cli_main

    path = str(tiny_checkpoints("deepseek_v3", num_mtp_layers=1))
    rc = cli_main(["generate", path, "-p", "1 2 3 1 2 3 1 2", "--max-tokens", "8", "--ignore-eos", "--dtype",
                   "float32", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}'])
    out = capsys.readouterr().out
    assert rc == 0 and "=== speculative decoding: acceptance rate" in out and "mean acceptance length" in out


def test_mtp_layers_cost_no_kv_cache_without_mtp_drafting(tiny_checkpoints):
    """A checkpoint's MTP layers are dropped when nothing drafts with them, so the same KV budget holds more
    blocks; with MTP drafting their caches count."""
    path = str(tiny_checkpoints("deepseek_v3", num_mtp_layers=1))
    plain = LLM(path, dtype="float32", kv_cache_memory_bytes=1 << 22)
    drafting = LLM(path, dtype="float32", kv_cache_memory_bytes=1 << 22,
                   speculative_config={"method": "mtp", "num_speculative_tokens": 1})
    assert plain.engine.executor.runner.model.mtp is None
    # 3 trunk layers vs 3 + 1 MTP layer, same per-layer latent cache
    assert plain.engine.executor.num_kv_blocks * 3 == pytest.approx(drafting.engine.executor.num_kv_blocks * 4,
                                                                    rel=0.01)


@pytest.mark.parametrize("pcp", [1, 2])
def test_ngram_history_survives_prefix_hits_and_preemption(tiny_checkpoints, monkeypatch, pcp):
    """The n-gram proposer keeps each request's token history on every rank: a request admitted with a prefix-cache
    hit gets the tokens before its first row once, and a preempted request's history is rebuilt from its rows.
    Drafts from a broken history would still be verified away, so the test asks for acceptance too: repetitive
    prompts that share a cached prefix must keep being drafted for."""
    path = tiny_checkpoints("llama")
    shared = [7, 8, 9, 10] * 8  # two full 16-token blocks, cached by the first request
    prompts = [shared + [11, 12], shared + [13, 14, 7, 8], shared + [9, 10, 7]]
    engine = {"block_size": 16, "max_num_batched_tokens": 32, "num_gpu_blocks_override": 7, "max_model_len": 96,
              "prefill_context_parallel_size": pcp}
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    plain = LLM(str(path), dtype="float32", **engine)
    first = plain.generate([{"prompt_token_ids": prompts[0]}], params, use_tqdm=False)
    rest = plain.generate([{"prompt_token_ids": p} for p in prompts[1:]], params, use_tqdm=False)
    plain.shutdown()
    futures = [p + o.outputs[0].token_ids for p, o in zip(prompts, first + rest, strict=True)]
    histories: list[list[int]] = []

    def recording(tokens: list[int], *args) -> list[int]:  # type: ignore[no-untyped-def]
        histories.append(list(tokens))
        assert args[3] == ngram.as_text(tokens), "the proposer's text of the history went out of step with it"
        return propose_ngram(tokens, *args)

    monkeypatch.setattr(ngram, "propose_ngram", recording)  # reaches the drafter of a single-rank engine only
    llm = LLM(str(path), dtype="float32", **engine,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4})
    try:
        got_first = llm.generate([{"prompt_token_ids": prompts[0]}], params, use_tqdm=False)
        got_rest = llm.generate([{"prompt_token_ids": p} for p in prompts[1:]], params, use_tqdm=False)
        m = _metrics(llm)
    finally:
        llm.shutdown()
    assert [o.outputs[0].token_ids for o in got_first + got_rest] == \
        [o.outputs[0].token_ids for o in first + rest]
    assert m["tandem:prefix_cache_hits"] > 0, "the later requests should hit the first one's prompt blocks"
    assert m["tandem:num_preemptions"] > 0, "seven 16-token blocks cannot hold both later requests at full length"
    assert m["tandem:spec_decode_num_accepted_tokens"] > 0
    # each history the drafter looked up is a whole prefix of its request's tokens, prompt included
    assert pcp > 1 or histories
    for tokens in histories:
        assert any(f[:len(tokens)] == tokens for f in futures), f"history {tokens[:8]}... is no request's prefix"


def test_ngram_lookup_equals_the_plain_scan_on_a_seeded_fuzz():
    """propose_ngram's str.rfind search against the right-to-left scan it replaced (kept for ids past the last code
    point): short histories over tiny and large vocabularies, every k / min_n / max_n, overlapping matches."""
    import random

    rng = random.Random(1234)
    for _ in range(5000):
        vocab = rng.choice([2, 3, 7, 50, 200_000, 0x10FFFF])
        tokens = [rng.randrange(vocab) for _ in range(rng.randrange(0, 40))]
        k, min_n, max_n = rng.randrange(0, 5), rng.randrange(1, 4), rng.randrange(0, 6)
        want = ngram._scan(tokens, k, min_n, max_n) if k > 0 else []
        assert propose_ngram(tokens, k, min_n, max_n) == want, (tokens, k, min_n, max_n)
    assert propose_ngram([5, 6, 7, 5, 6], 2, 1, 2) == [7, 5]  # "5 6" recurs: what followed it
    huge = [0x110000 + 1, 3, 0x110000 + 1]  # not a code point: the plain scan serves
    assert propose_ngram(huge, 1, 1, 1) == [3]

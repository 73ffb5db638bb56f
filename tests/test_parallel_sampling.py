"""Parallel sampling (`SamplingParams.n > 1`): a seeded request's choice i equals the prompt sent alone with
seed + i (vLLM's convention), choices come back as indices 0..n-1 of one RequestOutput, greedy choices agree
with each other and with speculative decoding, and aborting the parent frees every child's KV blocks."""

from __future__ import annotations

from engine_utils import random_prompts

from tandem import LLM, SamplingParams
from tandem.engine.parallel_sampling import ParentRequest


def test_seeded_choices_equal_single_requests_with_seed_plus_index(tiny_checkpoints):
    llm = LLM(str(tiny_checkpoints("llama")), dtype="float32", max_num_batched_tokens=32)
    prompt, other = random_prompts([19, 9], vocab_size=500, seed=3)
    params = SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=12, ignore_eos=True, logprobs=1)
    mixed = llm.generate([{"prompt_token_ids": other}, {"prompt_token_ids": prompt}],
                         [SamplingParams(temperature=0.7, seed=1, max_tokens=5), params], use_tqdm=False)
    assert len(mixed[0].outputs) == 1
    out = mixed[1]
    assert [c.index for c in out.outputs] == [0, 1, 2] and out.prompt_token_ids == prompt
    for i, choice in enumerate(out.outputs):
        alone = llm.generate([{"prompt_token_ids": prompt}],
                             SamplingParams(temperature=1.0, seed=11 + i, max_tokens=12, ignore_eos=True),
                             use_tqdm=False)[0].outputs[0]
        assert choice.token_ids == alone.token_ids, f"choice {i} differs from seed {11 + i} alone"
        assert choice.finish_reason == "length" and len(choice.logprobs or []) == 12
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1, "three seeds gave three identical samples"
    unseeded = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(n=4, temperature=1.0, max_tokens=12,
                                                                           ignore_eos=True), use_tqdm=False)[0]
    assert len(unseeded.outputs) == 4 and len({tuple(c.token_ids) for c in unseeded.outputs}) > 1


def test_greedy_choices_agree_with_and_without_speculation(tiny_checkpoints):
    path = str(tiny_checkpoints("deepseek_v3", num_mtp_layers=1))
    prompts = random_prompts([27, 8], vocab_size=500, seed=8)
    params = SamplingParams(n=2, temperature=0, max_tokens=10, ignore_eos=True)
    plain = LLM(path, dtype="float32").generate([{"prompt_token_ids": p} for p in prompts], params,
                                                use_tqdm=False)
    spec = LLM(path, dtype="float32", speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    drafted = spec.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for a, b in zip(plain, drafted, strict=True):
        assert len(a.outputs) == len(b.outputs) == 2
        assert a.outputs[0].token_ids == a.outputs[1].token_ids == b.outputs[0].token_ids == b.outputs[1].token_ids


def test_aborting_the_parent_frees_every_child(tiny_checkpoints):
    llm = LLM(str(tiny_checkpoints("llama")), dtype="float32")
    engine = llm.engine
    (prompt,) = random_prompts([40], vocab_size=500, seed=4)
    parent = engine.add_request(prompt, SamplingParams(n=3, temperature=1.0, max_tokens=50, ignore_eos=True),
                                "p")
    assert isinstance(parent, ParentRequest) and [c.request_id for c in parent.children] == ["0_p", "1_p", "2_p"]
    for _ in range(3):
        assert engine.step() == []  # nobody finishes after 3 steps of 50 tokens
    assert engine.scheduler.block_manager.usage() > 0
    engine.abort_request("p")
    assert not engine.has_unfinished_requests() and engine.scheduler.block_manager.usage() == 0
    assert not engine.parents and not engine.requests


def test_choices_admitted_together_share_the_prompt_blocks(tiny_checkpoints):
    """The first child's prompt blocks are registered as they are scheduled, so its siblings, admitted in the
    same step, hit them (every layer writes the batch's K/V before any row attends); the samples are the
    same as without prefix caching, on one rank and with the prompt split over two PCP ranks."""
    path = str(tiny_checkpoints("deepseek_v3", num_mtp_layers=1))
    prompt = random_prompts([64], vocab_size=500, seed=6)[0]  # 4 blocks of 16; a hit leaves one token: 48
    params = SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=6, ignore_eos=True)
    spec = {"method": "mtp", "num_speculative_tokens": 2}
    reference = LLM(path, dtype="float32", enable_prefix_caching=False, speculative_config=spec).generate(
        [{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
    for pcp in (1, 2):
        llm = LLM(path, dtype="float32", prefill_context_parallel_size=pcp, speculative_config=spec)
        out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
        hits = {m.name: getattr(m, "value", None) for m in llm.get_metrics()}["tandem:prefix_cache_hits"]
        llm.shutdown()
        # MTP keys a block by its tokens and the next one, all known here: 3 blocks = 48 tokens a sibling
        assert hits == 3 * 48, f"PCP={pcp}: {hits} prompt tokens hit"
        assert [c.token_ids for c in out.outputs] == [c.token_ids for c in reference.outputs], f"PCP={pcp}"

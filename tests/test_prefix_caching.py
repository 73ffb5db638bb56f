"""Prefix caching: a request sharing a 64-token prefix reuses the cached blocks and yields the same tokens."""

from __future__ import annotations

from engine_utils import metric, random_prompts

from tandem import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def test_shared_64_token_prefix_hits_cache_and_matches_uncached(tiny_checkpoints):
    path = str(tiny_checkpoints("qwen3"))
    prefix, tail1, tail2 = random_prompts([64, 9, 13], vocab_size=500, seed=7)
    first, second = prefix + tail1, prefix + tail2

    cached = LLM(path, dtype="float32", block_size=16)
    cached.generate([{"prompt_token_ids": first}], GREEDY, use_tqdm=False)
    hits_before = metric(cached, "tandem:prefix_cache_hits")
    out = cached.generate([{"prompt_token_ids": second}], GREEDY, use_tqdm=False)[0]
    hits = metric(cached, "tandem:prefix_cache_hits") - hits_before
    assert hits == 64, f"expected the 4 full prefix blocks (64 tokens) to hit, got {hits}"
    assert out.num_cached_tokens == 64

    fresh = LLM(path, dtype="float32", block_size=16, enable_prefix_caching=False)
    ref = fresh.generate([{"prompt_token_ids": second}], GREEDY, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == ref.outputs[0].token_ids
    assert metric(fresh, "tandem:prefix_cache_hits") == 0


def test_identical_prompt_recomputes_its_last_token(tiny_checkpoints):
    # A full hit must still leave one token to compute, or there would be no logits to sample from.
    path = str(tiny_checkpoints("llama"))
    (prompt,) = random_prompts([32], vocab_size=500, seed=3)
    llm = LLM(path, dtype="float32", block_size=16)
    a = llm.generate([{"prompt_token_ids": prompt}], GREEDY, use_tqdm=False)[0]
    b = llm.generate([{"prompt_token_ids": prompt}], GREEDY, use_tqdm=False)[0]
    assert b.num_cached_tokens == 16, "the second of two full blocks is recomputed to produce logits"
    assert a.outputs[0].token_ids == b.outputs[0].token_ids

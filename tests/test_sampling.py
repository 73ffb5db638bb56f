"""Sampling: seeded results reproduce across runs and batch compositions, and the empirical distribution of
temperature/top-k/top-p/min-p sampling matches an independently computed target (chi-square)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from engine_utils import random_prompts
from scipy.stats import chisquare

from tandem import LLM, SamplingParams
from tandem.layers.sampler import SamplingMetadata, sample


def _reference_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float) -> np.ndarray:
    """Plain single-row reference of the processed distribution, written independently of the sampler."""
    probs = torch.softmax(logits.double() / temperature, dim=-1).numpy()
    order = np.argsort(-probs, kind="stable")
    keep = np.zeros_like(probs, dtype=bool)
    keep[order[: top_k or len(probs)]] = True
    p = np.where(keep, probs, 0.0)
    p /= p.sum()
    mass = 0.0
    for idx in order:
        if not keep[idx]:
            continue
        if mass >= top_p:
            keep[idx] = False
        mass += p[idx]
    p = np.where(keep, probs, 0.0)
    p /= p.sum()
    keep &= p >= min_p * p.max()
    p = np.where(keep, probs, 0.0)
    return p / p.sum()


@pytest.mark.parametrize("temperature,top_k,top_p,min_p", [
    (1.0, 0, 1.0, 0.0), (0.7, 0, 1.0, 0.0), (1.3, 5, 1.0, 0.0), (1.0, 0, 0.8, 0.0), (0.9, 6, 0.9, 0.0),
    (1.0, 0, 1.0, 0.1),
])
def test_sampled_distribution_matches_processed_target(temperature, top_k, top_p, min_p):
    vocab, n = 10, 20000
    logits = torch.tensor([2.0, 1.5, 1.2, 1.0, 0.5, 0.3, 0.0, -0.5, -1.0, -2.0])
    meta = SamplingMetadata(
        temperature=torch.full((n,), temperature), top_k=torch.full((n,), top_k, dtype=torch.int64),
        top_p=torch.full((n,), top_p), min_p=torch.full((n,), min_p),
        seeds=torch.full((n,), 1234, dtype=torch.int64), positions=torch.arange(n, dtype=torch.int64),
        max_num_logprobs=None, all_greedy=False)
    tokens = sample(logits.expand(n, vocab).clone(), meta).numpy()
    counts = np.bincount(tokens, minlength=vocab)
    expected = _reference_probs(logits, temperature, top_k, top_p, min_p) * n
    support = expected > 0
    assert counts[~support].sum() == 0, f"sampled filtered-out tokens: counts {counts}, expected {expected.round()}"
    stat, pvalue = chisquare(counts[support], expected[support])
    assert pvalue > 1e-3, f"chi-square p={pvalue:.2e}: counts {counts} vs expected {expected.round(1)}"


def test_greedy_rows_ignore_the_noise():
    logits = torch.randn(4, 50)
    meta = SamplingMetadata(
        temperature=torch.tensor([0.0, 1.0, 0.0, 1.0]), top_k=torch.zeros(4, dtype=torch.int64),
        top_p=torch.ones(4), min_p=torch.zeros(4), seeds=torch.arange(4), positions=torch.arange(4),
        max_num_logprobs=None, all_greedy=False)
    out = sample(logits, meta)
    assert out[0] == logits[0].argmax() and out[2] == logits[2].argmax()


def test_seeded_sampling_reproduces_across_runs_and_batch_compositions(tiny_checkpoints):
    path = str(tiny_checkpoints("llama"))
    target, *others = random_prompts([11, 5, 23, 17, 30], vocab_size=500, seed=5)
    seeded = SamplingParams(temperature=1.0, top_p=0.95, seed=42, max_tokens=24, ignore_eos=True)
    other = SamplingParams(temperature=0.8, seed=7, max_tokens=24, ignore_eos=True)

    alone = LLM(path, dtype="float32").generate([{"prompt_token_ids": target}], seeded, use_tqdm=False)
    llm = LLM(path, dtype="float32", max_num_batched_tokens=16)
    mixed = llm.generate([{"prompt_token_ids": p} for p in [others[0], target, *others[1:]]],
                         [other, seeded, other, other, other], use_tqdm=False)
    again = llm.generate([{"prompt_token_ids": p} for p in [*others[::-1], target]],
                         [other] * 4 + [seeded], use_tqdm=False)
    reference = alone[0].outputs[0].token_ids
    assert mixed[1].outputs[0].token_ids == reference, "batch composition changed a seeded sample"
    assert again[-1].outputs[0].token_ids == reference, "a second run changed a seeded sample"
    unseeded = SamplingParams(temperature=1.0, seed=43, max_tokens=24, ignore_eos=True)
    differ = llm.generate([{"prompt_token_ids": target}], unseeded, use_tqdm=False)
    assert differ[0].outputs[0].token_ids != reference, "a different seed should give a different sample"


def test_logprobs_are_returned_for_top_n_and_the_sampled_token(tiny_checkpoints):
    path = str(tiny_checkpoints("llama"))
    (prompt,) = random_prompts([9], vocab_size=500, seed=2)
    out = LLM(path, dtype="float32").generate(
        [{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=4, logprobs=3, ignore_eos=True),
        use_tqdm=False)[0].outputs[0]
    assert out.logprobs is not None and len(out.logprobs) == 4
    for token, entry in zip(out.token_ids, out.logprobs, strict=True):
        assert token in entry and len(entry) == 3, entry
        assert entry[token] == max(entry.values()), "greedy token must be the most likely"

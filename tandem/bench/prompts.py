"""Benchmark prompts: GSM8K test questions in the eval's layout, or seeded random token ids of a fixed length."""

from __future__ import annotations

import numpy as np

from tandem.data.gsm8k import SHARED_GSM8K, load_jsonl, synthetic_split


def bench_prompts(num_prompts: int) -> list[str]:
    """GSM8K test questions when ../shared is there, else the synthetic split, in the eval's layout."""
    path = SHARED_GSM8K / "test.jsonl"
    problems = load_jsonl(path) if path.is_file() else synthetic_split("test", num_prompts)
    return [f"Question: {problems[i % len(problems)].question}\nAnswer:" for i in range(num_prompts)]


def random_token_ids(vocab_size: int, length: int, seed: int) -> list[int]:
    # Ids above the usual special-token range: content does not change a forward pass's cost.
    rng = np.random.default_rng(seed)
    return rng.integers(min(100, vocab_size - 1), vocab_size, size=length).tolist()

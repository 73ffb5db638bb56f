"""Benchmark prompts: GSM8K test questions in the eval's layout, or seeded random token ids of a fixed length."""

from __future__ import annotations

from pathlib import Path

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


def random_text_prompts(tokenizer_folder: str, num_prompts: int, input_len: int, seed: int) -> list[str]:
    """`num_prompts` texts of about `input_len` tokens, decoded from random token ids. Decoding and re-encoding
    random ids merges or splits some of them, so each text is re-tokenized and cut or topped up (a few rounds,
    as vLLM's random dataset does) until it comes back close to `input_len` tokens."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(Path(tokenizer_folder) / "tokenizer.json"))
    vocab = tok.get_vocab_size()
    prompts = []
    for i in range(num_prompts):
        ids = random_token_ids(vocab, input_len, seed * 1_000_003 + i)
        for round_ in range(4):
            ids = tok.encode(tok.decode(ids), add_special_tokens=False).ids
            if len(ids) == input_len:
                break
            extra = random_token_ids(vocab, max(input_len - len(ids), 0), seed * 1_000_003 + i + 7919 * (round_ + 1))
            ids = ids[:input_len] + extra
        prompts.append(tok.decode(ids))
    return prompts

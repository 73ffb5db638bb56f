"""Benchmark prompts: GSM8K test questions (in the eval's layout, or as chat turns), held-out everyday instructions,
or seeded random token ids of a fixed length."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from tandem.data.gsm8k import SHARED_GSM8K, load_jsonl, synthetic_split

if TYPE_CHECKING:
    from tandem.tokenizer import Tokenizer as TandemTokenizer


def gsm8k_questions(num_prompts: int) -> list[str]:
    """`num_prompts` GSM8K test questions (cycled) when ../shared is there, else the synthetic split's."""
    path = SHARED_GSM8K / "test.jsonl"
    problems = load_jsonl(path) if path.is_file() else synthetic_split("test", num_prompts)
    return [problems[i % len(problems)].question for i in range(num_prompts)]


def bench_prompts(num_prompts: int) -> list[str]:
    """GSM8K test questions in the eval's layout."""
    return [f"Question: {q}\nAnswer:" for q in gsm8k_questions(num_prompts)]


def prompt_texts(kind: str, num_prompts: int) -> list[str]:
    """`num_prompts` requests (cycled): GSM8K test questions, or the held-out everyday instructions."""
    if kind == "everyday":
        from tandem.data.everyday import load_everyday

        instructions = load_everyday()
        return [instructions[i % len(instructions)] for i in range(num_prompts)]
    if kind == "gsm8k":
        return gsm8k_questions(num_prompts)
    raise ValueError(f"--prompts {kind!r} is not allowed: gsm8k or everyday")


def prompt_ids(model_folder: str, tokenizer: TandemTokenizer, texts: list[str]) -> tuple[list[list[int]], bool]:
    """Each text as a user turn through the folder's chat template (which writes its own special tokens), or as
    plain text in a folder without one; and whether the template was used."""
    from tandem.entrypoints.openai.chat_template import ChatTemplate

    template = ChatTemplate(model_folder)
    if not template.available:
        return [tokenizer.encode(text) for text in texts], False
    return [tokenizer.encode(template.render([{"role": "user", "content": text}]), add_special_tokens=False)
            for text in texts], True


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

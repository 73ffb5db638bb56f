"""The bundled model's tokenizer: byte-level BPE (2,048 tokens) trained on GSM8K train + synthetic problems.
Digits are split one per token (as Llama does) so the model learns column arithmetic, not a table of numbers."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tandem.data.gsm8k import Problem, format_example

BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
# Chat turns in the layout the model was trained on: a user turn is a question, an assistant turn its answer.
CHAT_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'user' %}Question: {{ m['content'] }}\nAnswer:"
    "{% elif m['role'] == 'assistant' %} {{ m['content'] }}\n\n{% endif %}{% endfor %}"
)
BOS_ID, EOS_ID, PAD_ID = 0, 1, 2


def add_bos_post_processor(tok: Any) -> None:
    """Every encoded prompt starts with <|bos|>, as every training row does (tandem's and transformers' encode
    both apply it; training itself encodes with add_special_tokens=False)."""
    from tokenizers import processors

    tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", special_tokens=[(BOS, BOS_ID)])


def train_tokenizer(out: Path, corpus: list[Problem], vocab_size: int = 2048) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, show_progress=False,
                                  special_tokens=[BOS, EOS, PAD], initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator((format_example(p) for p in corpus), trainer=trainer)
    if tok.get_vocab_size() != vocab_size:
        raise RuntimeError(f"tokenizer corpus too small: trained vocab {tok.get_vocab_size()} != {vocab_size}")
    out.mkdir(parents=True, exist_ok=True)
    add_bos_post_processor(tok)
    tok.save(str(out / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS, "eos_token": EOS, "pad_token": PAD,
              "add_bos_token": False, "add_eos_token": False, "clean_up_tokenization_spaces": False,
              "model_max_length": 4096, "chat_template": CHAT_TEMPLATE}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "special_tokens_map.json").write_text(json.dumps({"bos_token": BOS, "eos_token": EOS, "pad_token": PAD},
                                                            indent=2) + "\n")

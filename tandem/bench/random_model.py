"""A random checkpoint at DeepSeek-V3's attention and MLP widths (2 dense layers), for long-context benchmarks whose
cost depends on the shapes, not the weights: built once with Hugging Face's DeepseekV3 classes, with the bundled
model's tokenizer (prompts are token ids; the folder only has to load)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from tandem.assets import DEFAULT_MODEL

RANDOM_MODELS = ("dsv3",)
DSV3_SHAPE = {"hidden_size": 1024, "num_attention_heads": 16, "num_key_value_heads": 16, "kv_lora_rank": 512,
              "q_lora_rank": 768, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
              "num_hidden_layers": 2, "first_k_dense_replace": 2, "intermediate_size": 2816,
              "max_position_embeddings": 65536}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")


def random_model_folder(name: str, cache_dir: Path) -> Path:
    """The folder of random model `name` under `cache_dir`, built there on first use."""
    if name not in RANDOM_MODELS:
        raise ValueError(f"--random-model {name!r} is not allowed: one of {', '.join(RANDOM_MODELS)}")
    folder = cache_dir / f"bench-{name}-shaped"
    if (folder / "config.json").is_file():
        return folder
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    _build_dsv3(tmp)
    tmp.rename(folder)  # a build cut short leaves only .tmp, never a folder that looks complete
    return folder


def _build_dsv3(folder: Path) -> None:
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    vocab_size = json.loads((DEFAULT_MODEL / "config.json").read_text())["vocab_size"]
    config = DeepseekV3Config(**DSV3_SHAPE, vocab_size=vocab_size, tie_word_embeddings=False)
    with torch.random.fork_rng(devices=[]):  # the caller's random state must not depend on whether this ran
        torch.manual_seed(0)
        model = DeepseekV3ForCausalLM(config).eval()
    model.save_pretrained(folder, safe_serialization=True)
    for name in TOKENIZER_FILES:
        if (DEFAULT_MODEL / name).is_file():
            shutil.copy(DEFAULT_MODEL / name, folder / name)

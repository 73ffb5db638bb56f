"""Folders exactly as transformers' `save_pretrained` writes them (sharded safetensors + index, chat_template.jinja,
transformers-5 config): a tiny DeepSeek-V3 whose config declares an MTP layer that HF does not save."""

from __future__ import annotations

from pathlib import Path

from hf_oracle import _quiet_transformers


def save_pretrained_copy(src: Path, dst: Path, max_shard_size: str = "200KB") -> Path:
    """Load checkpoint `src` with transformers and save it (model and tokenizer) into `dst`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with _quiet_transformers():
        model = AutoModelForCausalLM.from_pretrained(src, dtype="float32")
        model.save_pretrained(dst, max_shard_size=max_shard_size)
        AutoTokenizer.from_pretrained(src).save_pretrained(dst)
    return dst

"""The target checkpoint folder as the draft head needs it: validation, the head's shape and the EAGLE-3
config.json that vLLM's `llama_eagle3.py` (and tandem) read."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tandem.train.draft_head.head import HeadShape

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen3ForCausalLM")
EAGLE3_ARCHITECTURE = "LlamaForCausalLMEagle3"


def read_target_config(target: Path) -> dict[str, Any]:
    """The target's config.json, checked: an error names the field, the value and what is allowed."""
    if not target.is_dir():
        raise ValueError(f"TARGET={str(target)!r} is not allowed: a Hugging Face model folder that exists")
    path = target / "config.json"
    if not path.is_file():
        raise ValueError(f"TARGET={str(target)!r} is not allowed: the folder has no config.json")
    raw = json.loads(path.read_text())
    arch = (raw.get("architectures") or [None])[0]
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"{path}: architectures={raw.get('architectures')!r} is not allowed: one of "
                         f"{list(SUPPORTED_ARCHITECTURES)}")
    if raw.get("num_hidden_layers", 0) < 3:
        raise ValueError(f"{path}: num_hidden_layers={raw.get('num_hidden_layers')!r} is not allowed: at least 3 "
                         "(the aux layers are 2, L // 2 and L - 3)")
    rope = raw.get("rope_scaling") or raw.get("rope_parameters") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        # the head is trained with plain RoPE; a scaled one would differ from what inference computes
        raise ValueError(f"{path}: rope type {rope_type!r} is not allowed: 'default' (no rope_scaling)")
    return raw


def rope_theta(raw: dict[str, Any]) -> float:
    # transformers 5 moves rope_theta into rope_parameters
    return float(raw.get("rope_theta", (raw.get("rope_parameters") or {}).get("rope_theta", 10000.0)))


def aux_layer_ids(raw: dict[str, Any]) -> list[int]:
    num_layers = raw["num_hidden_layers"]
    return [2, num_layers // 2, num_layers - 3]


def head_shape(raw: dict[str, Any], draft_vocab_size: int) -> HeadShape:
    num_heads = raw["num_attention_heads"]
    return HeadShape(
        hidden_size=raw["hidden_size"], intermediate_size=raw["intermediate_size"],
        num_attention_heads=num_heads, num_key_value_heads=raw.get("num_key_value_heads", num_heads),
        head_dim=raw.get("head_dim") or raw["hidden_size"] // num_heads, rms_norm_eps=raw["rms_norm_eps"],
        rope_theta=rope_theta(raw), num_aux_layers=len(aux_layer_ids(raw)), draft_vocab_size=draft_vocab_size)


def eagle3_config(raw: dict[str, Any], shape: HeadShape) -> dict[str, Any]:
    layer_ids = aux_layer_ids(raw)
    return {
        "architectures": [EAGLE3_ARCHITECTURE], "model_type": "llama",
        "hidden_size": shape.hidden_size, "intermediate_size": shape.intermediate_size,
        "num_attention_heads": shape.num_attention_heads, "num_key_value_heads": shape.num_key_value_heads,
        "head_dim": shape.head_dim, "num_hidden_layers": 1, "rms_norm_eps": shape.rms_norm_eps,
        "rope_theta": shape.rope_theta, "max_position_embeddings": raw["max_position_embeddings"],
        "hidden_act": "silu", "attention_bias": False, "tie_word_embeddings": False,
        "vocab_size": raw["vocab_size"], "draft_vocab_size": shape.draft_vocab_size,
        "target_hidden_size": raw["hidden_size"],
        "eagle_aux_hidden_state_layer_ids": layer_ids,
        "eagle_config": {"use_aux_hidden_state": True, "eagle_aux_hidden_state_layer_ids": layer_ids},
        "norm_before_residual": False,
        "torch_dtype": "bfloat16",
        "bos_token_id": raw.get("bos_token_id"), "eos_token_id": raw.get("eos_token_id"),
    }

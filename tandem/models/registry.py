"""Architecture name (config.json `architectures[0]`) -> model class."""

from __future__ import annotations

import importlib

from torch import nn

_MODELS: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("tandem.models.llama", "LlamaForCausalLM"),
    "Qwen3ForCausalLM": ("tandem.models.llama", "Qwen3ForCausalLM"),
    "Glm4MoeForCausalLM": ("tandem.models.glm4_moe", "Glm4MoeForCausalLM"),
    "DeepseekV3ForCausalLM": ("tandem.models.deepseek_v3", "DeepseekV3ForCausalLM"),
    "Glm4MoeLiteForCausalLM": ("tandem.models.deepseek_v3", "Glm4MoeLiteForCausalLM"),
}


_MLA_ARCHITECTURES = ("DeepseekV3ForCausalLM", "Glm4MoeLiteForCausalLM")


def attention_kind(architecture: str) -> str:
    """The attention kind a model's layers use (one per model in tandem's registry)."""
    return "mla_attention" if architecture in _MLA_ARCHITECTURES else "full_attention"


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def resolve_model_class(architecture: str) -> type[nn.Module]:
    if architecture not in _MODELS:
        raise ValueError(f"architecture {architecture!r} is not supported: one of "
                         f"{', '.join(supported_architectures())}")
    module, name = _MODELS[architecture]
    return getattr(importlib.import_module(module), name)

"""Draft execution mode under PCP, resolved once before the drafter is built (DESIGN §5).

The effective draft attention backend is `attention_config.backend_per_kind[kind]` ›
`speculative_config.attention_backend` › `attention_config.backend` › automatic. Automatic selection
is asked with use_pcp=True, so it only yields PCP-capable backends: the drafter is **sharded** like
the target. An explicit backend whose `supports_pcp()` is false makes the drafter **replicated**: it
is built from a config copy with prefill_context_parallel_size=1 and runs over the global batch on
every rank, while the target stays sharded. DSpark is always replicated; n-gram has no drafter model.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from tandem.attention.backend import AttentionBackend, select_backend
from tandem.config import EngineConfig
from tandem.models.registry import attention_kind


@dataclass(frozen=True)
class DraftMode:
    mode: str | None  # "sharded" | "replicated" | None (no drafter model)
    backend: type[AttentionBackend] | None  # the drafter's attention backend
    reason: str


def resolve_draft_mode(config: EngineConfig) -> DraftMode:
    spec, attn = config.speculative_config, config.attention_config
    if spec.method is None:
        return DraftMode(None, None, "speculative decoding is off")
    if spec.method == "ngram":
        return DraftMode(None, None, "n-gram drafts come from the global token history, no drafter model")
    kind = attention_kind(config.model_config.architecture)
    requested = attn.backend_per_kind.get(kind) or spec.attention_backend or attn.backend
    if requested is None:
        backend = select_backend(kind, None, use_pcp=True, kv_cache_dtype=config.cache_config.cache_dtype)
        source = "automatic selection (PCP-capable backends only)"
    else:
        backend = select_backend(kind, requested, use_pcp=False, kv_cache_dtype=config.cache_config.cache_dtype)
        source = f"explicit backend {requested}"
    if spec.method == "dspark":
        return DraftMode("replicated", backend, "DSpark always runs replicated over the global batch")
    if backend.supports_pcp():
        return DraftMode("sharded", backend, f"{source}: {backend.name} supports PCP, so the drafter "
                         "shares the target's PCP sharding")
    return DraftMode("replicated", backend, f"{source}: {backend.name} does not support PCP, so the drafter "
                     "runs replicated over the global batch")


def drafter_config(config: EngineConfig, mode: DraftMode) -> EngineConfig:
    """The config the drafter is built from: a copy without PCP when replicated (the target's is untouched)."""
    if mode.mode != "replicated":
        return config
    return replace(config, parallel_config=replace(config.parallel_config, prefill_context_parallel_size=1))

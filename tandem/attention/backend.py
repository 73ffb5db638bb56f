"""Attention backend interface, registry and selector.

A backend is a class that declares its capabilities (the kinds it serves, `supports_pcp`, `supports_kv_sharding`),
the shape of its paged cache (`kv_cache_shape`), builds its own metadata from the step's batch (`prepare_metadata`:
a CPU backend plans padded groups, in-place key runs or native-kernel rows; a backend that needs nothing builds
nothing) and runs the forward over the paged cache with it. Adding a backend is one file that registers a subclass;
it is then selectable by name (`attention_config.backend`).

`supports_pcp()` states what the forward really does: True only when each query segment's causal prefix is read
from the paged cache after the step's (gathered) K/V write, so a segment on any rank sees every earlier token.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from tandem.attention.batch import AttentionBatch
from tandem.config import KV_CACHE_DTYPES, EngineConfig

ATTENTION_KINDS = ("full_attention", "mla_attention")


class AttentionBackend:
    name: ClassVar[str]
    kinds: ClassVar[tuple[str, ...]]
    automatic: ClassVar[bool] = True  # automatic selection may pick it (False: by name only, e.g. an oracle)
    # the kv_cache_dtype values whose cache its forward reads (tandem/attention/kv_dtype.py); a backend that reads
    # fewer is refused for the others at start-up, never served by upcasting the cache
    kv_cache_dtypes: ClassVar[tuple[str, ...]] = KV_CACHE_DTYPES

    @classmethod
    def supports_pcp(cls) -> bool:
        raise NotImplementedError

    @classmethod
    def supports_kv_sharding(cls) -> bool:
        """True when the backend attends over owner-sharded KV (pcp_kv_layout sharded): its metadata of a batch
        with a `kv_shard` covers the keys this rank owns, and forward_sharded / forward_mla_sharded return partial
        outputs with their log-sum-exp, which the attention layer merges over the ranks."""
        return False

    @classmethod
    def splits_prompt_keys(cls) -> bool:
        """Under PCP with the replicated KV layout: True when a step with prompt rows should attend as under sharded KV
        (every query of the step over every P-th block of its row's keys, read from the replicated cache, the
        partials merged by LSE; worker/pcp_hooks.py) instead of each rank's queries over all the keys. For a backend
        whose prompt rows do work per key read that every rank would otherwise repeat for the whole context (MLA
        expands each latent into per-head keys and values). Needs supports_kv_sharding and a metadata builder that
        reads `KVShard.replicated`."""
        return False

    @staticmethod
    def kv_cache_shape(num_blocks: int, block_size: int, *kv_spec: int) -> tuple[int, ...]:
        """The layer's paged cache; kv_spec is the layer's `kv_spec()`: (num_kv_heads, head_dim) for
        full_attention, (kv_lora_rank, qk_rope_head_dim) for mla_attention."""
        raise NotImplementedError

    @classmethod
    def prepare_metadata(cls, batch: AttentionBatch) -> Any:
        """The backend's own metadata of `batch`, handed to every forward of the batch (built once per batch by
        AttentionBatch.metadata_for). The default needs nothing beyond the batch itself."""
        return batch

    @staticmethod
    def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None, kv_cache: torch.Tensor,
                meta: Any, scale: float) -> torch.Tensor:
        """full_attention backends: q [T, Hq, D], k/v [T, Hkv, D] this step's K/V -> [T, Hq, D]."""
        raise NotImplementedError

    @staticmethod
    def forward_mla(q_nope: torch.Tensor, q_pe: torch.Tensor, entries: torch.Tensor, kv_cache: torch.Tensor,
                    meta: Any, scale: float, up: Any) -> torch.Tensor:
        """mla_attention backends: q_nope [T, H, nope], q_pe [T, H, rope], entries [T, L + rope] this step's
        latents, `up` the MLAUpProjection (W_UK, W_UV) -> [T, H, v]."""
        raise NotImplementedError

    @staticmethod
    def forward_sharded(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                        meta: Any, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """full_attention, sharded KV: q [T_global, Hq, D] every query of the step, k/v the (gathered) new K/V
        -> partial (out [T_global, Hq, D] float32, lse [T_global, Hq]) over the keys this rank owns."""
        raise NotImplementedError

    @staticmethod
    def forward_mla_sharded(q: torch.Tensor, entries: torch.Tensor, kv_cache: torch.Tensor,
                            meta: Any, scale: float, up: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """mla_attention, sharded KV: q [T_global, H, nope + rope] every query of the step, entries the (gathered)
        new latents -> partial (out [T_global, H, v] float32, lse [T_global, H]) over the owned keys."""
        raise NotImplementedError


_REGISTRY: dict[str, type[AttentionBackend]] = {}


def register_backend(cls: type[AttentionBackend]) -> type[AttentionBackend]:
    _REGISTRY[cls.name] = cls
    return cls


def registered_backends() -> dict[str, type[AttentionBackend]]:
    import tandem.attention.backends  # noqa: F401  (imports every backend module, which registers its backends)

    return dict(_REGISTRY)


def select_target_backends(config: EngineConfig) -> dict[str, type[AttentionBackend]]:
    """The target model's backend per attention kind: `backend_per_kind` › `backend` › automatic."""
    from tandem.models.registry import attention_kind, resolve_model_class

    resolve_model_class(config.model_config.architecture)  # an unknown architecture is named first
    attn = config.attention_config
    kind = attention_kind(config.model_config.architecture)
    use_pcp = config.parallel_config.prefill_context_parallel_size > 1
    cls = select_backend(kind, attn.backend_per_kind.get(kind, attn.backend), use_pcp,
                         config.cache_config.cache_dtype)
    if use_pcp and config.parallel_config.pcp_kv_layout == "sharded" and not cls.supports_kv_sharding():
        raise ValueError(f"attention backend {cls.name!r} does not attend over owner-sharded KV "
                         "(pcp_kv_layout='sharded'): use PAGED_SDPA / PAGED_MLA or pcp_kv_layout='replicated'")
    return {kind: cls}


def select_backend(kind: str, requested: str | None, use_pcp: bool,
                   kv_cache_dtype: str = "auto") -> type[AttentionBackend]:
    """The backend for one attention kind: the requested one if it can serve, else the first capable."""
    if kind not in ATTENTION_KINDS:
        raise ValueError(f"attention kind {kind!r} is not supported: one of {', '.join(ATTENTION_KINDS)}")
    backends = registered_backends()
    if requested is not None:
        cls = backends.get(requested)
        if cls is None:
            raise ValueError(f"attention backend {requested!r} is unknown: one of {', '.join(sorted(backends))}")
        if kind not in cls.kinds:
            raise ValueError(f"attention backend {requested!r} does not serve {kind}: it serves "
                             f"{', '.join(cls.kinds)}")
        if use_pcp and not cls.supports_pcp():
            raise ValueError(f"attention backend {requested!r} does not support prefill context parallelism")
        if kv_cache_dtype not in cls.kv_cache_dtypes:
            raise ValueError(f"attention backend {requested!r} cannot read a kv_cache_dtype={kv_cache_dtype!r} cache: "
                             f"it reads {', '.join(cls.kv_cache_dtypes)}")
        return cls
    # Automatic selection prefers PCP-capable backends even without PCP, so the choice does not
    # change with the layout (and a drafter resolved with use_pcp=True gets the same one).
    for cls in sorted(backends.values(), key=lambda c: not c.supports_pcp()):
        if cls.automatic and kind in cls.kinds and (cls.supports_pcp() or not use_pcp) \
                and kv_cache_dtype in cls.kv_cache_dtypes:
            return cls
    raise ValueError(f"no attention backend serves {kind} with use_pcp={use_pcp} and kv_cache_dtype={kv_cache_dtype!r}")

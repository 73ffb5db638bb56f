"""Sizing and allocating the paged KV cache of every attention module in a model."""

from __future__ import annotations

import torch
from torch import nn

from tandem.attention.backend import AttentionBackend
from tandem.attention.layer import Attention, MLAAttention


def attention_modules(model: nn.Module) -> list[Attention | MLAAttention]:
    return [m for m in model.modules() if isinstance(m, Attention | MLAAttention)]


def kv_cache_shape(layer: Attention | MLAAttention, backend: type[AttentionBackend], num_blocks: int,
                   block_size: int) -> tuple[int, ...]:
    return backend.kv_cache_shape(num_blocks, block_size, *layer.kv_spec())  # type: ignore[attr-defined]


def bytes_per_block(modules: nn.Module | list[Attention | MLAAttention], backends: dict[str, type[AttentionBackend]],
                    block_size: int, dtype: torch.dtype) -> int:
    """KV bytes one block costs over `modules` (a model: all its attention modules)."""
    elems = sum(torch.Size(kv_cache_shape(m, backends[m.kind], 1, block_size)).numel() for m in _modules(modules))
    return elems * torch.finfo(dtype).bits // 8


def _modules(modules: nn.Module | list[Attention | MLAAttention]) -> list[Attention | MLAAttention]:
    return attention_modules(modules) if isinstance(modules, nn.Module) else modules


def allocate_kv_caches(modules: nn.Module | list[Attention | MLAAttention], backends: dict[str, type[AttentionBackend]],
                       num_blocks: int, block_size: int, dtype: torch.dtype, device: str) -> None:
    """Give each attention module (of a model, or listed) its own zeroed cache tensor (bound as `module.kv_cache`)."""
    for m in _modules(modules):
        m.kv_cache = torch.zeros(kv_cache_shape(m, backends[m.kind], num_blocks, block_size), dtype=dtype,
                                 device=device)

"""Strict weight loading: stream safetensors shards, route each tensor to its parameter's
`weight_loader`, and fail naming every unexpected or missing tensor.

A model may declare `packed_modules_mapping` (checkpoint sub-name -> (fused sub-name, shard id))
and `map_weight_name(name) -> (param name, shard id) | None` for anything else (experts, MTP).
A parameter fused from several tensors lists the shard ids it needs in `param.expected_shards`.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from tandem.config import ModelConfig
from tandem.distributed.groups import ParallelGroups
from tandem.models.registry import resolve_model_class

# Tensors that carry no model state in some checkpoints.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class WeightLoadError(ValueError):
    pass


def iterate_safetensors(folder: str) -> Iterator[tuple[str, torch.Tensor]]:
    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise WeightLoadError(f"model={folder!r}: no *.safetensors files found")
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118  (safe_open is not a mapping)
                yield name, f.get_tensor(name)


def packed_weight_target(model: nn.Module, name: str) -> tuple[str, Any]:
    for sub, (fused, shard) in getattr(model, "packed_modules_mapping", {}).items():
        if f".{sub}." in name:
            return name.replace(f".{sub}.", f".{fused}."), shard
    return name, None


def load_weights(model: nn.Module, weights: Iterator[tuple[str, torch.Tensor]]) -> None:
    params = dict(model.named_parameters())
    loaded: dict[str, set[Any]] = {}
    unexpected: list[str] = []
    mapper = getattr(model, "map_weight_name", None)
    for name, tensor in weights:
        if name.endswith(_IGNORED_SUFFIXES):
            continue
        target = mapper(name) if mapper is not None else packed_weight_target(model, name)
        if target is None:
            continue  # deliberately skipped by the model
        param_name, shard = target
        param = params.get(param_name)
        if param is None:
            unexpected.append(name)
            continue
        try:
            if shard is None:
                param.weight_loader(param, tensor)  # type: ignore[attr-defined]
            else:
                param.weight_loader(param, tensor, shard)  # type: ignore[attr-defined]
        except ValueError as e:
            raise WeightLoadError(f"checkpoint tensor {name!r}: {e}") from e
        loaded.setdefault(param_name, set()).add(shard)
    missing = [n for n, p in params.items()
               if n not in loaded or not set(getattr(p, "expected_shards", {None})) <= loaded[n]]
    if unexpected or missing:
        parts = []
        if unexpected:
            parts.append(f"unexpected tensors in the checkpoint: {', '.join(sorted(unexpected)[:20])}")
        if missing:
            parts.append(f"missing from the checkpoint: {', '.join(sorted(missing)[:20])}")
        raise WeightLoadError("; ".join(parts))


def build_model(config: ModelConfig, groups: ParallelGroups, device: str = "cpu") -> nn.Module:
    cls = resolve_model_class(config.architecture)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(config.dtype)
    try:
        with torch.device(device):
            model = cls(config, groups)
    finally:
        torch.set_default_dtype(previous)
    load_weights(model, iterate_safetensors(config.model))
    return model.eval()

"""Strict weight loading: stream a checkpoint's tensors (lazy per-rank slices, block-FP8 dequantized), route each
to its parameter's `weight_loader`, and fail naming every unexpected or missing tensor.

A model may declare `packed_modules_mapping` (checkpoint sub-name -> (fused sub-name, shard id))
and `map_weight_name(name) -> (param name, shard id) | None` for anything else (experts, MTP).
A parameter fused from several tensors lists the shard ids it needs in `param.expected_shards`.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from tandem.config import ModelConfig
from tandem.distributed.groups import ParallelGroups
from tandem.models.checkpoint_reader import CheckpointTensor, WeightLoadError, read_checkpoint
from tandem.models.fp8 import BlockFp8Format
from tandem.models.registry import resolve_model_class

__all__ = ["WeightLoadError", "build_model", "load_weights", "packed_weight_target", "read_checkpoint"]

# Tensors that carry no model state in some checkpoints.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
KV_SCALE_SUFFIXES = (".k_scale", ".v_scale")


def packed_weight_target(model: nn.Module, name: str) -> tuple[str, Any]:
    for sub, (fused, shard) in getattr(model, "packed_modules_mapping", {}).items():
        if f".{sub}." in name:
            return name.replace(f".{sub}.", f".{fused}."), shard
    return name, None


def load_weights(model: nn.Module, weights: Iterable[tuple[str, CheckpointTensor | torch.Tensor]]) -> None:
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
        if param_name.endswith(KV_SCALE_SUFFIXES):
            if not load_kv_scale(model, param_name, tensor):
                unexpected.append(name)
            continue
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
        raise WeightLoadError("; ".join(parts), missing)


def load_kv_scale(model: nn.Module, name: str, tensor: CheckpointTensor | torch.Tensor) -> bool:
    """A checkpoint's per-layer KV cache scale (vLLM's names: `<layer>.self_attn.k_scale` / `v_scale`, or under the
    attention module itself) -> the attention module's `k_scale` / `v_scale` float (tandem/attention/kv_dtype.py):
    its cache stores K / k_scale. False when `name` names no attention module."""
    owner_name, attr = name.rsplit(".", 1)
    owner = dict(model.named_modules()).get(owner_name)
    found = [] if owner is None else [m for m in owner.modules() if hasattr(m, "kv_spec")]
    if len(found) != 1:
        return False
    value = float((tensor.materialize() if isinstance(tensor, CheckpointTensor) else tensor).float().reshape(-1)[0])
    if not 0.0 < value < float("inf"):
        raise WeightLoadError(f"checkpoint tensor {name!r}: a KV cache scale must be finite and > 0, got {value}")
    setattr(found[0], attr, value)
    return True


def build_model(config: ModelConfig, groups: ParallelGroups, device: str = "cpu", with_mtp: bool = False) -> nn.Module:
    """The model of `config.model` with this rank's share of the weights. MTP layers are built and loaded only
    `with_mtp` (MTP drafting asked for): vLLM loads them only into its drafter, and checkpoints saved by
    transformers declare `num_nextn_predict_layers` without holding the layers."""
    cls = resolve_model_class(config.architecture)
    try:
        fp8 = BlockFp8Format.from_hf_config(config.hf)
    except ValueError as e:
        raise WeightLoadError(f"model={config.model!r}: {e}") from e
    previous = torch.get_default_dtype()
    torch.set_default_dtype(config.dtype)
    try:
        with torch.device(device):
            model = cls(config, groups, with_mtp=with_mtp)
    finally:
        torch.set_default_dtype(previous)
    try:
        load_weights(model, read_checkpoint(config.model, fp8))
    except WeightLoadError as e:
        mtp_missing = [_mtp_checkpoint_name(n, config.hf.num_hidden_layers) for n in e.missing if n.startswith("mtp.")]
        if with_mtp and mtp_missing:
            raise WeightLoadError(
                f"model={config.model!r}: MTP drafting needs the checkpoint's MTP layers (num_nextn_predict_layers="
                f"{config.get('num_nextn_predict_layers')}), which it lacks: missing "
                f"{', '.join(mtp_missing[:20])}", e.missing) from e
        raise
    post_load = getattr(model, "post_load", None)
    if post_load is not None:  # a model's own step once its weights are in (sharing copies, ...)
        post_load()
    return model.eval()


def _mtp_checkpoint_name(param_name: str, num_hidden_layers: int) -> str:
    """`mtp.layers.{i}[.mtp_block].X` -> `model.layers.{L + i}.X`, where the checkpoint keeps MTP layer i."""
    return re.sub(r"^mtp\.layers\.(\d+)\.(mtp_block\.)?",
                  lambda m: f"model.layers.{num_hidden_layers + int(m[1])}.", param_name)

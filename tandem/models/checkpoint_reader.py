"""The tensors of a Hugging Face safetensors folder as lazy slices: a weight loader narrows a `CheckpointTensor` to
its rank's part, and only that part is read (`safe_open(...).get_slice`), block-FP8 dequantized on the way.

Shards: `model.safetensors.index.json` when present (its weight map is the checkpoint: a consolidated file
beside the shards is not read twice), every `*.safetensors` otherwise.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from tandem.models.fp8 import FP8_SAFETENSORS_DTYPES, SCALE_SUFFIX, BlockFp8Format

INDEX_FILE = "model.safetensors.index.json"
_SliceRanges = list[tuple[int, int]]  # (start, stop) per dim


class WeightLoadError(ValueError):
    """A checkpoint that does not fit the model; `missing` names the parameters no tensor filled."""

    def __init__(self, message: str, missing: list[str] | None = None):
        super().__init__(message)
        self.missing = missing or []


class CheckpointTensor:
    """A view of one checkpoint tensor, read when first used as a tensor.

    `shape`, `narrow` and slicing compose the view without reading; anything else reads it: torch calls through
    `__torch_function__` (the extension point torch offers tensor-likes, so `param.data.copy_(view)` works) and
    other attributes through `materialize()`. A block-FP8 weight reads as float32 (weight x block scale)."""

    def __init__(self, name: str, handle: Any, shape: tuple[int, ...], fp8: BlockFp8Format | None = None,
                 ranges: _SliceRanges | None = None):
        self.name, self._handle, self._full_shape, self._fp8 = name, handle, shape, fp8
        self._ranges = ranges if ranges is not None else [(0, n) for n in shape]

    @property
    def shape(self) -> torch.Size:
        return torch.Size(stop - start for start, stop in self._ranges)

    def dim(self) -> int:
        return len(self._ranges)

    def size(self, dim: int | None = None) -> torch.Size | int:
        return self.shape if dim is None else self.shape[dim]

    def narrow(self, dim: int, start: int, length: int) -> CheckpointTensor:
        dim = dim % self.dim()
        lo, hi = self._ranges[dim]
        if start < 0 or length < 0 or lo + start + length > hi:
            raise IndexError(f"{self.name}: narrow({dim}, {start}, {length}) is out of range for {tuple(self.shape)}")
        ranges = list(self._ranges)
        ranges[dim] = (lo + start, lo + start + length)
        return CheckpointTensor(self.name, self._handle, self._full_shape, self._fp8, ranges)

    def __getitem__(self, key: Any) -> Any:
        keys = key if isinstance(key, tuple) else (key,)
        if not all(isinstance(k, slice) and k.step in (None, 1) for k in keys):
            return self.materialize()[key]
        view = self
        for dim, k in enumerate(keys):
            start, stop, _ = k.indices(view.shape[dim])
            view = view.narrow(dim, start, max(0, stop - start))
        return view

    def materialize(self) -> torch.Tensor:
        sliced = self._ranges != [(0, n) for n in self._full_shape]
        weight = self._read(self.name, self._ranges if sliced else None)
        if self._fp8 is None:
            return weight
        scale_ranges = self._fp8.scale_ranges(self._ranges)
        scale = self._read(self.name + SCALE_SUFFIX, scale_ranges if sliced else None)
        return self._fp8.dequantize(weight, scale, self._ranges[-2][0], self._ranges[-1][0])

    def _read(self, name: str, ranges: _SliceRanges | None) -> torch.Tensor:
        if ranges is None:
            return self._handle.get_tensor(name)
        return self._handle.get_slice(name)[tuple(slice(a, b) for a, b in ranges)]

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("_"):
            raise AttributeError(attr)
        return getattr(self.materialize(), attr)

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        def real(a: Any) -> Any:
            return a.materialize() if isinstance(a, CheckpointTensor) else a

        return func(*(real(a) for a in args), **{k: real(v) for k, v in (kwargs or {}).items()})


def shard_files(folder: str) -> dict[str, list[str]]:
    """Shard file -> the tensor names to read from it (all of a file's tensors when there is no index)."""
    root = Path(folder)
    index = root / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise WeightLoadError(f"model={folder!r}: {INDEX_FILE} has no readable weight_map: {e}") from e
        files: dict[str, list[str]] = {}
        for name, file in weight_map.items():
            files.setdefault(file, []).append(name)
        for file, names in files.items():
            if not (root / file).is_file():
                raise WeightLoadError(f"model={folder!r}: shard {file!r} named in {INDEX_FILE} is missing "
                                      f"({len(names)} tensors, e.g. {sorted(names)[0]!r})")
        return files
    paths = sorted(root.glob("*.safetensors"))
    if not paths:
        raise WeightLoadError(f"model={folder!r}: no *.safetensors files found")
    out = {}
    for path in paths:
        with safe_open(str(path), framework="pt") as f:
            out[path.name] = list(f.keys())
    return out


def read_checkpoint(folder: str, fp8: BlockFp8Format | None = None) -> Iterator[tuple[str, CheckpointTensor]]:
    """(name, lazy tensor) for every tensor of the checkpoint; block-FP8 weights come paired with their
    `weight_scale_inv` (which is not yielded itself). The shards stay open until the iteration ends."""
    with ExitStack() as stack:
        handles, dtypes, shapes = {}, {}, {}
        for file, names in shard_files(folder).items():
            handle = stack.enter_context(safe_open(str(Path(folder) / file), framework="pt"))
            present = set(handle.keys())
            for name in names:
                if name not in present:
                    raise WeightLoadError(f"model={folder!r}: tensor {name!r} is not in shard {file!r}, "
                                          f"where {INDEX_FILE} places it")
                view = handle.get_slice(name)
                handles[name], dtypes[name], shapes[name] = handle, view.get_dtype(), tuple(view.get_shape())
        _check_fp8_pairs(folder, dtypes, shapes, fp8)
        for name in sorted(handles):
            if name.endswith(SCALE_SUFFIX):
                continue
            quantized = fp8 if dtypes[name] in FP8_SAFETENSORS_DTYPES else None
            yield name, CheckpointTensor(name, handles[name], shapes[name], quantized)


def _check_fp8_pairs(folder: str, dtypes: dict[str, str], shapes: dict[str, tuple[int, ...]],
                     fp8: BlockFp8Format | None) -> None:
    for name, dtype in dtypes.items():
        if name.endswith(SCALE_SUFFIX):
            weight = name.removesuffix(SCALE_SUFFIX)
            if dtypes.get(weight) not in FP8_SAFETENSORS_DTYPES:
                raise WeightLoadError(f"model={folder!r}: scale {name!r} has no float8 weight {weight!r}")
        elif dtype in FP8_SAFETENSORS_DTYPES:
            if fp8 is None:
                raise WeightLoadError(f"model={folder!r}: tensor {name!r} is {dtype} but config.json has no "
                                      "quantization_config (quant_method 'fp8' with weight_block_size)")
            if name + SCALE_SUFFIX not in shapes:
                raise WeightLoadError(f"model={folder!r}: float8 tensor {name!r} has no {name + SCALE_SUFFIX!r}")
            try:
                fp8.check_scale(name, shapes[name], shapes[name + SCALE_SUFFIX])
            except ValueError as e:
                raise WeightLoadError(f"model={folder!r}: {e}") from e

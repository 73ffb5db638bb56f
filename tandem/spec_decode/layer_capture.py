"""The outputs of some of the target's modules in its last forward, kept by forward hooks, for drafters that read
intermediate layers (DSpark's target_layer_ids, EAGLE-3's aux layers)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn


class LayerCapture:
    """`modules`: key -> module whose output is kept (registered before the target is compiled)."""

    def __init__(self, modules: dict[int, nn.Module]):
        self._kept: dict[int, torch.Tensor] = {}
        for key, module in modules.items():
            module.register_forward_hook(self._keeper(key))

    def _keeper(self, key: int) -> Callable[[nn.Module, object, torch.Tensor], None]:
        def keep(_module: nn.Module, _args: object, output: torch.Tensor) -> None:
            self._kept[key] = output

        return keep

    def take(self, keys: tuple[int, ...]) -> torch.Tensor:
        """[T_local, len(keys) * H] the kept outputs concatenated in `keys` order (one tensor, so PCP restores them in
        one collective); the capture is cleared, so a stale one is never read as the next step's."""
        out = torch.cat([self._kept[k] for k in keys], dim=-1)
        self._kept.clear()
        return out

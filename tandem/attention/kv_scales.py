"""Per-layer fp8 KV cache scales computed from real activations: `calculate_kv_scales` (vLLM's option).

Armed layers compute their scales in their first forward that writes the cache, from the K/V it writes, then
store with them from that batch on (tandem/attention/kv_dtype.py folds them into the attention math):

    k_scale = amax|K| / 200,  v_scale = amax|V| / 100      (MLA: one scale, amax of the [kv_c | k_pe] entry / 200)

vLLM's constants (K_SCALE_CONSTANT, V_SCALE_CONSTANT): the first batch's largest value lands at 200 (100) of
e4m3's 448, so later values up to 2.2x (4.5x) larger still fit before they saturate, and small values move from
e4m3's subnormals (below 2^-6 at scale 1) into its normal range. The amax is taken over the rows the batch writes
(never PCP or PIECEWISE padding) after the PCP all-gather, and reduced with MAX over the TP and PCP groups, so
every layout of the same first batch computes the same scales: one rank's, to float rounding.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from tandem.attention.forward_context import ForwardContext

K_SCALE_CONSTANT = 200.0
V_SCALE_CONSTANT = 100.0

ReduceMax = Callable[[torch.Tensor], torch.Tensor]  # an all-reduce with MAX over the ranks running the layer


def arm(layers: Iterable[torch.nn.Module], reduce_max: ReduceMax) -> None:
    """The next forward of each layer that writes its cache computes its scales (every rank arms the same layers)."""
    for layer in layers:
        layer.kv_scale_calibration = reduce_max  # type: ignore[assignment]


def written_amax(ctx: ForwardContext, new_kv: torch.Tensor, splits: list[int],
                 reduce_max: ReduceMax) -> torch.Tensor | None:
    """new_kv [T_r, C]: this rank's new K/V (compute dtype), channels split into parts (K, V) of `splits` widths
    -> [len(splits)] the largest |value| of each part over every rank's written rows, or None when no rank wrote."""
    rows = ctx.gather_kv(new_kv)[ctx.batch.write_rows].float()  # [W, C]: the rows the batch writes, every rank's
    amax = torch.zeros(len(splits) + 1)
    if rows.shape[0]:
        amax[:-1] = torch.stack([part.abs().amax() for part in rows.split(splits, dim=-1)])
        amax[-1] = 1.0  # "this rank wrote": the MAX below tells every rank whether any did
    amax = reduce_max(amax)
    return amax[:-1] if amax[-1] > 0 else None


def calibrated(ctx: ForwardContext, new_kv: torch.Tensor, splits: list[int], constants: list[float],
               reduce_max: ReduceMax) -> list[float] | None:
    """The scales of new_kv's parts (`splits` widths; amax / the part's constant, 1.0 for an all-zero part) from
    every rank's written rows, or None when no rank wrote (the layer stays armed)."""
    amax = written_amax(ctx, new_kv, splits, reduce_max)
    if amax is None:
        return None
    return [a / c if a > 0 else 1.0 for a, c in zip(amax.tolist(), constants, strict=True)]

"""Per-layer fp8 KV cache scales computed from real activations: `calculate_kv_scales` (vLLM's option).

Armed layers compute their scales in their first forward that writes the cache, from the K/V it writes, then
store with them from that batch on (tandem/attention/kv_dtype.py folds them into the attention math):

    k_scale = amax|K| / 200,  v_scale = amax|V| / 100      (MLA: one scale, amax of the [kv_c | k_pe] entry / 200)

each rounded up to a power of two. The rounding is tandem's: dividing by a power of two is exact, so a value's fp8
code does not move with the scale's last bits, and layouts whose K/V differ in the last bit of a float32 (their
GEMMs ran at other row counts: a prompt split over 4 ranks runs its projections at a quarter of the rows, and
MKL's sgemm rounds differently by row count on some CPUs) compute the same scale. With the exact amax / 200, an
avx2 machine's PCP=4 scale differed from one rank's in the 7th digit, enough to change a tiny fp8 model's 8th
token. The first batch's largest value then lands between 100 and 200 (K) or 50 and 100 (V) of e4m3's 448.

vLLM's constants (K_SCALE_CONSTANT, V_SCALE_CONSTANT): the first batch's largest value lands at 200 (100) of
e4m3's 448 (between 100 and 200, 50 and 100 after the rounding), so later values at least 2.2x (4.5x) larger
still fit before they saturate, and small values move from
e4m3's subnormals (below 2^-6 at scale 1) into its normal range. The amax is taken over the rows the batch writes
(never PCP or PIECEWISE padding) after the PCP all-gather, and reduced with MAX over the TP and PCP groups, so
every layout of the same first batch computes the same scales: one rank's.
"""

from __future__ import annotations

import math
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
    """The scales of new_kv's parts (`splits` widths; amax / the part's constant rounded up to a power of two, 1.0 for
    an all-zero part) from every rank's written rows, or None when no rank wrote (the layer stays armed)."""
    amax = written_amax(ctx, new_kv, splits, reduce_max)
    if amax is None:
        return None
    return [2.0 ** math.ceil(math.log2(a / c)) if a > 0 else 1.0 for a, c in zip(amax.tolist(), constants, strict=True)]

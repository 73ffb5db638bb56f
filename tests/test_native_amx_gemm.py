"""The AMX bfloat16 GEMM (tandem/native/amx_gemm.cpp) for decode batches: on seeded random shapes (row counts across
its 16- and 32-row tiles, a last block of 16 columns, with and without bias) each output is the float64 product
rounded once to bf16 (up to the float32 sum's last bits at a rounding tie), a row's result does not depend on its
batch, bad shapes are refused by name, and cpu_gemm packs a weight into AMX's layout exactly where the kernel runs."""

from __future__ import annotations

import pytest
import torch

from tandem import native
from tandem.layers import cpu_gemm

pytestmark = pytest.mark.usefixtures("native_kernels")

# torch's CPU check (collecting must not build the kernels); the OS may still refuse AMX's state, which
# native.amx_available() then says and the kernel refuses by name
needs_amx = pytest.mark.skipif(not torch.cpu._is_amx_tile_supported(), reason="this CPU has no AMX (amx_gemm.cpp)")


def _bf16_ulp(x: torch.Tensor) -> torch.Tensor:
    """The spacing of bf16 values at |x| (float64)."""
    exponent = torch.floor(torch.log2(x.abs().clamp_min(2.0**-126)))
    return torch.pow(2.0, exponent - 7)


@needs_amx
@pytest.mark.parametrize("seed", range(4))
def test_amx_linear_rounds_the_float64_product_once(seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for rows in (1, 5, 16, 17, 32, 33, 64, 70, 128):
        n = int(torch.randint(1, 12, (1,), generator=g)) * 16  # odd multiples of 16: a last block of 16 columns
        k = int(torch.randint(1, 40, (1,), generator=g)) * 32
        x = torch.randn(rows, k, generator=g).bfloat16()
        w = (torch.randn(n, k, generator=g) * k**-0.5).bfloat16()
        bias = torch.randn(n, generator=g).bfloat16() if rows % 2 else None
        got = native.amx_linear(x, native.amx_pack(w), bias).double()
        want = x.double() @ w.double().T + (bias.double() if bias is not None else 0.0)
        # half a bf16 step, plus what float32 sums may lose where the terms cancel
        slack = 1e-6 * (x.double().abs() @ w.double().abs().T + (bias.double().abs() if bias is not None else 0.0))
        err = (got - want).abs()
        assert bool((err <= 0.5 * _bf16_ulp(want) + slack).all()), (rows, n, k, float(err.max()))
        assert float((got != want.bfloat16().double()).double().mean()) < 1e-2, (rows, n, k)


@needs_amx
def test_a_rows_result_does_not_depend_on_its_batch() -> None:
    g = torch.Generator().manual_seed(7)
    x = torch.randn(128, 576, generator=g).bfloat16()
    packed = native.amx_pack(torch.randn(960, 576, generator=g).bfloat16())
    full = native.amx_linear(x, packed, None)
    for rows in (1, 3, 16, 31, 40, 64, 100):
        assert torch.equal(native.amx_linear(x[:rows], packed, None), full[:rows])
    assert torch.equal(native.amx_linear(x[5:6], packed, None), full[5:6])


@needs_amx
def test_bad_shapes_are_refused_by_name() -> None:
    packed = native.amx_pack(torch.randn(32, 64).bfloat16())
    with pytest.raises(RuntimeError, match="K must be a multiple of 32"):
        native.amx_linear(torch.randn(2, 48).bfloat16(), packed, None)
    with pytest.raises(RuntimeError, match="bfloat16 x and weight only"):
        native.amx_linear(torch.randn(2, 64), packed, None)
    with pytest.raises(RuntimeError, match="bias must be"):
        native.amx_linear(torch.randn(2, 64).bfloat16(), packed, torch.zeros(31).bfloat16())


@pytest.mark.parametrize("shape", [(960, 576), (64, 40), (24, 64)])
@pytest.mark.parametrize("amx", [False, True])
def test_bf16_weights_pack_into_amxs_layout_exactly_where_it_runs(shape: tuple[int, int], amx: bool) -> None:
    """AMX's layout when asked for, on a CPU where the kernel runs, for a shape its tiles take; else oneDNN's
    (or none), and a linear on either gives the float64 product within bf16's rounding."""
    w = (torch.randn(*shape) * shape[1] ** -0.5).bfloat16()
    packed = cpu_gemm.prepack(w, amx)
    fits = amx and native.amx_available() and shape[0] % 16 == 0 and shape[1] % 32 == 0 \
        and w.numel() >= cpu_gemm.BF16_PACK_MIN_ELEMENTS
    assert (packed is not None and packed.dim() == 4) == fits
    x = torch.randn(12, shape[1]).bfloat16()
    got = cpu_gemm.linear(x, w, None, packed).double()
    want = x.double() @ w.double().T
    assert float((got - want).abs().max()) <= float(_bf16_ulp(want).max())

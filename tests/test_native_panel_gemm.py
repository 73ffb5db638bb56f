"""The bfloat16 panel GEMM (tandem/native/panel_gemm.cpp) for CPUs without bf16 dot products: on seeded random
shapes (1-130 rows across its 6-row passes and 48-row blocks, N not a multiple of 16, any K, with and without bias)
each output is the float64 product rounded once to bf16 (up to the float32 sum's last bits at a rounding tie), a
row's result does not depend on its batch, bad shapes are refused by name, and cpu_gemm packs bf16 weights into
panels exactly where oneDNN and the AMX / avx512_bf16 paths have no bf16 GEMM."""

from __future__ import annotations

import pytest
import torch

from tandem import native
from tandem.layers import cpu_gemm

pytestmark = pytest.mark.usefixtures("native_kernels")

# the kernel is written for avx2 + FMA, the native kernels' baseline on x86 (collecting must not build them)
needs_panels = pytest.mark.skipif(torch.backends.cpu.get_cpu_capability() not in native.ISA_FLAGS,
                                  reason="the native kernels are built for x86 with avx2 (panel_gemm.cpp)")


def _bf16_ulp(x: torch.Tensor) -> torch.Tensor:
    """The spacing of bf16 values at |x| (float64)."""
    exponent = torch.floor(torch.log2(x.abs().clamp_min(2.0**-126)))
    return torch.pow(2.0, exponent - 7)


def _check_rounded_once(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> None:
    got = got.double()
    want = x.double() @ w.double().T + (bias.double() if bias is not None else 0.0)
    # half a bf16 step, plus what float32 sums may lose where the terms cancel
    slack = 1e-6 * (x.double().abs() @ w.double().abs().T + (bias.double().abs() if bias is not None else 0.0))
    err = (got - want).abs()
    assert bool((err <= 0.5 * _bf16_ulp(want) + slack).all()), float(err.max())
    assert float((got != want.bfloat16().double()).double().mean()) < 1e-2


@needs_panels
@pytest.mark.parametrize("seed", range(4))
def test_panel_linear_rounds_the_float64_product_once(seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for rows in (1, 2, 3, 4, 5, 6, 7, 13, 32, 47, 48, 49, 100, 130):
        n = int(torch.randint(1, 200, (1,), generator=g))  # any N: the last panel partly padding
        k = int(torch.randint(1, 700, (1,), generator=g))
        x = torch.randn(rows, k, generator=g).bfloat16()
        w = (torch.randn(n, k, generator=g) * k**-0.5).bfloat16()
        bias = torch.randn(n, generator=g).bfloat16() if rows % 2 else None
        _check_rounded_once(native.panel_linear(x, native.panel_pack(w), n, bias), x, w, bias)


@needs_panels
def test_a_rows_result_does_not_depend_on_its_batch() -> None:
    g = torch.Generator().manual_seed(7)
    x = torch.randn(130, 576, generator=g).bfloat16()
    w = torch.randn(960, 576, generator=g).bfloat16()
    packed = native.panel_pack(w)
    full = native.panel_linear(x, packed, 960, None)
    for rows in (1, 2, 3, 4, 6, 16, 31, 48, 64, 100):
        assert torch.equal(native.panel_linear(x[:rows], packed, 960, None), full[:rows])
    for row in (5, 77, 129):
        assert torch.equal(native.panel_linear(x[row:row + 1], packed, 960, None), full[row:row + 1])


@needs_panels
def test_bad_shapes_are_refused_by_name() -> None:
    packed = native.panel_pack(torch.randn(40, 64).bfloat16())
    with pytest.raises(RuntimeError, match="x has K = 48"):
        native.panel_linear(torch.randn(2, 48).bfloat16(), packed, 40, None)
    with pytest.raises(RuntimeError, match="bfloat16 x and weight only"):
        native.panel_linear(torch.randn(2, 64), packed, 40, None)
    with pytest.raises(RuntimeError, match="N = 50 does not fit 3 panels"):
        native.panel_linear(torch.randn(2, 64).bfloat16(), packed, 50, None)
    with pytest.raises(RuntimeError, match="bias must be"):
        native.panel_linear(torch.randn(2, 64).bfloat16(), packed, 40, torch.zeros(31).bfloat16())


@pytest.mark.parametrize("shape", [(960, 576), (40, 24)])
@pytest.mark.parametrize("native_layouts", [False, True])
def test_bf16_weights_pack_into_panels_exactly_where_no_bf16_gemm_runs(shape: tuple[int, int],
                                                                      native_layouts: bool) -> None:
    """Panels when the native layouts are asked for on a CPU without bf16 dot products (avx2 machines); AMX's or
    oneDNN's layout (or none) elsewhere; a linear on any of them gives the float64 product within bf16's rounding
    at decode, verification and prompt row counts."""
    w = (torch.randn(*shape) * shape[1] ** -0.5).bfloat16()
    packed = cpu_gemm.prepack(w, native_layouts)
    no_bf16_dot = not (torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())
    panels = native_layouts and no_bf16_dot and native.panels_available()
    assert (packed is not None and packed.dim() == 3) == panels
    for rows in (1, 4, 12, 70):
        x = torch.randn(rows, shape[1]).bfloat16()
        _check_rounded_once(cpu_gemm.linear(x, w, None, packed), x, w, None)

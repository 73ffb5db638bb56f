"""The panel GEMM (tandem/native/panel_gemm.cpp): bfloat16 for CPUs without bf16 dot products, float32 for avx2
CPUs without avx512. On seeded random shapes (1-300 rows across its 6-row passes and 128-row blocks, N not a
multiple of 16, K across its L1-sized pieces, with and without bias) each bf16 output is the float64 product rounded
once (up to the float32 sum's last bits at a rounding tie) and each float32 output within a float32 chain's error of
it; a row's result does not depend on its batch; bad shapes are refused by name; cpu_gemm packs weights into panels
exactly where oneDNN has no bf16 GEMM (bf16) or the CPU has no avx512 (float32)."""

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


def _check_float32(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> None:
    """Within what a float32 FMA chain over k can lose: k float32 roundings of the running sum's magnitude."""
    want = x.double() @ w.double().T + (bias.double() if bias is not None else 0.0)
    bound = (x.shape[1] + 2) * 2.0**-24 * (x.double().abs() @ w.double().abs().T
                                           + (bias.double().abs() if bias is not None else 0.0))
    err = (got.double() - want).abs()
    assert bool((err <= bound + 1e-30).all()), float((err / (bound + 1e-30)).max())
    assert float(err.max()) < 1e-4  # the bound above is loose; the sums land far inside it


@needs_panels
@pytest.mark.parametrize("seed", range(3))
def test_float32_panel_linear_matches_the_float64_product(seed: int) -> None:
    g = torch.Generator().manual_seed(100 + seed)
    for rows in (1, 2, 3, 4, 5, 7, 8, 9, 13, 32, 127, 128, 129, 300):
        n = int(torch.randint(1, 200, (1,), generator=g))
        k = int(torch.randint(1, 1600, (1,), generator=g))  # up to 7 pieces of K (256 float32 steps each)
        x = torch.randn(rows, k, generator=g)
        w = torch.randn(n, k, generator=g) * k**-0.5
        bias = torch.randn(n, generator=g) if rows % 2 else None
        got = native.panel_linear(x, native.panel_pack(w), n, bias)
        assert got.dtype == torch.float32 and got.shape == (rows, n)
        _check_float32(got, x, w, bias)


@needs_panels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_rows_result_does_not_depend_on_its_batch(dtype: torch.dtype) -> None:
    """Greedy verification of K + 1 rows a request gives its decode's bits: every row count, across the 6-row
    passes, the 7-9-row splits and the 128-row blocks, at a K of several pieces."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(300, 1536, generator=g).to(dtype)
    w = torch.randn(960, 1536, generator=g).to(dtype)
    packed = native.panel_pack(w)
    full = native.panel_linear(x, packed, 960, None)
    for rows in (1, 2, 3, 4, 6, 7, 8, 9, 16, 31, 48, 64, 100, 128, 129, 200):
        assert torch.equal(native.panel_linear(x[:rows], packed, 960, None), full[:rows])
    for row in (5, 77, 129, 299):
        assert torch.equal(native.panel_linear(x[row:row + 1], packed, 960, None), full[row:row + 1])
    wide = torch.cat([x, torch.randn(300, 64, generator=g).to(dtype)], dim=1)  # rows 1,600 apart in memory
    for rows in (1, 4, 300):
        assert torch.equal(native.panel_linear(wide[:rows, :1536], packed, 960, None), full[:rows])


@needs_panels
def test_bad_shapes_are_refused_by_name() -> None:
    packed = native.panel_pack(torch.randn(40, 64).bfloat16())
    with pytest.raises(RuntimeError, match="x has K = 48"):
        native.panel_linear(torch.randn(2, 48).bfloat16(), packed, 40, None)
    with pytest.raises(RuntimeError, match="bfloat16 or float32 x and weight of one dtype"):
        native.panel_linear(torch.randn(2, 64), packed, 40, None)
    with pytest.raises(RuntimeError, match="bfloat16 or float32 x and weight of one dtype"):
        native.panel_linear(torch.randn(2, 64).half(), native.panel_pack(torch.randn(40, 64)).half(), 40, None)
    with pytest.raises(RuntimeError, match="N = 50 does not fit 3 panels"):
        native.panel_linear(torch.randn(2, 64).bfloat16(), packed, 50, None)
    with pytest.raises(ValueError, match="panel_pack: a bfloat16 or float32"):
        native.panel_pack(torch.randn(40, 64).half())
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


@pytest.mark.parametrize("shape", [(960, 576), (40, 24)])
@pytest.mark.parametrize("native_layouts", [False, True])
def test_float32_weights_pack_into_panels_exactly_on_avx2_without_avx512(shape: tuple[int, int],
                                                                         native_layouts: bool) -> None:
    """Panels when the native layouts are asked for on an avx2 CPU without avx512; oneDNN's layout (or none)
    elsewhere; a linear on either gives the float64 product within float32's error at decode, verification, batch
    and prompt row counts (prompt rows past FP32_PANEL_MAX_ROWS on F.linear)."""
    w = torch.randn(*shape) * shape[1] ** -0.5
    packed = cpu_gemm.prepack(w, native_layouts)
    panels = native_layouts and torch.backends.cpu.get_cpu_capability() == "AVX2" and native.panels_available()
    assert (packed is not None and packed.dim() == 3) == panels
    for rows in (1, 4, 12, 70, cpu_gemm.FP32_PANEL_MAX_ROWS + 3):
        x = torch.randn(rows, shape[1])
        _check_float32(cpu_gemm.linear(x, w, None, packed), x, w, None)

"""The native small-row GEMM (tandem/native/small_gemm.cpp) and its routing in cpu_gemm.linear: float32 results to
rounding against a float64 reference, odd shapes (weight rows not a multiple of 4, K not a multiple of 16), strided
rows, bias, a row's result independent of the batch it runs in, bad inputs refused, and the layers' rule (few rows
native, in compiled pieces too; more rows and bf16 / autograd callers on the PyTorch path)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tandem import native
from tandem.layers import cpu_gemm

pytestmark = pytest.mark.usefixtures("native_kernels")


def _reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    y = x.double() @ w.double().t()
    return (y if b is None else y + b.double()).float()


@pytest.mark.parametrize("n, k", [(1, 1), (3, 15), (4, 16), (7, 33), (61, 256), (576, 256), (130, 1000)])
def test_small_linear_matches_a_float64_reference(n: int, k: int) -> None:
    gen = torch.Generator().manual_seed(n * 1000 + k)
    w = torch.randn(n, k, generator=gen)
    b = torch.randn(n, generator=gen)
    for rows in (1, 2, 3, 4, 5, 8, 13, 16):
        x = torch.randn(rows, k, generator=gen)
        for bias in (None, b):
            got = native.small_linear(x, w, bias)
            assert got.shape == (rows, n) and got.is_contiguous()
            torch.testing.assert_close(got, _reference(x, w, bias), rtol=1e-5, atol=1e-5 * k**0.5)


def test_a_rows_result_does_not_depend_on_its_batch() -> None:
    """Each output is one dot product in a fixed order: row i alone, or among 1..16 rows, or over a strided view,
    gives the same bits (speculative verification runs K + 1 rows where a decode runs one)."""
    gen = torch.Generator().manual_seed(7)
    w = torch.randn(333, 200, generator=gen)
    x = torch.randn(16, 200, generator=gen)
    alone = torch.cat([native.small_linear(x[i:i + 1], w, None) for i in range(16)])
    for rows in (2, 3, 4, 7, 16):
        assert torch.equal(native.small_linear(x[:rows], w, None), alone[:rows])
    wide = torch.randn(16, 260, generator=gen)
    wide[:, 30:230] = x
    assert torch.equal(native.small_linear(wide[:, 30:230], w, None), alone)


BF16_PATHS = [0] + ([1] if torch.cpu._is_avx512_bf16_supported() else [])  # widening; avx512_bf16 dot products


@pytest.mark.parametrize("isa", BF16_PATHS)
@pytest.mark.parametrize("n, k", [(1, 1), (3, 15), (7, 33), (61, 256), (130, 1000), (576, 576)])
def test_bf16_small_linear_rounds_the_float64_result_once(isa: int, n: int, k: int) -> None:
    """bfloat16 x and weight (K not a multiple of 16 or 32: the tails), float32 sums, one rounding to bf16: within
    one bf16 step of the float64 result (a float32 sum's own error is far below it)."""
    gen = torch.Generator().manual_seed(n * 7 + k)
    w, b = torch.randn(n, k, generator=gen).bfloat16(), torch.randn(n, generator=gen).bfloat16()
    for rows in (1, 2, 3, 4, 5, 16):
        x = torch.randn(rows, k, generator=gen).bfloat16()
        for bias in (None, b):
            got = torch.ops.tandem_native.small_linear_isa(x, w, bias, isa)
            assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
            ref = x.double() @ w.double().t() + (0 if bias is None else bias.double())
            step = ref.abs().clamp(min=1e-3) * 2.0**-8  # one bf16 rounding, plus float32 sums at small values
            assert ((got.double() - ref).abs() <= step + 1e-4 * k**0.5).all(), (rows, bias is None)


@pytest.mark.parametrize("isa", BF16_PATHS)
def test_bf16_rows_result_does_not_depend_on_its_batch(isa: int) -> None:
    gen = torch.Generator().manual_seed(8)
    w = torch.randn(333, 200, generator=gen).bfloat16()
    x = torch.randn(16, 200, generator=gen).bfloat16()
    alone = torch.cat([torch.ops.tandem_native.small_linear_isa(x[i:i + 1], w, None, isa) for i in range(16)])
    for rows in (2, 3, 4, 7, 16):
        assert torch.equal(torch.ops.tandem_native.small_linear_isa(x[:rows], w, None, isa), alone[:rows])


def test_bf16_paths_refuse_what_they_cannot_run() -> None:
    w = torch.randn(8, 32).bfloat16()
    with pytest.raises(RuntimeError, match="one dtype"):
        native.small_linear(torch.randn(2, 32), w, None)
    with pytest.raises(RuntimeError, match="isa is -1"):
        torch.ops.tandem_native.small_linear_isa(torch.randn(2, 32).bfloat16(), w, None, 2)
    if not torch.cpu._is_avx512_bf16_supported():
        with pytest.raises(RuntimeError, match="no avx512_bf16"):
            torch.ops.tandem_native.small_linear_isa(torch.randn(2, 32).bfloat16(), w, None, 1)


def test_small_linear_refuses_bad_inputs() -> None:
    w = torch.randn(8, 32)
    with pytest.raises(RuntimeError, match="at most 16 rows"):
        native.small_linear(torch.randn(17, 32), w, None)
    with pytest.raises(RuntimeError, match="share K"):
        native.small_linear(torch.randn(2, 31), w, None)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        native.small_linear(torch.randn(2, 32, dtype=torch.float64), w.double(), None)
    with pytest.raises(RuntimeError, match="contiguous"):
        native.small_linear(torch.randn(2, 32), torch.randn(32, 8).t(), None)
    with pytest.raises(RuntimeError, match="bias"):
        native.small_linear(torch.randn(2, 32), w, torch.randn(7))
    assert native.small_linear(torch.randn(0, 32), w, None).shape == (0, 8)


def test_cpu_gemm_routes_few_rows_native_and_the_rest_to_pytorch(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[int, ...]] = []
    real = native.small_linear

    def spy(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        calls.append(tuple(x.shape))
        return real(x, w, b)

    monkeypatch.setattr(native, "small_linear", spy)
    gen = torch.Generator().manual_seed(3)
    w, b = torch.randn(96, 64, generator=gen), torch.randn(96, generator=gen)
    for shape in ((1, 64), (2, 3, 64), (16, 64), (17, 64), (40, 64)):
        x = torch.randn(*shape, generator=gen)
        calls.clear()
        got = cpu_gemm.linear(x, w, b, None)
        assert got.shape == (*shape[:-1], 96)
        torch.testing.assert_close(got, F.linear(x, w, b), rtol=1e-5, atol=1e-5)
        rows = x.numel() // 64
        assert calls == ([(rows, 64)] if rows <= cpu_gemm.SMALL_ROWS else []), shape
    w_big = torch.randn(1024, 256, generator=gen)
    packed = cpu_gemm.prepack(w_big)  # oneDNN's layout (where oneDNN runs here): only a few rows go native
    if packed is not None:
        for rows in (cpu_gemm.SMALL_ROWS_PACKED, cpu_gemm.SMALL_ROWS_PACKED + 1):
            calls.clear()
            x = torch.randn(rows, 256, generator=gen)
            torch.testing.assert_close(cpu_gemm.linear(x, w_big, None, packed), F.linear(x, w_big),
                                       rtol=1e-4, atol=1e-4)
            assert len(calls) == (rows <= cpu_gemm.SMALL_ROWS_PACKED)
    # bfloat16: up to cpu_gemm.SMALL_ROWS_BF16 rows native (4 with bf16 dot products, else 1), more on oneDNN / F.linear
    for rows in (1, cpu_gemm.SMALL_ROWS_BF16, cpu_gemm.SMALL_ROWS_BF16 + 1):
        calls.clear()
        x = torch.randn(rows, 64, generator=gen).bfloat16()
        got = cpu_gemm.linear(x, w.bfloat16(), b.bfloat16(), None)
        torch.testing.assert_close(got.float(), F.linear(x.float(), w.bfloat16().float(), b.bfloat16().float()),
                                   rtol=1e-2, atol=1e-2)
        assert len(calls) == (rows <= cpu_gemm.SMALL_ROWS_BF16)
    # an LM-head-sized weight (past SMALL_MAX_ELEMENTS, lowered here to this test's w_big) goes native only up to
    # SMALL_ROWS_BIG rows, whatever its dtype's own limit
    monkeypatch.setattr(cpu_gemm, "SMALL_MAX_ELEMENTS", w_big.numel() - 1)
    for rows in (1, cpu_gemm.SMALL_ROWS_BIG, cpu_gemm.SMALL_ROWS_BIG + 1):
        calls.clear()
        x = torch.randn(rows, 256, generator=gen)
        torch.testing.assert_close(cpu_gemm.linear(x, w_big, None, None), F.linear(x, w_big), rtol=1e-4, atol=1e-4)
        assert len(calls) == (rows <= cpu_gemm.SMALL_ROWS_BIG), rows
    # callers the kernel does not serve: float64, autograd, a non-contiguous weight
    calls.clear()
    cpu_gemm.linear(torch.randn(1, 64, dtype=torch.float64), w.double(), None, None)
    cpu_gemm.linear(torch.randn(2, 64, requires_grad=True), w, None, None)
    cpu_gemm.linear(torch.randn(2, 96), w.t(), None, None)
    assert calls == []


def test_compiled_pieces_call_the_small_row_gemm() -> None:
    """Inside torch.compile the same rule holds: few rows run the native kernel (an opaque op between inductor's
    kernels, with the same bits as eagerly), more rows run inductor's own GEMM; a weight that eager mode would pack
    goes native only up to SMALL_ROWS_PACKED rows."""
    from torch.profiler import ProfilerActivity, profile

    gen = torch.Generator().manual_seed(4)
    w_small, w_big = torch.randn(96, 64, generator=gen), torch.randn(1024, 256, generator=gen)
    assert w_small.numel() < cpu_gemm.PACK_MIN_ELEMENTS <= w_big.numel()

    def layer(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return torch.relu(cpu_gemm.linear(x, w, None, None)) * 2

    torch._dynamo.reset()  # a fresh cache: earlier tests' graphs in this process must not count toward its limits
    native.prepare_for_tracing()  # as tandem/compilation does before it compiles
    compiled = torch.compile(layer, dynamic=True)
    for w, limit in ((w_small, cpu_gemm.SMALL_ROWS), (w_big, cpu_gemm.SMALL_ROWS_PACKED)):
        for rows in (1, 2, limit, limit + 1, 40):
            x = torch.randn(rows, w.shape[1], generator=gen)
            compiled(x, w)  # compile outside the profile
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                got = compiled(x, w)
            native_calls = sum(e.count for e in prof.key_averages() if e.key == "tandem_native::small_linear")
            assert native_calls == (1 if rows <= limit else 0), (tuple(w.shape), rows)
            if rows <= limit:  # the kernel's bits, as eagerly
                assert torch.equal(got, torch.relu(native.small_linear(x, w, None)) * 2)
            else:
                torch.testing.assert_close(got, layer(x, w), rtol=1e-4, atol=1e-4)

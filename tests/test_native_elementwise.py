"""The native CPU elementwise kernels (tandem/native/elementwise.cpp) against the PyTorch formulas they replace:
rotary and the residual add to the bit, RMSNorm and silu(gate) * up to float32 rounding; in bfloat16 the same
formulas on bf16 tensors (Hugging Face's roundings): rotary to the bit, RMSNorm and SwiGLU to the bit but where the
float32 value before the last rounding sits within a few ulps of a bf16 rounding boundary; strided views, partial
rotary, both rotary layouts, odd widths, bad inputs refused with a clear error."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tandem import native
from tandem.layers.activation import silu_and_mul
from tandem.layers.rotary import RotaryEmbedding

pytestmark = pytest.mark.usefixtures("native_kernels")


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("rotary_dim, head_dim", [(64, 64), (32, 64), (16, 72)])
def test_rotary_is_the_pytorch_formula_to_the_bit(interleaved: bool, rotary_dim: int, head_dim: int) -> None:
    gen = torch.Generator().manual_seed(rotary_dim + head_dim + interleaved)
    rope = RotaryEmbedding(rotary_dim, 4096, 10000.0, {"rope_type": "yarn", "factor": 4.0,
                                                         "original_max_position_embeddings": 1024},
                           interleaved=interleaved)
    for tokens in (1, 7, 300):
        positions = torch.randint(0, 4096, (tokens,), generator=gen)
        qkv = torch.randn(tokens, 7 * head_dim + 5, generator=gen)
        heads = qkv[:, : 6 * head_dim].view(tokens, 6, head_dim)  # q and k inside a fused projection's output
        (got,) = rope(positions, heads)
        cos = rope.cos_cache[positions].unsqueeze(1)
        sin = rope.sin_cache[positions].unsqueeze(1)
        assert got.shape == heads.shape
        assert torch.equal(got, rope._rotate(heads, cos, sin)), (tokens, rotary_dim, head_dim)
        assert not torch.equal(got, heads)


def test_rotary_refuses_positions_outside_its_table() -> None:
    rope = RotaryEmbedding(64, 128, 10000.0)
    x = torch.randn(3, 2, 64)
    for bad in (128, -1, 10**12):
        with pytest.raises(RuntimeError, match="outside"):
            native.rotary(x, torch.tensor([0, bad, 1]), rope.cos_cache, rope.sin_cache, 64, False)
    with pytest.raises(RuntimeError, match="rotary_dim"):
        native.rotary(x, torch.tensor([0, 1, 2]), rope.cos_cache, rope.sin_cache, 66, False)


@pytest.mark.parametrize("inner", [1, 15, 16, 33, 1536])
def test_silu_and_mul_matches_pytorch_to_float32_rounding(inner: int) -> None:
    gen = torch.Generator().manual_seed(inner)
    for rows in (1, 5, 64):
        gate_up = torch.randn(rows, 2 * inner, generator=gen) * 6
        gate_up[0, 0] = -200.0  # exp overflow territory: silu -> -0, not nan
        gate_up[-1, 0] = 200.0
        got = silu_and_mul(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        want = F.silu(gate) * up
        assert got.shape == (rows, inner) and torch.isfinite(got).all()
        torch.testing.assert_close(got, want, rtol=2e-6, atol=1e-6)
    strided = torch.randn(9, 2 * inner + 3, generator=gen)[:, 3:]
    gate, up = strided.chunk(2, dim=-1)
    torch.testing.assert_close(silu_and_mul(strided), F.silu(gate) * up, rtol=2e-6, atol=1e-6)


def test_norm_of_heads_and_bad_weights() -> None:
    # qk-norm normalises [T, heads, head_dim] views
    from tandem.layers.norm import RMSNorm

    gen = torch.Generator().manual_seed(3)
    norm = RMSNorm(64, eps=1e-5)
    norm.weight.data.copy_(torch.randn(64, generator=gen))
    x = torch.randn(11, 5 * 64 + 64, generator=gen)[:, :320].view(11, 5, 64)
    want = norm.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5))
    got = norm(x)
    assert got.shape == (11, 5, 64)
    torch.testing.assert_close(got, want, rtol=2e-6, atol=1e-7)
    with pytest.raises(RuntimeError, match="weight must be float32"):
        native.rms_norm(torch.randn(2, 64), torch.ones(32), 1e-6)
    with pytest.raises(RuntimeError, match="weight must be bfloat16"):
        native.rms_norm(torch.randn(2, 64).bfloat16(), torch.ones(64), 1e-6)
    with pytest.raises(RuntimeError, match="float32 or bfloat16 CPU"):
        native.rms_norm(torch.randn(2, 64).double(), torch.ones(64), 1e-6)


def test_the_pytorch_paths_serve_when_the_kernels_are_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(native._state, "ok", False)
    calls = []
    monkeypatch.setattr(native, "silu_and_mul", lambda x: calls.append(x))
    gate_up = torch.randn(4, 8)
    gate, up = gate_up.chunk(2, dim=-1)
    assert torch.equal(silu_and_mul(gate_up), F.silu(gate) * up) and not calls
    assert not native.serves(gate_up)
    monkeypatch.setitem(native._state, "ok", True)
    assert native.serves(gate_up) and not native.serves(gate_up.bfloat16())


@pytest.mark.parametrize("vocab", [1, 15, 16, 17, 2048, 49152])
def test_argmax_is_torch_argmax_ties_nans_and_infinities_included(vocab: int) -> None:
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(40, vocab, generator=gen)
    logits[1] = 0.5  # every entry tied: the first index
    logits[2] = float("-inf")
    if vocab > 3:
        logits[3, vocab // 2] = logits[3, vocab - 1] = 1e6  # a tie between two maxima: the first
        logits[4, vocab // 3] = float("nan")  # NaN wins, the first one
        logits[4, vocab - 1] = float("nan")
        logits[5, vocab - 1] = float("inf")
        logits[6] = torch.randint(0, 3, (vocab,), generator=gen).float()  # many ties
    for x in (logits, torch.randn(7, vocab + 9, generator=gen)[:, 9:]):  # rows strided
        assert torch.equal(native.argmax(x), x.argmax(dim=-1)), vocab
        assert torch.equal(native.greedy_tokens(x), x.argmax(dim=-1))
    assert native.argmax(logits[:0]).shape == (0,)


def test_tensors_that_carry_gradients_take_the_pytorch_formulas() -> None:
    # the kernels have no backward: training (tandem/train) must differentiate through the PyTorch ops
    from tandem.layers.norm import RMSNorm

    norm = RMSNorm(32)
    x = torch.randn(4, 32, requires_grad=True)
    norm(x).sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()
    norm.weight.requires_grad_(True)
    y = torch.randn(4, 32)
    assert not native.serves(y, norm.weight) and native.serves(y)
    norm(y).sum().backward()
    assert norm.weight.grad is not None and norm.weight.grad.abs().sum() > 0
    gate_up = torch.randn(3, 16, requires_grad=True)
    silu_and_mul(gate_up).sum().backward()
    assert gate_up.grad is not None and gate_up.grad.abs().sum() > 0
    with torch.no_grad():
        assert native.serves(gate_up)


def _bf16_ulps_apart(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """|a - b| in bf16 ulps of b (same-sign finite values: the distance of their bit patterns)."""
    assert a.dtype == b.dtype == torch.bfloat16
    return (a.view(torch.int16).int() - b.view(torch.int16).int()).abs()


def _assert_bf16_rounding_of(got: torch.Tensor, want: torch.Tensor, min_equal: float) -> None:
    # The kernel and PyTorch reach the same float32 value up to a few ulps (sum order, exp), then both round to bf16:
    # only a value within those ulps of a rounding boundary can round the other way, and then by one bf16 ulp.
    assert got.shape == want.shape and got.dtype == want.dtype == torch.bfloat16
    equal = (got == want) | (got.isnan() & want.isnan())
    assert equal.float().mean() >= min_equal, equal.float().mean()
    if not equal.all():
        assert int(_bf16_ulps_apart(got[~equal], want[~equal]).max()) <= 1


@pytest.mark.parametrize("hidden", [64, 576, 100, 7])
def test_bf16_rms_norm_and_residual_add_round_as_hugging_face(hidden: int,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    from tandem.layers.norm import RMSNorm

    monkeypatch.setattr(native, "DEFAULT_SERVING", native.Serving(torch.bfloat16))
    gen = torch.Generator().manual_seed(hidden)
    norm = RMSNorm(hidden, eps=1e-5).bfloat16()
    norm.weight.data.copy_(torch.randn(hidden, generator=gen))
    for rows in (1, 3, 300):
        x = (torch.randn(rows, hidden + 3, generator=gen) * 4)[:, 3:].bfloat16()  # strided rows
        residual = (torch.randn(rows, hidden, generator=gen) * 20).bfloat16()
        h = x.float()
        hf = norm.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5)).to(torch.bfloat16)
        _assert_bf16_rounding_of(norm(x), hf, 0.99)
        normed, summed = norm.add_residual(x, residual)
        assert torch.equal(summed, residual + x)  # the add to the bit
        assert torch.equal(normed, norm(summed))  # and the norm of its rounded sum
        f32 = RMSNorm(hidden, eps=1e-5)
        f32.weight.data.copy_(norm.weight.float())
        xf, rf = x.float(), residual.float()
        normed_f, summed_f = f32.add_residual(xf, rf)
        assert torch.equal(summed_f, rf + xf)
        torch.testing.assert_close(normed_f, f32.weight * (summed_f * torch.rsqrt(
            summed_f.pow(2).mean(-1, keepdim=True) + 1e-5)), rtol=2e-6, atol=1e-6)
    with pytest.raises(RuntimeError, match="one dtype"):
        native.add_rms_norm(x, residual.float(), norm.weight, 1e-5)


@pytest.mark.parametrize("inner", [1, 15, 16, 33, 1536])
def test_bf16_silu_and_mul_rounds_as_pytorch(inner: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(native, "DEFAULT_SERVING", native.Serving(torch.bfloat16))
    gen = torch.Generator().manual_seed(inner)
    for rows in (1, 5, 64):
        gate_up = (torch.randn(rows, 2 * inner, generator=gen) * 6).bfloat16()
        gate_up[0, 0] = -200.0
        gate_up[-1, 0] = 200.0
        gate, up = gate_up.chunk(2, dim=-1)
        got = silu_and_mul(gate_up)
        assert torch.isfinite(got).all()
        _assert_bf16_rounding_of(got, F.silu(gate) * up, 0.99 if rows * inner > 100 else 0.9)


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("rotary_dim, head_dim", [(64, 64), (32, 64), (16, 72), (40, 40)])
def test_bf16_rotary_is_the_pytorch_formula_to_the_bit(interleaved: bool, rotary_dim: int, head_dim: int,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(native, "DEFAULT_SERVING", native.Serving(torch.bfloat16))
    gen = torch.Generator().manual_seed(rotary_dim + head_dim + interleaved)
    rope = RotaryEmbedding(rotary_dim, 4096, 10000.0, interleaved=interleaved)
    for tokens in (1, 7, 300):
        positions = torch.randint(0, 4096, (tokens,), generator=gen)
        qkv = (torch.randn(tokens, 7 * head_dim + 5, generator=gen) * 3).bfloat16()
        heads = qkv[:, : 6 * head_dim].view(tokens, 6, head_dim)
        (got,) = rope(positions, heads)
        cos = rope.cos_cache[positions].unsqueeze(1).bfloat16()  # the activations' dtype, as Hugging Face casts
        sin = rope.sin_cache[positions].unsqueeze(1).bfloat16()
        assert got.dtype == torch.bfloat16 and torch.equal(got, rope._rotate(heads, cos, sin)), tokens

"""The fused CPU fast paths give the same bits as the ops they replace (so HF parity is unchanged)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tandem.attention.metadata import gather_rows, select_rows
from tandem.layers.moe import FusedMoE
from tandem.layers.norm import RMSNorm


def hf_rms_norm(weight: torch.Tensor, x: torch.Tensor, eps: float) -> torch.Tensor:
    # transformers' LlamaRMSNorm / DeepseekV3RMSNorm forward
    dtype = x.dtype
    x32 = x.to(torch.float32)
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(dtype)


NORM_SHAPES = ((1, 256), (3, 128), (32, 576), (70, 512), (5, 2048), (4, 100))


@pytest.mark.usefixtures("without_native_kernels")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_matches_hf_bit_for_bit(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    for rows, hidden in NORM_SHAPES:
        norm = RMSNorm(hidden, eps=1e-6).to(dtype)
        norm.weight.data.copy_(torch.randn(hidden, generator=gen).to(dtype))
        x = (torch.randn(rows, hidden, generator=gen) * 3).to(dtype)
        assert torch.equal(norm(x), hf_rms_norm(norm.weight, x, 1e-6)), (rows, hidden, dtype)


@pytest.mark.usefixtures("native_kernels")
def test_native_rms_norm_matches_hf_to_float32_rounding() -> None:
    # the native kernel sums the squares in another order: a few float32 ulps from HF, never more; bf16 models keep
    # the bit-exact path above
    gen = torch.Generator().manual_seed(1)
    for rows, hidden in NORM_SHAPES:
        norm = RMSNorm(hidden, eps=1e-6)
        norm.weight.data.copy_(torch.randn(hidden, generator=gen))
        x = torch.randn(rows, hidden, generator=gen) * 3
        got, want = norm(x), hf_rms_norm(norm.weight, x, 1e-6)
        assert not torch.equal(got, torch.zeros_like(got))
        torch.testing.assert_close(got, want, rtol=2e-6, atol=1e-7)
        strided = torch.randn(rows, 2 * hidden, generator=gen)[:, :hidden]  # a view whose rows are strided
        torch.testing.assert_close(norm(strided), hf_rms_norm(norm.weight, strided, 1e-6), rtol=2e-6, atol=1e-7)


def test_select_rows_equals_index_select() -> None:
    cache = torch.randn(500, 1, 576)  # MLA's latent cache seen as one KV head
    idx = torch.randint(0, 500, (37,))
    assert torch.equal(select_rows(cache, idx), cache.index_select(0, idx))
    strided = torch.randn(500, 2, 3, 8)[:, 1]  # not contiguous: no 2-D view, same rows
    assert torch.equal(select_rows(strided, idx), strided.index_select(0, idx))
    assert torch.equal(gather_rows(cache, idx.view(1, 37)), cache[idx.view(1, 37)])


def test_gathered_experts_on_cpu_match_the_batched_gather() -> None:
    # one decode token's routed pairs run on the experts' weights in place: the same outputs as copying the
    # experts out and running one batched matmul (what the path does off the CPU)
    torch.manual_seed(0)
    moe = FusedMoE(num_experts=8, hidden_size=64, intermediate_size=32)
    moe.w13_weight.data.normal_()
    moe.w2_weight.data.normal_()
    x = torch.randn(1, 64)
    ids = torch.tensor([[6, 2]])
    w = torch.tensor([[0.7, 0.3]])
    ref = sum(F.linear(F.silu(F.linear(x, moe.w13_weight[e])[:, :32]) * F.linear(x, moe.w13_weight[e])[:, 32:],
                       moe.w2_weight[e]) * w[0, j] for j, e in enumerate((6, 2)))
    torch.testing.assert_close(moe._gathered_experts(x, w, ids), ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(moe._gathered_experts(x, w, ids), moe._looped_experts(x, w, ids))


def test_interleaved_rotary_complex_path_is_the_real_formula() -> None:
    from tandem.layers.rotary import RotaryEmbedding

    rope = RotaryEmbedding(64, 4096, 10000.0, interleaved=True)
    gen = torch.Generator().manual_seed(1)
    positions = torch.randint(0, 4096, (37,), generator=gen)
    q = torch.randn(37, 4, 96, generator=gen)[..., 32:]  # a strided view, as MLA's q_pe is
    k = torch.randn(37, 1, 64, generator=gen)
    got = rope(positions, q, k)
    cos = rope.cos_cache[positions].unsqueeze(1)
    sin = rope.sin_cache[positions].unsqueeze(1)
    for x, y in zip((q, k), got, strict=True):
        assert torch.equal(y, rope._rotate(x, cos, sin))
    odd = torch.randn(37, 4, 65, generator=gen)[..., 1:]  # odd offset: no complex view, the real formula
    assert torch.equal(rope(positions, odd)[0], rope._rotate(odd, cos, sin))


@pytest.mark.parametrize("queries", [1, 4])
def test_bf16_gqa_head_major_matmuls_are_as_close_as_sdpa(queries: int) -> None:
    """The bf16 few-query GQA path (matmuls over a head-major K/V copy) against float64: masked keys get no weight,
    and its error is of SDPA's order (both round to bf16; the matmul path rounds the scores too)."""
    from tandem.attention.backends import prefix

    assert torch.bfloat16 in prefix.HEAD_MAJOR_DTYPES
    gen = torch.Generator().manual_seed(queries)
    G, S, hkv, r, D = prefix.HEAD_MAJOR_MIN_ROWS, 40, 3, 3, 64  # the fewest rows the path takes
    q = torch.randn(G, queries, hkv * r, D, generator=gen).bfloat16()
    k = torch.randn(G, S, hkv, D, generator=gen).bfloat16()
    v = torch.randn(G, S, hkv, D, generator=gen).bfloat16()
    # rows padded to S keys (the last `queries` keys are new): one full row, row 1 of 7 keys, the rest at random
    lengths = torch.cat([torch.tensor([40, 7]), torch.randint(1 + queries, S + 1, (G - 2,), generator=gen)])
    pos = torch.arange(S)
    own = lengths[:, None, None] - queries + torch.arange(queries)[None, :, None]  # [G, Q, 1]: each query's last key
    mask = (pos[None, None, :] <= own)[:, None]  # [G, 1, Q, S], True = attended
    got = prefix.grouped_sdpa(q, k, v, mask, D**-0.5, ~mask)
    prefix.HEAD_MAJOR_DTYPES, saved = (), prefix.HEAD_MAJOR_DTYPES
    try:
        sdpa = prefix.grouped_sdpa(q, k, v, mask, D**-0.5, ~mask)
    finally:
        prefix.HEAD_MAJOR_DTYPES = saved
    ref = prefix.grouped_sdpa(q.double(), k.double(), v.double(), mask, D**-0.5, ~mask)
    assert got.dtype == torch.bfloat16 and got.shape == (G, queries, hkv * r, D)
    err, sdpa_err = (got.double() - ref).abs().max().item(), (sdpa.double() - ref).abs().max().item()
    assert err < 0.05 and err < 4 * sdpa_err + 1e-3, f"head-major {err:.4f} vs SDPA {sdpa_err:.4f}"
    k2 = k.clone()
    k2[1, 7:] = 1e4  # keys past row 1's length: masked, so they change nothing
    assert torch.equal(prefix.grouped_sdpa(q, k2, v, mask, D**-0.5, ~mask)[1], got[1])
    assert not torch.equal(got, sdpa), "the path was taken"
    few = prefix.grouped_sdpa(q[:4], k[:4], v[:4], mask[:4], D**-0.5, ~mask[:4])  # under the row bound: SDPA
    assert torch.equal(few, sdpa[:4])


def test_bf16_packs_small_weights_only_with_bf16_dot_products() -> None:
    from tandem.layers import cpu_gemm

    w = (torch.randn(384, 576) / 24).bfloat16()  # under PACK_MIN_ELEMENTS: float32's rule leaves it unpacked
    assert w.numel() < cpu_gemm.PACK_MIN_ELEMENTS
    packed = cpu_gemm.prepack(w)
    native = cpu_gemm._CPU_HAS_BF16_DOT and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    assert (packed is not None) == native, "a small bf16 weight packs exactly where the CPU has bf16 dot products"
    assert cpu_gemm.prepack(w.float()) is None
    for rows in (1, 3, 32):
        x = torch.randn(rows, 576).bfloat16()
        got = cpu_gemm.linear(x, w, None, packed)
        assert got.shape == (rows, 384)
        torch.testing.assert_close(got.float(), F.linear(x.float(), w.float()), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_small_matmul_equals_matmul(dtype: torch.dtype) -> None:
    """A batch of one as a 2-D mm (bf16) reads the cache's transposed keys in place; shapes and values are matmul's."""
    from tandem.attention.backends.prefix import small_matmul

    gen = torch.Generator().manual_seed(3)
    q = torch.randn(1, 1, 16, 576, generator=gen).to(dtype)  # [G, Hkv, r * Q, D]
    cache = torch.randn(300, 1, 576, generator=gen).to(dtype)  # [slots, Hkv, D]
    keys = cache[40:240].permute(1, 2, 0)[None]  # [1, 1, D, S], a strided view of the cache
    probs = torch.randn(1, 16, 200, generator=gen).to(dtype)
    for a, b in ((q, keys), (q[0], keys[0]), (probs, cache[40:240, :, :512].transpose(0, 1))):
        got, ref = small_matmul(a, b), torch.matmul(a, b)
        assert got.shape == ref.shape and got.dtype == dtype
        if dtype == torch.float32:
            assert torch.equal(got, ref), "float32 keeps torch.matmul"
        else:
            exact = torch.matmul(a.double(), b.double())
            assert (got.double() - exact).abs().max() <= 2 * (ref.double() - exact).abs().max() + 1e-2
    many = torch.randn(3, 1, 16, 576).to(dtype)  # a batch of three: torch.matmul
    assert torch.equal(small_matmul(many, keys), torch.matmul(many, keys))

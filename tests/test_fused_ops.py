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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_matches_hf_bit_for_bit(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    for rows, hidden in ((1, 256), (3, 128), (32, 576), (70, 512), (5, 2048)):
        norm = RMSNorm(hidden, eps=1e-6).to(dtype)
        norm.weight.data.copy_(torch.randn(hidden, generator=gen).to(dtype))
        x = (torch.randn(rows, hidden, generator=gen) * 3).to(dtype)
        assert torch.equal(norm(x), hf_rms_norm(norm.weight, x, 1e-6)), (rows, hidden, dtype)


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

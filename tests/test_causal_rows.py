"""The long-row attention pieces: LSE merging of attentions over disjoint key sets equals attention over their
union (random splits, within 1e-5), the CPU flash path's LSE equals explicit scores, and a long row attended as
prefix + causal diagonal equals one masked SDPA, for MHA, GQA and MQA (MLA's absorbed form) head layouts."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tandem.attention.causal_rows import (
    attention_with_lse,
    causal_row_attention,
    math_attention_with_lse,
    merge_attn_states,
)


@pytest.mark.parametrize("seed", range(8))
def test_random_splits_merge_to_the_unsplit_attention(seed):
    g = torch.Generator().manual_seed(seed)
    heads, q_len, s, d = 3, 5, int(torch.randint(2, 60, (1,), generator=g)), 16
    q, k, v = (torch.randn(1, heads, n, d, generator=g, dtype=torch.float64) for n in (q_len, s, s))
    full, full_lse = math_attention_with_lse(q, k, v, 0.25, causal=False)
    perm = torch.randperm(s, generator=g)
    cut = int(torch.randint(1, s, (1,), generator=g))
    a, b = perm[:cut], perm[cut:]
    o1, l1 = math_attention_with_lse(q, k[:, :, a], v[:, :, a], 0.25, causal=False)
    o2, l2 = math_attention_with_lse(q, k[:, :, b], v[:, :, b], 0.25, causal=False)
    merged, lse = merge_attn_states(o1, l1, o2, l2)
    assert (merged - full).abs().max() < 1e-5
    assert (lse - full_lse).abs().max() < 1e-5


@pytest.mark.parametrize("causal", [False, True])
def test_cpu_flash_lse_equals_explicit_scores(causal):
    g = torch.Generator().manual_seed(1)
    q, k = torch.randn(1, 4, 33, 24, generator=g), torch.randn(1, 4, 33, 24, generator=g)
    v = torch.randn(1, 4, 33, 16, generator=g)  # narrower values: zero-padded for the kernel
    out, lse = attention_with_lse(q, k, v, 0.2, causal)
    ref, ref_lse = math_attention_with_lse(q, k, v, 0.2, causal)
    assert out.shape == ref.shape
    assert (out - ref).abs().max() < 1e-5 and (lse - ref_lse).abs().max() < 1e-4


@pytest.mark.parametrize("hq,hkv,q_len,s", [(4, 4, 40, 40), (4, 4, 17, 300), (6, 2, 50, 130), (8, 1, 20, 99)])
def test_long_row_equals_masked_sdpa(hq, hkv, q_len, s):
    g = torch.Generator().manual_seed(hq * s)
    q = torch.randn(hq, q_len, 32, generator=g)
    k, v = torch.randn(hkv, s, 32, generator=g), torch.randn(hkv, s, 24, generator=g)
    r = hq // hkv
    mask = torch.arange(s)[None, :] <= torch.arange(s - q_len, s)[:, None]  # queries at the last q_len positions
    ref = F.scaled_dot_product_attention(q, k.repeat_interleave(r, 0), v.repeat_interleave(r, 0), attn_mask=mask,
                                         scale=0.3)
    assert (causal_row_attention(q, k, v, 0.3) - ref).abs().max() < 1e-5

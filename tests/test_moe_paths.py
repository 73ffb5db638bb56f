"""The routed experts' three paths agree: few local experts run densely over every token (unchosen ones weighted 0),
a few (token, choice) pairs gather their experts' weights and run as batched matmuls, more loop over the experts
that received tokens; choices are summed in the same (ascending expert) order, so one token's output is bitwise the
loop's, and a choice owned by another expert-parallel rank adds nothing."""

from __future__ import annotations

import pytest
import torch

from tandem.distributed.groups import SINGLE, Group
from tandem.layers.moe import FusedMoE


def _moe(ep: Group = SINGLE, num_experts: int = 8) -> FusedMoE:
    g = torch.Generator().manual_seed(0)
    moe = FusedMoE(num_experts, 64, 32, ep=ep)
    moe.w13_weight.data = torch.randn(moe.w13_weight.shape, generator=g)
    moe.w2_weight.data = torch.randn(moe.w2_weight.shape, generator=g)
    return moe


def _routing(t: int, k: int, seed: int, num_experts: int = 8) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(num_experts, generator=g)[:k] for _ in range(t)])
    return torch.randn(t, 64, generator=g), torch.rand(t, k, generator=g), ids


@pytest.mark.parametrize("k", [2, 3])
def test_one_token_gathered_equals_looped_bitwise(k):
    moe = _moe()
    for seed in range(5):
        x, w, ids = _routing(1, k, seed)
        assert torch.equal(moe._gathered_experts(x, w, ids), moe._looped_experts(x, w, ids))
        assert torch.equal(moe._dense_experts(x, w, ids), moe._looped_experts(x, w, ids))


@pytest.mark.parametrize("t", [2, 3, 7, 16, 32])
def test_several_tokens_dense_agrees_with_the_loop(t):
    moe = _moe()
    for seed in range(3):
        x, w, ids = _routing(t, 2, seed)
        # the matmuls differ in shape (one per expert over T tokens vs its routed rows): rounding, not sums
        torch.testing.assert_close(moe._dense_experts(x, w, ids), moe._looped_experts(x, w, ids), rtol=1e-5, atol=1e-4)


def test_the_switch_runs_dense_for_few_experts_gathered_for_few_pairs_and_the_loop_beyond():
    moe = _moe()  # 8 experts, top-2: at most 4x the routed work, so dense up to 32 tokens (256 products)
    x, w, ids = _routing(3, 2, 7)
    assert moe._dense_pays(3, 2) and moe._dense_pays(32, 2) and not moe._dense_pays(33, 2)
    assert moe._dense_pays(2, 2) and not moe._dense_pays(1, 2)  # one token's 2 pairs: under half the 8 experts
    assert not moe._dense_pays(3, 1)  # top-1 of 8: 8x the routed work
    assert torch.equal(moe.forward_eager(x, w, ids), moe._dense_experts(x, w, ids))
    many = _moe(num_experts=32)  # top-2 of 32 experts: never dense
    x, w, ids = _routing(3, 2, 7, num_experts=32)
    assert not many._dense_pays(1, 2)
    torch.testing.assert_close(many._gathered_experts(x, w, ids), many._looped_experts(x, w, ids), rtol=1e-5, atol=1e-4)
    assert many._max_gathered_pairs == 32  # no more pairs than experts (the weights here are 48 KB a pair)
    assert torch.equal(many.forward_eager(x, w, ids), many._gathered_experts(x, w, ids))
    x, w, ids = _routing(17, 2, 8, num_experts=32)
    assert torch.equal(many.forward_eager(x, w, ids), many._looped_experts(x, w, ids))


def test_choices_of_another_expert_parallel_rank_add_nothing():
    moe = _moe(Group(rank=1, size=2))  # owns experts 4..7
    for t in (1, 4):
        x, w, ids = _routing(t, 3, 3)
        if t == 1:
            assert torch.equal(moe._gathered_experts(x, w, ids), moe._looped_experts(x, w, ids))
        torch.testing.assert_close(moe._dense_experts(x, w, ids), moe._looped_experts(x, w, ids), rtol=1e-5, atol=1e-4)

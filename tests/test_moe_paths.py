"""The routed experts' two paths agree: a few (token, choice) pairs gather their experts' weights and run as batched
matmuls, more loop over the experts that received tokens; choices are summed in the same (ascending expert) order,
so one token's output is bitwise the loop's, and a choice owned by another expert-parallel rank adds nothing."""

from __future__ import annotations

import pytest
import torch

from tandem.distributed.groups import SINGLE, Group
from tandem.layers.moe import FusedMoE


def _moe(ep: Group = SINGLE) -> FusedMoE:
    g = torch.Generator().manual_seed(0)
    moe = FusedMoE(8, 64, 32, ep=ep)
    moe.w13_weight.data = torch.randn(moe.w13_weight.shape, generator=g)
    moe.w2_weight.data = torch.randn(moe.w2_weight.shape, generator=g)
    return moe


def _routing(t: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(8, generator=g)[:k] for _ in range(t)])
    return torch.randn(t, 64, generator=g), torch.rand(t, k, generator=g), ids


@pytest.mark.parametrize("k", [2, 3])
def test_one_token_gathered_equals_looped_bitwise(k):
    moe = _moe()
    for seed in range(5):
        x, w, ids = _routing(1, k, seed)
        assert torch.equal(moe._gathered_experts(x, w, ids), moe._looped_experts(x, w, ids))


def test_several_tokens_agree_and_the_switch_uses_the_gathered_path_for_few_pairs():
    moe = _moe()
    x, w, ids = _routing(3, 2, 7)
    torch.testing.assert_close(moe._gathered_experts(x, w, ids), moe._looped_experts(x, w, ids), rtol=1e-5, atol=1e-4)
    assert moe._max_gathered_pairs == 8  # no more pairs than experts (the weights here are 48 KB a pair)
    assert torch.equal(moe.forward_eager(x, w, ids), moe._gathered_experts(x, w, ids))
    x, w, ids = _routing(5, 2, 8)
    assert torch.equal(moe.forward_eager(x, w, ids), moe._looped_experts(x, w, ids))


def test_choices_of_another_expert_parallel_rank_add_nothing():
    moe = _moe(Group(rank=1, size=2))  # owns experts 4..7
    x, w, ids = _routing(1, 3, 3)
    assert torch.equal(moe._gathered_experts(x, w, ids), moe._looped_experts(x, w, ids))

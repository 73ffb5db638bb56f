"""The routed experts' three paths agree: few local experts run densely over every token (unchosen ones weighted 0),
a few (token, choice) pairs gather their experts' weights and run as batched matmuls, more loop over the experts
that received tokens; choices are summed in the same (ascending expert) order, so one token's output is bitwise the
loop's, and a choice owned by another expert-parallel rank adds nothing. On the CPU in float32 the native kernel
(tandem/native/small_gemm.cpp) serves instead: only the chosen pairs, a token's result independent of its batch."""

from __future__ import annotations

import pytest
import torch

from tandem import native
from tandem.distributed.groups import SINGLE, Group
from tandem.layers.moe import NATIVE_MAX_PAIRS_PER_EXPERT, FusedMoE


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


@pytest.mark.usefixtures("without_native_kernels")
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


@pytest.mark.usefixtures("native_kernels")
@pytest.mark.parametrize("ep_rank", [None, 0, 1])
def test_native_experts_equal_the_loop_and_ignore_their_batch(ep_rank):
    """Seeded fuzz over token counts, top-k and expert-parallel ranks: the native kernel gives the loop's sums up to
    rounding, a token alone gives the same bits as inside any batch, and FusedMoE routes float32 CPU calls to it."""
    moe = _moe() if ep_rank is None else _moe(Group(rank=ep_rank, size=2))
    rng = torch.Generator().manual_seed(11)
    for trial in range(12):
        t = int(torch.randint(1, 70, (1,), generator=rng))
        k = int(torch.randint(1, 4, (1,), generator=rng))
        x, w, ids = _routing(t, k, 100 + trial)
        got = native.moe_experts(x, moe.w13_weight, moe.w2_weight, ids, w, moe.expert_start)
        want = moe._looped_experts(x, w, ids)  # outputs of ~100s: float32 rounding of ~1e-4 of other sum orders
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()) + 1e-6)
        assert torch.equal(moe._experts(x, w, ids), got)  # the layer routes here (forward_eager, one EP rank)
        one = int(torch.randint(0, t, (1,), generator=rng))
        alone = native.moe_experts(x[one:one + 1], moe.w13_weight, moe.w2_weight, ids[one:one + 1], w[one:one + 1],
                                   moe.expert_start)
        assert torch.equal(alone[0], got[one])
    x, w, ids = _routing(3, 2, 5)
    far = torch.full_like(ids, 99)  # no local choice: nothing added
    assert torch.equal(native.moe_experts(x, moe.w13_weight, moe.w2_weight, far, w, moe.expert_start),
                       torch.zeros_like(x))
    empty = native.moe_experts(x[:0], moe.w13_weight, moe.w2_weight, ids[:0], w[:0], moe.expert_start)
    assert empty.shape == (0, 64)
    # past NATIVE_MAX_PAIRS_PER_EXPERT (a prefill's big GEMMs) the PyTorch loop serves
    x, w, ids = _routing(NATIVE_MAX_PAIRS_PER_EXPERT * moe.num_local_experts // 2 + 1, 2, 6)
    assert torch.equal(moe._experts(x, w, ids), moe._looped_experts(x, w, ids))


@pytest.mark.usefixtures("native_kernels")
def test_native_experts_reject_mismatched_inputs():
    moe = _moe()
    x, w, ids = _routing(3, 2, 5)
    with pytest.raises(RuntimeError, match="shapes disagree"):
        native.moe_experts(x[:, :32], moe.w13_weight, moe.w2_weight, ids, w, 0)
    with pytest.raises(RuntimeError, match="int64"):
        native.moe_experts(x, moe.w13_weight, moe.w2_weight, ids.int(), w, 0)
    with pytest.raises(RuntimeError, match="contiguous"):
        native.moe_experts(x, moe.w13_weight, moe.w2_weight, ids.t().contiguous().t(), w, 0)
    with pytest.raises(RuntimeError, match="float32"):
        native.moe_experts(x.double(), moe.w13_weight, moe.w2_weight, ids, w, 0)

"""Mixture of experts: the DeepSeek-V3 router (`MoEGate`) and the routed experts (`FusedMoE`).

Experts are stacked per rank, their intermediate dim split over TP and the experts themselves over EP;
the CPU forward loops over the experts that received tokens.
"""

from __future__ import annotations

import re
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tandem import native
from tandem.compilation import opaque_ops
from tandem.distributed.groups import SINGLE, Group
from tandem.layers.activation import silu_and_mul
from tandem.layers.cpu_gemm import linear
from tandem.layers.linear import default_weight_loader, new_param, shard_tensor

_EXPERT_TENSOR = re.compile(r"^(.*\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")
_SCORING = ("sigmoid", "softmax")
_TOPK_METHODS = ("noaux_tc", "greedy")


def expert_weight_target(name: str) -> tuple[str, tuple[int, str]] | None:
    """`X.experts.{e}.{gate,up,down}_proj.weight` -> (`X.experts.w13_weight` or `X.experts.w2_weight`,
    (e, kind)); None for any other tensor."""
    m = _EXPERT_TENSOR.match(name)
    if m is None:
        return None
    prefix, expert, kind = m.groups()
    return f"{prefix}.{'w2' if kind == 'down' else 'w13'}_weight", (int(expert), kind)


def _float32_param(shape: tuple[int, ...]) -> nn.Parameter:
    p = nn.Parameter(torch.empty(shape, dtype=torch.float32), requires_grad=False)
    p.weight_loader = default_weight_loader  # type: ignore[attr-defined]
    return p


# Dense experts (every local expert over every token): while the local experts are at most this many times
# the choices per token, and the step's token x expert products at most this many (FusedMoE._dense_pays).
DENSE_MAX_WASTE = 4
# float32 CPU experts through the native kernel (tandem/native: the chosen pairs only) where it serves
NATIVE_EXPERTS = True
# ... for up to this many (token, choice) pairs per local expert: past it a prefill's experts are big GEMMs, which
# MKL blocks better than the kernel's weight-streaming (8 experts, top-2, hidden 256: 256 tokens 1.5 vs 2.4 ms looped,
# 512 tokens 3.0 vs 3.2, 1,024 tokens 6.7 vs 4.4)
NATIVE_MAX_PAIRS_PER_EXPERT = 96
DENSE_MAX_PRODUCTS = 256


class MoEGate(nn.Module):
    """Router: hidden [T, H] -> (topk_weights [T, K] float32, topk_ids [T, K] int64), as transformers'
    DeepseekV3TopkRouter.

    `noaux_tc` (DeepSeek-V3, GLM-4.5): sigmoid scores; experts are chosen on scores + e_score_correction_bias
    within the `topk_group` best of `n_group` groups (a group scores the sum of its top-2), but weighted by
    the un-biased scores. `greedy`: plain top-k (DeepSeek-V2 style, usually with softmax scoring).
    The router runs in float32 whatever the model dtype, as the released checkpoints and HF keep it.
    """

    def __init__(self, hf: Any):
        super().__init__()
        self.num_experts, self.top_k = hf.n_routed_experts, hf.num_experts_per_tok
        self.scoring_func = getattr(hf, "scoring_func", "sigmoid")
        self.topk_method = getattr(hf, "topk_method", "noaux_tc")
        if self.scoring_func not in _SCORING:
            raise ValueError(f"scoring_func={self.scoring_func!r} is not supported: "
                             f"one of {', '.join(_SCORING)}")
        if self.topk_method not in _TOPK_METHODS:
            raise ValueError(f"topk_method={self.topk_method!r} is not supported: "
                             f"one of {', '.join(_TOPK_METHODS)}")
        self.n_group, self.topk_group = getattr(hf, "n_group", 1) or 1, getattr(hf, "topk_group", 1) or 1
        if self.num_experts % self.n_group:
            raise ValueError(f"n_group={self.n_group} does not divide n_routed_experts={self.num_experts}")
        self.norm_topk_prob = getattr(hf, "norm_topk_prob", True)
        self.routed_scaling_factor = getattr(hf, "routed_scaling_factor", 1.0)
        self.weight = _float32_param((self.num_experts, hf.hidden_size))
        self.e_score_correction_bias = (_float32_param((self.num_experts,)) if self.topk_method == "noaux_tc"
                                        else None)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # [T, E]; through cpu_gemm.linear like every projection: a compiled piece otherwise packs this [E, H] weight
        # for oneDNN, whose ~50 us dispatch a call is most of a decode step's router
        logits = linear(x.float(), self.weight, None, None)
        scores = logits.sigmoid() if self.scoring_func == "sigmoid" else logits.softmax(dim=-1)
        choice = scores
        if self.e_score_correction_bias is not None:
            choice = self._limit_groups(scores + self.e_score_correction_bias)
        topk_ids = torch.topk(choice, k=self.top_k, dim=-1, sorted=False)[1]  # [T, K]
        topk_weights = scores.gather(1, topk_ids)
        if self.norm_topk_prob:
            topk_weights = topk_weights / (topk_weights.sum(dim=-1, keepdim=True) + 1e-20)
        return topk_weights * self.routed_scaling_factor, topk_ids

    def _limit_groups(self, choice: torch.Tensor) -> torch.Tensor:
        # choice: [T, E]; experts outside the kept groups get -inf so top-k never picks them.
        if self.topk_group >= self.n_group:
            return choice
        grouped = choice.view(-1, self.n_group, self.num_experts // self.n_group)  # [T, G, E/G]
        group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)  # [T, G]
        group_idx = torch.topk(group_scores, k=self.topk_group, dim=-1, sorted=False)[1]
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, group_idx, True)
        return grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view_as(choice)


class FusedMoE(nn.Module):
    """Routed SwiGLU experts stored stacked: w13_weight [E_local, 2 * I_local, H] (gate rows, then up rows)
    and w2_weight [E_local, H, I_local].

    Either each expert's intermediate dim is split over `tp`, or whole experts are partitioned over `ep`
    (rank r owns global ids [r * E_local, (r + 1) * E_local)), not both: expert parallelism replaces tensor
    parallelism inside the experts, as in vLLM. The weight loader takes per-expert checkpoint tensors with
    shard id (expert_id, "gate" | "up" | "down") and ignores experts another EP rank owns, so a missing
    expert is reported by the rank that owns it. Under EP the tokens of every rank are gathered (PCP ranks
    hold different ones; TP peers, which hold the same ones, each send a 1/TP share) and the output is
    complete; under TP it is summed over `tp` only when
    `reduce_results` (the caller may add the shared experts' partial sums first and reduce once).
    """

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, tp: Group = SINGLE,
                 ep: Group = SINGLE, reduce_results: bool = True, token_split: Group = SINGLE):
        super().__init__()
        # Under EP, the ranks of `token_split` (the TP peers) hold the same tokens: each sends only its 1/size
        # share to the experts, so no token is computed twice.
        self.token_split = token_split
        if tp.size > 1 and ep.size > 1:
            raise ValueError(f"experts split over tensor_parallel_size {tp.size} and expert parallel size "
                             f"{ep.size} at once; expert parallel experts take tp=SINGLE")
        if num_experts % ep.size:
            raise ValueError(f"n_routed_experts {num_experts} is not divisible by "
                             f"expert parallel size {ep.size}")
        if intermediate_size % tp.size:
            raise ValueError(f"moe_intermediate_size {intermediate_size} is not divisible by "
                             f"tensor_parallel_size {tp.size}")
        self.num_experts, self.tp, self.ep, self.reduce_results = num_experts, tp, ep, reduce_results
        self.num_local_experts = num_experts // ep.size
        self.expert_start = ep.rank * self.num_local_experts
        self.intermediate_local = intermediate_size // tp.size
        num_local, inter = self.num_local_experts, self.intermediate_local
        self.w13_weight = new_param((num_local, 2 * inter, hidden_size), self._load)
        self.w2_weight = new_param((num_local, hidden_size, inter), self._load)
        local = range(self.expert_start, self.expert_start + self.num_local_experts)
        self.w13_weight.expected_shards = {(e, kind) for e in local for kind in ("gate", "up")}  # type: ignore[attr-defined]
        self.w2_weight.expected_shards = {(e, "down") for e in local}  # type: ignore[attr-defined]
        self.layer_name = opaque_ops.register_layer(self)

    def _load(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: tuple[int, str]) -> None:
        expert, kind = shard_id
        if not 0 <= expert < self.num_experts:
            raise ValueError(f"expert {expert} is out of range: n_routed_experts={self.num_experts}")
        local = expert - self.expert_start
        if not 0 <= local < self.num_local_experts:
            return  # owned by another expert-parallel rank
        size = self.intermediate_local
        if kind == "down":
            default_weight_loader(param.data[local], shard_tensor(loaded, 1, self.tp))
        else:
            dest = param.data[local].narrow(0, 0 if kind == "gate" else size, size)
            default_weight_loader(dest, shard_tensor(loaded, 0, self.tp))

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        # x: [T, H]; topk_weights: [T, K] float32; topk_ids: [T, K] global expert ids -> [T, H]
        if torch.compiler.is_compiling():  # data-dependent expert loop and EP collectives: a split point
            return torch.ops.tandem.moe_experts(x, topk_weights, topk_ids, self.layer_name)
        return self.forward_eager(x, topk_weights, topk_ids)

    def forward_eager(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        if self.ep.size == 1:
            out = self._experts(x, topk_weights, topk_ids)
            return self.tp.all_reduce(out) if self.reduce_results else out
        return self._expert_parallel(x, topk_weights, topk_ids)

    def _expert_parallel(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        # EP ranks may hold different tokens (PCP shards them): gather every rank's tokens (padded to the
        # longest, padding routed with weight 0), run the local experts over all of them, sum the partial
        # outputs over `ep`, keep this rank's tokens. gloo has no reduce-scatter, so all-reduce + slice.
        # TP peers (token_split, consecutive EP ranks: TP is the fastest rank axis) share their tokens, so each
        # contributes one contiguous 1/TP share and reassembles the whole set from its peers' shares.
        n, split = x.shape[0], self.token_split
        share = -(-n // split.size)  # ceil: rows per TP peer
        lo = min(split.rank * share, n)
        mine = slice(lo, min(lo + share, n))
        m = int(self.ep.all_gather(torch.tensor([share], device=x.device)).max())

        def gathered(t: torch.Tensor) -> torch.Tensor:  # [rows, D] -> [ep * m, D]
            part = t[mine]
            return self.ep.all_gather(F.pad(part, (0, 0, 0, m - part.shape[0])))

        out = self.ep.all_reduce(self._experts(gathered(x), gathered(topk_weights), gathered(topk_ids)))
        first_peer = self.ep.rank - split.rank  # the EP rank of TP rank 0 in this rank's group
        pieces = [out[(first_peer + t) * m:(first_peer + t) * m + max(0, min(share, n - t * share))]
                  for t in range(split.size)]
        return torch.cat(pieces)  # [n, H]

    def _experts(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        if NATIVE_EXPERTS and topk_ids.numel() <= NATIVE_MAX_PAIRS_PER_EXPERT * self.num_local_experts \
                and native.serves(x, self.w13_weight, self.w2_weight) and self.w13_weight.is_contiguous() \
                and self.w2_weight.is_contiguous():
            # only the chosen pairs, each expert's weights streamed once (one token: 215 -> 25 us, 32 tokens:
            # 618 -> 199 us, 128 tokens: 1,916 -> 817 us; 8 experts, top-2, hidden 256, weights hot), and a token's
            # result does not depend on its batch (a verification row's experts give its decode's bits)
            return native.moe_experts(x, self.w13_weight, self.w2_weight, topk_ids.long().contiguous(),
                                      topk_weights.float().contiguous(), self.expert_start)
        if self._dense_pays(*topk_ids.shape):
            return self._dense_experts(x, topk_weights, topk_ids)
        if topk_ids.numel() <= self._max_gathered_pairs:
            return self._gathered_experts(x, topk_weights, topk_ids)
        return self._looped_experts(x, topk_weights, topk_ids)

    def _dense_pays(self, num_tokens: int, top_k: int) -> bool:
        """Few local experts, each chosen by a large share of the tokens (a small model's verification step or
        decode batch): running every expert over every token wastes at most 4x the routed multiply-adds but reads
        each weight in place, once, with two batched matmuls and no index work. Measured on the CPU (8 experts,
        top-2, hidden 256, one thread, weights hot): 4 tokens 470 us vs 1,217 gathered, 8 tokens 432 vs 1,045
        looped, 32 tokens 1,215 vs 1,693 looped; at 64 tokens the loop catches up. One token's 2 choices stay
        gathered: hot, dense is faster (285 vs 446 us), but inside the engine the weights are cold and dense reads
        all 8 experts' weights for 2, which measured 0.86-1.06x in in-process A/Bs; so
        dense needs the routed pairs to be at least half the local experts."""
        e = self.num_local_experts
        return (e <= DENSE_MAX_WASTE * top_k and 2 * num_tokens * top_k >= e
                and num_tokens * e <= DENSE_MAX_PRODUCTS)

    def _dense_experts(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        # Every local expert runs on every token; a choice the token did not make (or one owned by another
        # expert-parallel rank) has routing weight 0. The experts' outputs are summed one at a time in ascending
        # expert order, as the loop's index_add does; an unchosen expert adds an exact zero.
        t, e = x.shape[0], self.num_local_experts
        local = topk_ids - self.expert_start
        is_local = (local >= 0) & (local < e)
        # [T, E + 1] routing weights; non-local choices land in the extra column, which is dropped (a token's
        # choices are distinct experts, so no two local choices share a cell)
        route = topk_weights.new_zeros(t, e + 1).scatter_(1, torch.where(is_local, local, e),
                                                          torch.where(is_local, topk_weights, 0.0))[:, :e]
        xs = x.unsqueeze(0).expand(e, t, x.shape[1])  # [E, T, H], no copy
        h = torch.bmm(xs, self.w13_weight.transpose(1, 2))  # [E, T, 2I]
        h = torch.bmm(silu_and_mul(h), self.w2_weight.transpose(1, 2))  # [E, T, H]
        h = (h * route.t().unsqueeze(-1)).to(x.dtype)
        out = torch.zeros_like(x)
        for j in range(e):
            out = out + h[j]
        return out

    @property
    def _max_gathered_pairs(self) -> int:
        """(token, choice) pairs up to which each pair gathers its expert's weights (a few decode tokens): no more
        pairs than local experts (the loop would run about as many experts) and at most ~4 MB of weights copied."""
        pair_bytes = (self.w13_weight[0].numel() + self.w2_weight[0].numel()) * self.w13_weight.element_size()
        return min(self.num_local_experts, (4 << 20) // max(pair_bytes, 1))

    def _gathered_experts(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        # Off the CPU each of the T*K pairs gathers its expert's weights and runs as one batched matmul: no host
        # sync, no loop over experts. Choices are summed in ascending expert order, one at a time, as the loop's
        # index_add does, so both paths give the same sums. A non-local choice (expert parallel) runs expert 0
        # with weight 0.
        t, k = topk_ids.shape
        ids, order = torch.sort(topk_ids - self.expert_start, dim=1, stable=True)  # [T, K] local ids, ascending
        weights = topk_weights.gather(1, order)
        is_local = (ids >= 0) & (ids < self.num_local_experts)
        ids, weights = torch.where(is_local, ids, 0).flatten(), torch.where(is_local, weights, 0.0)
        if x.device.type == "cpu":
            # host ids cost nothing on the CPU: each pair multiplies its expert's weights in place (views), which
            # is ~3x cheaper than copying them out (one token's 2 pairs, 8 x [256, 256] experts: 75 vs 230 us)
            h = torch.stack([F.linear(silu_and_mul(F.linear(x[p // k: p // k + 1], self.w13_weight[e])),
                                      self.w2_weight[e])[0] for p, e in enumerate(ids.tolist())]).view(t, k, -1)
        else:  # index_select copies whole experts, several times faster than advanced indexing
            xs = x.unsqueeze(1).expand(t, k, x.shape[1]).reshape(t * k, 1, x.shape[1])  # [T*K, 1, H]
            h = torch.bmm(xs, self.w13_weight.index_select(0, ids).transpose(1, 2))  # [T*K, 1, 2I]
            h = torch.bmm(silu_and_mul(h), self.w2_weight.index_select(0, ids).transpose(1, 2)).view(t, k, -1)
        h = h * weights.unsqueeze(-1)  # [T, K, H]
        out = torch.zeros_like(x) + h[:, 0].to(x.dtype)
        for j in range(1, k):
            out = out + h[:, j].to(x.dtype)
        return out

    def _looped_experts(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        # Sort the T*K (token, choice) pairs by local expert, then run each expert once on its rows.
        # Example, K = 2, one rank owning experts 0..3: topk_ids [[2, 0], [2, 3]] -> flat [2, 0, 2, 3],
        # order [1, 0, 2, 3], counts [1, 0, 2, 1]: expert 0 gets pair 1 (token 0), expert 2 pairs 0, 2
        # (tokens 0, 1), expert 3 pair 3 (token 1). Non-local ids sort last (key = E_local) and are dropped.
        k = topk_ids.shape[1]
        local_ids = (topk_ids - self.expert_start).flatten()  # [T * K]
        is_local = (local_ids >= 0) & (local_ids < self.num_local_experts)
        order = torch.argsort(torch.where(is_local, local_ids, self.num_local_experts), stable=True)
        counts = torch.bincount(local_ids[is_local], minlength=self.num_local_experts).tolist()
        flat_weights = topk_weights.flatten()  # [T * K]
        out = torch.zeros_like(x)
        start = 0
        for expert, n in enumerate(counts):
            if n == 0:
                continue
            pairs = order[start:start + n]
            start += n
            tokens = pairs // k
            h = F.linear(silu_and_mul(F.linear(x[tokens], self.w13_weight[expert])), self.w2_weight[expert])
            out.index_add_(0, tokens, (h * flat_weights[pairs, None]).to(out.dtype))
        return out

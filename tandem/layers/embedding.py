"""Vocab-parallel token embedding and LM head: each TP rank holds a contiguous slice of the vocab."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tandem.distributed.groups import SINGLE, Group
from tandem.layers.cpu_gemm import linear
from tandem.layers.linear import default_weight_loader


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, tp: Group = SINGLE):
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        self.shard_size = -(-vocab_size // tp.size)
        self.vocab_start = tp.rank * self.shard_size
        self.weight = nn.Parameter(torch.empty(self.shard_size, hidden_size), requires_grad=False)
        self.weight.weight_loader = self._load  # type: ignore[attr-defined]

    def _load(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        if loaded.shape[0] != self.vocab_size:
            raise ValueError(f"shape mismatch: vocab {self.vocab_size} vs checkpoint {tuple(loaded.shape)}")
        part = loaded[self.vocab_start:self.vocab_start + self.shard_size]
        param.data.zero_()
        default_weight_loader(param.data[: part.shape[0]], part)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        # input_ids: [num_tokens] -> [num_tokens, hidden_size]
        if self.tp.size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.shard_size)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside.unsqueeze(-1), 0)
        return self.tp.all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """Projects hidden states to logits; the vocab shards are all-gathered so every rank sees all."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: Group = SINGLE):
        super().__init__(vocab_size, hidden_size, tp)
        self.packed_weight: torch.Tensor | None = None  # oneDNN's layout of weight, set after loading (cpu_gemm)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden: [num_rows, hidden_size] -> logits [num_rows, vocab_size] (float32)
        logits = linear(hidden, self.weight, None, self.packed_weight)
        logits = self.tp.all_gather(logits, dim=-1)
        return logits[:, : self.vocab_size].float()

"""DeepSeek-style multi-token prediction (MTP) modules, loaded from checkpoint layers >= num_hidden_layers.

One MTP step: eh_proj(cat[enorm(embed(t_{p+1})), hnorm(h_p)]) -> one decoder block -> shared_head (DESIGN §4).
"""

from __future__ import annotations

import re
from typing import Protocol

import torch
from torch import nn

from tandem.config import ModelConfig
from tandem.distributed.groups import Group, ParallelGroups
from tandem.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from tandem.layers.linear import ReplicatedLinear
from tandem.layers.norm import RMSNorm

_LAYER_TENSOR = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
# Tensors of an MTP layer that sit beside its decoder block rather than inside it.
_MTP_OWN = ("embed_tokens.", "enorm.", "hnorm.", "eh_proj.", "shared_head.")


class DecoderBlock(Protocol):
    """What an MTP layer needs of the trunk's decoder layer class (built with moe=True)."""

    def __call__(self, config: ModelConfig, groups: ParallelGroups, moe: bool) -> nn.Module: ...


def mtp_weight_name(name: str, num_hidden_layers: int, num_mtp_layers: int) -> str | None:
    """`model.layers.{L + i}.X` (i < num_mtp_layers) -> `mtp.layers.{i}.X`, or `mtp.layers.{i}.mtp_block.X` for
    decoder-block tensors; None for a tensor that is not in an MTP layer."""
    m = _LAYER_TENSOR.match(name)
    if m is None or not num_hidden_layers <= int(m.group(1)) < num_hidden_layers + num_mtp_layers:
        return None
    index, rest = int(m.group(1)) - num_hidden_layers, m.group(2)
    return f"mtp.layers.{index}.{rest if rest.startswith(_MTP_OWN) else 'mtp_block.' + rest}"


class SharedHead(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, eps: float, tp: Group):
        super().__init__()
        self.norm = RMSNorm(hidden_size, eps)
        self.head = ParallelLMHead(vocab_size, hidden_size, tp)


class MTPLayer(nn.Module):
    def __init__(self, config: ModelConfig, groups: ParallelGroups, block_cls: DecoderBlock):
        super().__init__()
        hf = config.hf
        # The checkpoint carries its own copies of the trunk's embedding and LM head for each MTP layer.
        self.embed_tokens = VocabParallelEmbedding(hf.vocab_size, hf.hidden_size, groups.tp)
        self.enorm = RMSNorm(hf.hidden_size, hf.rms_norm_eps)
        self.hnorm = RMSNorm(hf.hidden_size, hf.rms_norm_eps)
        self.eh_proj = ReplicatedLinear(2 * hf.hidden_size, hf.hidden_size)
        self.mtp_block = block_cls(config, groups, moe=True)
        self.shared_head = SharedHead(hf.vocab_size, hf.hidden_size, hf.rms_norm_eps, groups.tp)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                target_hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # The embedding is zeroed at position 0, as vLLM feeds the released DeepSeek/GLM MTP weights.
        embeds = self.embed_tokens(input_ids).masked_fill((positions == 0).unsqueeze(-1), 0)  # [T, H]
        h = self.eh_proj(torch.cat((self.enorm(embeds), self.hnorm(target_hidden)), dim=-1))  # [T, H]
        h = self.mtp_block(positions, h)
        return self.shared_head.norm(h), h


class DeepSeekMTP(nn.Module):
    """`num_layers` MTP layers; draft step k runs layer k % num_layers. Each layer's attention is its own
    module, so it gets its own paged KV cache."""

    def __init__(self, config: ModelConfig, groups: ParallelGroups, num_layers: int, block_cls: DecoderBlock):
        super().__init__()
        self.layers = nn.ModuleList([MTPLayer(config, groups, block_cls) for _ in range(num_layers)])

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, target_hidden: torch.Tensor,
                spec_step_idx: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """input_ids, positions: [T]; target_hidden: [T, H] (the target's final-normed hidden state, or
        the previous step's feedback) -> (hidden for logits [T, H] after shared_head.norm,
        feedback hidden [T, H] before it)."""
        return self.layers[spec_step_idx % len(self.layers)](input_ids, positions, target_hidden)

    def share_trunk_copies(self, embed: VocabParallelEmbedding, lm_head: ParallelLMHead) -> int:
        """Point each layer's embedding and shared head at the trunk's where the checkpoint's copies are the same
        values (DeepSeek-V3 and GLM releases save them as exact copies; vLLM's MTP drafter shares the target's too):
        the copies' memory is freed and a draft pass reads the weights the target pass just read. A layer whose
        copy differs keeps its own. -> bytes freed."""
        freed = 0
        for layer in self.layers:
            for owner, attr, trunk in ((layer, "embed_tokens", embed), (layer.shared_head, "head", lm_head)):
                own = getattr(owner, attr)
                if own is trunk or own.weight.shape != trunk.weight.shape or own.weight.dtype != trunk.weight.dtype \
                        or not torch.equal(own.weight, trunk.weight):
                    continue
                freed += own.weight.numel() * own.weight.element_size()
                setattr(owner, attr, trunk)
        return freed

    def compute_logits(self, hidden: torch.Tensor, spec_step_idx: int = 0) -> torch.Tensor:
        # hidden: [num_rows, H] after shared_head.norm -> float32 logits [num_rows, vocab]
        return self.layers[spec_step_idx % len(self.layers)].shared_head.head.compute_logits(hidden)

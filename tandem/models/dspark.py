"""DSpark, tandem's semi-autoregressive block drafter (docs/dspark.md): config, weights and math of one proposal.
Scope: context features and their paged K/V, the non-causal block attention, Markov and confidence heads; no scheduling.

A proposal for a request whose last valid target token sits at position P:
    context   c_q = hidden_norm(fc(cat[h^l_q for l in target_layer_ids]))   q = 0..P, each layer's own K/V cache
    block     [anchor, noise, .., noise] at positions P+1 .. P+B, embedded with the TARGET's embedding
    layers    block queries attend to context K/V 0..P + the block's own K/V, non-causally inside the block
    logits    target LM head(norm(h_j)) + markov_w2(markov_w1[prev_j])   slot j predicts position P+2+j
The drafter's weights are replicated on every TP and PCP rank; it borrows the target's embedding and LM head.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tandem.attention.backends.prefix import grouped_sdpa
from tandem.attention.kv_dtype import to_cache
from tandem.config import ConfigError, ModelConfig
from tandem.distributed.groups import SINGLE
from tandem.layers.embedding import VocabParallelEmbedding
from tandem.layers.linear import ReplicatedLinear
from tandem.layers.norm import RMSNorm
from tandem.layers.rotary import RotaryEmbedding
from tandem.models.llama import GatedMLP
from tandem.models.loader import WeightLoadError, load_weights, read_checkpoint

ARCHITECTURE, MODEL_TYPE = "DSparkDrafter", "dspark"


@dataclass(frozen=True)
class DSparkConfig:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    vocab_size: int
    target_hidden_size: int
    block_size: int  # B: anchor + B - 1 noise tokens
    target_layer_ids: tuple[int, ...]  # target decoder layers whose outputs make the context features
    markov_rank: int  # r of the low-rank Markov head
    noise_token_id: int

    @staticmethod
    def from_folder(folder: str) -> DSparkConfig:
        path = Path(folder) / "config.json"
        if not path.is_file():
            raise ConfigError(f"speculative_config.model={folder!r}: no config.json found in the DSpark drafter folder")
        raw = json.loads(path.read_text())
        where = f"DSpark drafter {folder!r} config.json"
        if raw.get("architectures") != [ARCHITECTURE] or raw.get("model_type") != MODEL_TYPE:
            raise ConfigError(f"{where}: architectures={raw.get('architectures')!r}, model_type="
                              f"{raw.get('model_type')!r}; expected [{ARCHITECTURE!r}] and {MODEL_TYPE!r}")
        values: dict[str, Any] = {}
        for f in fields(DSparkConfig):
            if f.name not in raw:
                raise ConfigError(f"{where}: {f.name} is missing")
            values[f.name] = tuple(raw[f.name]) if f.name == "target_layer_ids" else raw[f.name]
        cfg = DSparkConfig(**values)
        cfg._validate(where)
        return cfg

    def _validate(self, where: str) -> None:
        positive = ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size",
                    "vocab_size", "target_hidden_size", "block_size", "markov_rank")
        for name in positive:
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ConfigError(f"{where}: {name}={getattr(self, name)!r} is not allowed: a positive integer")
        if self.num_hidden_layers not in (1, 2):
            raise ConfigError(f"{where}: num_hidden_layers={self.num_hidden_layers!r} is not allowed: 1 or 2")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(f"{where}: num_key_value_heads={self.num_key_value_heads} is not allowed: a divisor "
                              f"of num_attention_heads ({self.num_attention_heads})")
        if not self.target_layer_ids:
            raise ConfigError(f"{where}: target_layer_ids=[] is not allowed: at least one target layer")
        if not 0 <= self.noise_token_id < self.vocab_size:
            raise ConfigError(f"{where}: noise_token_id={self.noise_token_id} is not allowed: a token id in "
                              f"[0, vocab_size={self.vocab_size})")

    def check_target(self, folder: str, target: ModelConfig, max_num_speculative_tokens: int) -> None:
        """The drafter must read the target's layers and share its vocabulary; K drafts come from one block."""
        where = f"DSpark drafter {folder!r} config.json"
        if self.vocab_size != target.get("vocab_size"):
            raise ConfigError(f"{where}: vocab_size={self.vocab_size} does not match the target's vocab_size "
                              f"({target.get('vocab_size')}); the drafter uses the target's embedding and LM head")
        for name in ("target_hidden_size", "hidden_size"):  # hidden_size: the block uses the target's embedding
            if getattr(self, name) != target.get("hidden_size"):
                raise ConfigError(f"{where}: {name}={getattr(self, name)} does not match the target's hidden_size "
                                  f"({target.get('hidden_size')})")
        num_layers = target.get("num_hidden_layers")
        if any(not 0 <= i < num_layers for i in self.target_layer_ids):
            raise ConfigError(f"{where}: target_layer_ids={list(self.target_layer_ids)} is not allowed: layer "
                              f"indices of the target, in [0, {num_layers})")
        if max_num_speculative_tokens > self.block_size:
            raise ConfigError(f"speculative_config.num_speculative_tokens={max_num_speculative_tokens} is not "
                              f"allowed: at most the DSpark drafter's block_size ({self.block_size})")


@dataclass
class ContextPrefix:
    """Which cached context keys each block may see: positions 0..P of its row, then all B block keys."""

    kv_slots: torch.Tensor  # [S, L] int64 flat cache slots of context positions 0..L-1 (padding -> slot 0)
    mask: torch.Tensor  # [S, 1, 1, L + B] bool, True = may attend; the same for every query of a block

    @staticmethod
    def build(block_table: torch.Tensor, num_context: torch.Tensor, block_size: int, block_len: int) -> ContextPrefix:
        """block_table: [S, max_blocks] of the sampling rows; num_context: [S] = P + 1 context tokens per row.

        Example, block_size 4, one row with P = 5 and block table [7, 2]: kv_slots = [28 29 30 31 8 9],
        mask = [1 1 1 1 1 1 | 1 .. 1 (B)]; a second, shorter row pads its slots with 0 and masks them out.
        """
        pos = torch.arange(int(num_context.max()), device=block_table.device)  # [L]
        valid = pos[None, :] < num_context[:, None]  # [S, L]
        slots = block_table[:, pos // block_size].long() * block_size + pos % block_size  # [S, L]
        block = torch.ones(valid.shape[0], block_len, dtype=torch.bool, device=valid.device)  # non-causal block
        return ContextPrefix(torch.where(valid, slots, 0), torch.cat((valid, block), dim=1)[:, None, None, :])


class DSparkAttention(nn.Module):
    """GQA whose keys come from two places: context features (written to the paged cache once per target token)
    and the block itself (never cached: the anchor and noise slots change every proposal)."""

    def __init__(self, cfg: DSparkConfig, max_position: int):
        super().__init__()
        self.num_heads, self.num_kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.q_proj = ReplicatedLinear(cfg.hidden_size, self.num_heads * self.head_dim)
        self.k_proj = ReplicatedLinear(cfg.hidden_size, self.num_kv_heads * self.head_dim)
        self.v_proj = ReplicatedLinear(cfg.hidden_size, self.num_kv_heads * self.head_dim)
        self.o_proj = ReplicatedLinear(self.num_heads * self.head_dim, cfg.hidden_size)
        self.rotary_emb = RotaryEmbedding(self.head_dim, max_position, cfg.rope_theta)
        self.kv_cache = torch.empty(0)  # [2, num_blocks, block_size, Hkv, D], bound by the proposer

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        return (2, num_blocks, block_size, self.num_kv_heads, self.head_dim)

    def _kv(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # x: [N, hidden] -> rotated k, v: [N, Hkv, D]
        k = self.k_proj(x).view(-1, self.num_kv_heads, self.head_dim)
        (k,) = self.rotary_emb(positions, k)
        return k, self.v_proj(x).view(-1, self.num_kv_heads, self.head_dim)

    def context_kv(self, features: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # features: [T, hidden]; positions: [T] -> [T, 2, Hkv, D] rotated k and v, already in the cache's dtype
        # (what crosses PCP ranks under the sharded context write is exactly what the cache stores), saturated
        # (kv_cache_dtype fp8: the drafter has no checkpoint scales, so its scale is 1.0)
        k, v = self._kv(features, positions)
        return to_cache(torch.stack((k, v), dim=1), self.kv_cache.dtype)

    def write_kv(self, kv: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        # kv: [T, 2, Hkv, D]; slot_mapping: [T] (PAD_SLOT_ID rows write nothing)
        rows = (slot_mapping >= 0).nonzero().squeeze(1)
        cache = self.kv_cache.flatten(1, 2)  # [2, num_slots, Hkv, D]
        cache[:, slot_mapping[rows]] = kv[rows].transpose(0, 1)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, prefix: ContextPrefix) -> torch.Tensor:
        # x: [S * B, hidden] block rows, row-major by request; positions: [S * B] -> [S * B, hidden]
        s = prefix.kv_slots.shape[0]
        q = self.q_proj(x).view(-1, self.num_heads, self.head_dim)
        (q,) = self.rotary_emb(positions, q)
        k, v = self._kv(x, positions)
        cache = self.kv_cache.flatten(1, 2)  # [2, num_slots, Hkv, D]
        keys = torch.cat((cache[0, prefix.kv_slots].to(x.dtype), k.view(s, -1, *k.shape[1:])), dim=1)  # [S, L+B, ..]
        values = torch.cat((cache[1, prefix.kv_slots].to(x.dtype), v.view(s, -1, *v.shape[1:])), dim=1)
        qs = q.view(s, -1, *q.shape[1:])  # [S, B, Hq, D]
        mask = prefix.mask.expand(-1, -1, qs.shape[1], -1)  # [S, 1, B, L + B]
        out = grouped_sdpa(qs, keys, values, mask, self.head_dim**-0.5, ~mask)  # [S, B, Hq, D]
        return self.o_proj(out.reshape(x.shape[0], -1))  # [S * B, Hq * D]


class DSparkDecoderLayer(nn.Module):
    def __init__(self, cfg: DSparkConfig, max_position: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = DSparkAttention(cfg, max_position)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, SINGLE)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, prefix: ContextPrefix) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), positions, prefix)
        return x + self.mlp(self.post_attention_layernorm(x))


class MarkovHead(nn.Module):
    """Low-rank bigram correction: logits += markov_w2(markov_w1[previous token])."""

    def __init__(self, vocab_size: int, rank: int):
        super().__init__()
        self.markov_w1 = VocabParallelEmbedding(vocab_size, rank)  # [V, r], replicated: an embedding of prev
        self.markov_w2 = ReplicatedLinear(rank, vocab_size)  # [V, r]

    def forward(self, prev_ids: torch.Tensor) -> torch.Tensor:
        # prev_ids: [S] -> logit correction [S, vocab] float32
        return self.markov_w2(self.markov_w1(prev_ids)).float()


class DSparkDrafter(nn.Module):
    packed_modules_mapping = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}

    def __init__(self, cfg: DSparkConfig, max_position: int):
        super().__init__()
        self.config = cfg
        self.fc = ReplicatedLinear(len(cfg.target_layer_ids) * cfg.target_hidden_size, cfg.hidden_size)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.layers = nn.ModuleList([DSparkDecoderLayer(cfg, max_position) for _ in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.markov_head = MarkovHead(cfg.vocab_size, cfg.markov_rank)
        self.confidence_head = ReplicatedLinear(cfg.hidden_size, 1, bias=True)

    def attention_layers(self) -> list[DSparkAttention]:
        return [layer.self_attn for layer in self.layers]

    def context_kv(self, aux_hidden: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """aux_hidden: [T, len(target_layer_ids) * target_hidden] the target layers' outputs, concatenated in
        target_layer_ids order; positions: [T] -> [T, num_layers, 2, Hkv, D] every draft layer's context K/V.
        Row-wise: a token's K/V depend on its own row and position only, so any subset of rows can be projected."""
        features = self.hidden_norm(self.fc(aux_hidden))  # [T, hidden]
        return torch.stack([attn.context_kv(features, positions) for attn in self.attention_layers()], dim=1)

    def write_context_kv(self, kv: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """kv: [T, num_layers, 2, Hkv, D] from context_kv -> each draft layer's cache at slot_mapping [T]."""
        for i, attn in enumerate(self.attention_layers()):
            attn.write_kv(kv[:, i], slot_mapping)

    def write_context(self, aux_hidden: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """context_kv of every row, written at slot_mapping [T]."""
        self.write_context_kv(self.context_kv(aux_hidden, positions), slot_mapping)

    def forward(self, block_embeds: torch.Tensor, positions: torch.Tensor, prefix: ContextPrefix) -> torch.Tensor:
        # block_embeds: [S * B, hidden] target embeddings of the block tokens; positions: [S * B]
        # -> final-normed [S * B, hidden]
        x = block_embeds
        for layer in self.layers:
            x = layer(x, positions, prefix)
        return self.norm(x)

    def confidence(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden: [N, hidden] final-normed -> [N] in (0, 1), the drafter's estimate that its slot is accepted
        return torch.sigmoid(self.confidence_head(hidden).float()).squeeze(-1)


def load_dspark_drafter(folder: str, target: ModelConfig, max_num_speculative_tokens: int,
                        device: str) -> DSparkDrafter:
    """The drafter in `folder`, checked against its target and loaded strictly, in the target's dtype."""
    cfg = DSparkConfig.from_folder(folder)
    cfg.check_target(folder, target, max_num_speculative_tokens)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(target.dtype)
    try:
        with torch.device(device):
            # block positions run up to B past the last context position, itself < max_model_len
            drafter = DSparkDrafter(cfg, target.max_model_len + cfg.block_size)
    finally:
        torch.set_default_dtype(previous)
    try:
        load_weights(drafter, read_checkpoint(folder))
    except WeightLoadError as e:
        raise WeightLoadError(f"DSpark drafter {folder!r}: {e}") from e
    return drafter.eval()

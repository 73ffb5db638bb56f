"""DeepSeek-V3 and GLM-4.7-Flash (Glm4MoeLite): multi-head latent attention, DeepSeek MoE and MTP layers.

The decoder layer, MoE block and causal-LM class here are reused by Glm4Moe with GQA attention instead.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from tandem.attention.layer import MLAAttention
from tandem.config import ModelConfig
from tandem.distributed.groups import SINGLE, Group, ParallelGroups
from tandem.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from tandem.layers.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear
from tandem.layers.moe import FusedMoE, MoEGate, expert_weight_target
from tandem.layers.norm import RMSNorm
from tandem.layers.rotary import RotaryEmbedding, rope_params, yarn_softmax_scale
from tandem.models.llama import GatedMLP
from tandem.models.loader import packed_weight_target
from tandem.models.mtp import DeepSeekMTP, mtp_weight_name

logger = logging.getLogger("tandem")

# DeepSeek's reference (and HF) build q_a_layernorm / kv_a_layernorm with the RMSNorm default eps,
# not rms_norm_eps; GLM-4.7-Flash inherits that in HF.
_LATENT_NORM_EPS = 1e-6


class DeepseekV3Attention(nn.Module):
    """MLA: queries through an optional low-rank q_a/q_b pair, keys/values through the shared latent kv_c;
    RoPE on the qk_rope_head_dim part only. Heads are split over TP; the latent projections are replicated."""

    def __init__(self, config: ModelConfig, tp: Group):
        super().__init__()
        hf = config.hf
        if hf.num_attention_heads % tp.size:
            raise ValueError(f"num_attention_heads {hf.num_attention_heads} is not divisible by "
                             f"tensor_parallel_size {tp.size}")
        self.num_heads = hf.num_attention_heads // tp.size
        self.nope_dim, self.rope_dim, self.v_dim = hf.qk_nope_head_dim, hf.qk_rope_head_dim, hf.v_head_dim
        self.kv_lora_rank = hf.kv_lora_rank
        qk_dim, total_heads = self.nope_dim + self.rope_dim, hf.num_attention_heads
        bias = getattr(hf, "attention_bias", False)
        q_lora_rank = getattr(hf, "q_lora_rank", None)
        self.q_proj = self.q_a_proj = self.q_a_layernorm = self.q_b_proj = None
        if q_lora_rank:
            self.q_a_proj = ReplicatedLinear(hf.hidden_size, q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(q_lora_rank, _LATENT_NORM_EPS)
            self.q_b_proj = ColumnParallelLinear(q_lora_rank, total_heads * qk_dim, tp=tp)
        else:
            self.q_proj = ColumnParallelLinear(hf.hidden_size, total_heads * qk_dim, tp=tp)
        kv_a_out, kv_b_out = self.kv_lora_rank + self.rope_dim, total_heads * (self.nope_dim + self.v_dim)
        self.kv_a_proj_with_mqa = ReplicatedLinear(hf.hidden_size, kv_a_out, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, _LATENT_NORM_EPS)
        self.kv_b_proj = ColumnParallelLinear(self.kv_lora_rank, kv_b_out, tp=tp)
        self.o_proj = RowParallelLinear(total_heads * self.v_dim, hf.hidden_size, bias=bias, tp=tp)
        theta, scaling = rope_params(hf)
        # Released DeepSeek-V3 / GLM-4.7-Flash configs lack `rope_interleave`; their weights expect the
        # interleaved (GPT-J pair) layout, which is also transformers' default for both.
        self.rotary_emb = RotaryEmbedding(self.rope_dim, config.max_model_len, theta, scaling,
                                          interleaved=getattr(hf, "rope_interleave", True))
        self.attn = MLAAttention(self.num_heads, self.kv_lora_rank, self.nope_dim, self.rope_dim, self.v_dim,
                                 yarn_softmax_scale(scaling, qk_dim**-0.5))

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        # x: [T, hidden] -> [T, hidden]
        t = x.shape[0]
        if self.q_proj is not None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q_nope, q_pe = q.view(t, self.num_heads, -1).split([self.nope_dim, self.rope_dim], dim=-1)
        kv_c, k_pe = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        q_pe, k_pe = self.rotary_emb(positions, q_pe, k_pe.unsqueeze(1))  # [T, H, rope], [T, 1, rope]
        out = self.attn(q_nope, q_pe, self.kv_a_layernorm(kv_c), k_pe.squeeze(1), self.kv_b_proj.weight)
        return self.o_proj(out)


class DeepseekV3MoE(nn.Module):
    """Routed experts plus always-on shared experts; both leave TP partial sums, reduced once."""

    def __init__(self, config: ModelConfig, groups: ParallelGroups):
        super().__init__()
        hf = config.hf
        self.tp = groups.tp
        self.gate = MoEGate(hf)
        # Expert parallelism replaces TP inside the experts: whole experts per rank, summed over `ep`.
        experts_tp = groups.tp if groups.ep.size == 1 else SINGLE
        self.experts = FusedMoE(hf.n_routed_experts, hf.hidden_size, hf.moe_intermediate_size, experts_tp,
                                groups.ep, reduce_results=False,
                                token_split=groups.tp if groups.ep.size > 1 else SINGLE)
        n_shared = getattr(hf, "n_shared_experts", 0) or 0
        self.shared_experts = (GatedMLP(hf.hidden_size, hf.moe_intermediate_size * n_shared, groups.tp,
                                        reduce_results=False) if n_shared else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, hidden] -> [T, hidden]
        topk_weights, topk_ids = self.gate(x)
        routed = self.experts(x, topk_weights, topk_ids)  # TP-partial, or complete under EP
        shared = self.shared_experts(x) if self.shared_experts is not None else torch.zeros_like(x)
        if self.experts.ep.size > 1:
            return routed + self.tp.all_reduce(shared)
        return self.tp.all_reduce(routed + shared)


class DeepseekV3DecoderLayer(nn.Module):
    """Pre-norm block; `moe` picks DeepseekV3MoE over the dense GatedMLP. Subclasses swap the attention."""

    def __init__(self, config: ModelConfig, groups: ParallelGroups, moe: bool):
        super().__init__()
        hf = config.hf
        self.self_attn = self.make_attention(config, groups.tp)
        self.mlp = (DeepseekV3MoE(config, groups) if moe
                    else GatedMLP(hf.hidden_size, hf.intermediate_size, groups.tp))
        self.input_layernorm = RMSNorm(hf.hidden_size, hf.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(hf.hidden_size, hf.rms_norm_eps)

    @staticmethod
    def make_attention(config: ModelConfig, tp: Group) -> nn.Module:
        return DeepseekV3Attention(config, tp)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        normed, x = self.post_attention_layernorm.add_residual(self.self_attn(positions, self.input_layernorm(x)), x)
        return x + self.mlp(normed)


class DeepseekV3Model(nn.Module):
    def __init__(self, config: ModelConfig, groups: ParallelGroups, block_cls: type[DeepseekV3DecoderLayer],
                 moe_layers: list[bool]):
        super().__init__()
        hf = config.hf
        self.embed_tokens = VocabParallelEmbedding(hf.vocab_size, hf.hidden_size, groups.tp)
        self.layers = nn.ModuleList([block_cls(config, groups, moe) for moe in moe_layers])
        self.norm = RMSNorm(hf.hidden_size, hf.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        for layer in self.layers:
            x = layer(positions, x)
        return self.norm(x)


class DeepseekV3ForCausalLM(nn.Module):
    """Trunk layers 0..L-1 run in `forward`; checkpoint layers L..L+n-1 (n = `num_nextn_predict_layers`, MTP) load
    into `self.mtp`, which only the MTP proposer runs, and are skipped unread unless `with_mtp`. Checkpoint
    layers past those are unexpected."""

    block_cls: type[DeepseekV3DecoderLayer] = DeepseekV3DecoderLayer
    default_first_k_dense_replace = 3  # transformers' DeepseekV3Config default
    packed_modules_mapping = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}

    def __init__(self, config: ModelConfig, groups: ParallelGroups, with_mtp: bool = False):
        super().__init__()
        hf = config.hf
        self.num_hidden_layers = hf.num_hidden_layers
        moe_layers = [self.is_moe_layer(hf, i) for i in range(hf.num_hidden_layers)]
        self.model = DeepseekV3Model(config, groups, self.block_cls, moe_layers)
        self.lm_head = ParallelLMHead(hf.vocab_size, hf.hidden_size, groups.tp)
        if getattr(hf, "tie_word_embeddings", False):
            self.lm_head.weight = self.model.embed_tokens.weight
        self.num_mtp_layers = getattr(hf, "num_nextn_predict_layers", 0) or 0
        self.mtp = (DeepSeekMTP(config, groups, self.num_mtp_layers, self.block_cls)
                    if with_mtp and self.num_mtp_layers else None)

    def post_load(self) -> None:
        """After the weights are in: MTP layers share the trunk's embedding and LM head where they are copies."""
        if self.mtp is not None:
            freed = self.mtp.share_trunk_copies(self.model.embed_tokens, self.lm_head)
            if freed:
                logger.info("MTP layers share the trunk's embedding / LM head (exact copies): %.1f MiB freed",
                            freed / 2**20)

    def is_moe_layer(self, hf: Any, index: int) -> bool:
        # GLM-4.7-Flash as saved by transformers lists `mlp_layer_types`; released configs use
        # first_k_dense_replace / moe_layer_freq like DeepSeek-V3.
        layer_types = getattr(hf, "mlp_layer_types", None)
        if layer_types is not None:
            return layer_types[index] == "sparse"
        first_dense = getattr(hf, "first_k_dense_replace", None)
        first_dense = self.default_first_k_dense_replace if first_dense is None else first_dense
        return index >= first_dense and index % (getattr(hf, "moe_layer_freq", 1) or 1) == 0

    def map_weight_name(self, name: str) -> tuple[str, Any] | None:
        mtp_name = mtp_weight_name(name, self.num_hidden_layers, self.num_mtp_layers)
        if mtp_name is not None:
            if self.mtp is None:
                return None  # MTP layers load only when MTP drafts
            name = mtp_name
        return expert_weight_target(name) or packed_weight_target(self, name)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # input_ids, positions: [T] -> final normed hidden states [T, hidden]
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head.compute_logits(hidden)


class Glm4MoeLiteForCausalLM(DeepseekV3ForCausalLM):
    """GLM-4.7-Flash: DeepSeek-V3's architecture; only config defaults differ (first layer dense)."""

    default_first_k_dense_replace = 1

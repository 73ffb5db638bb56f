"""Llama-family decoder (GQA, SwiGLU, RMSNorm, RoPE); Qwen3 adds per-head q/k RMSNorm.

`GQAAttention` is shared by every GQA model (Glm4Moe included): bias, qk-norm and partial rotary
are constructor options.
"""

from __future__ import annotations

import torch
from torch import nn

from tandem.attention.layer import Attention
from tandem.config import ModelConfig
from tandem.distributed.groups import Group, ParallelGroups
from tandem.layers.activation import silu_and_mul
from tandem.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from tandem.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from tandem.layers.norm import RMSNorm
from tandem.layers.rotary import RotaryEmbedding, rope_params
from tandem.models import fused_decoder_layer


class GQAAttention(nn.Module):
    def __init__(self, config: ModelConfig, tp: Group, *, bias: bool = False, qk_norm: bool = False,
                 rotary_dim: int | None = None, input_size: int | None = None, o_bias: bool = False):
        super().__init__()
        hf = config.hf
        total_heads, total_kv = hf.num_attention_heads, getattr(hf, "num_key_value_heads", hf.num_attention_heads)
        self.head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // total_heads
        # input_size: an EAGLE-3 head's qkv reads [embedding | hidden] (2 H) instead of H. bias: q, k and v's;
        # o_bias: o_proj's (Llama's attention_bias is both, GLM-4.5's only the first)
        self.qkv_proj = QKVParallelLinear(input_size or hf.hidden_size, self.head_dim, total_heads, total_kv,
                                          bias=bias, tp=tp)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.o_proj = RowParallelLinear(total_heads * self.head_dim, hf.hidden_size, bias=o_bias, tp=tp)
        theta, scaling = rope_params(hf)
        self.rotary_emb = RotaryEmbedding(rotary_dim or self.head_dim, config.max_model_len, theta, scaling)
        eps = hf.rms_norm_eps
        self.q_norm = RMSNorm(self.head_dim, eps) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, eps) if qk_norm else None
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim**-0.5)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        # x: [T, hidden] -> [T, hidden]
        t = x.shape[0]
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        qkv = self.qkv_proj(x)  # [T, q_size + 2 kv_size]
        v = qkv[:, q_size + kv_size:]
        if self.q_norm is None or self.k_norm is None:
            # q's and k's heads lie side by side in the fused projection: one rotation serves both (half the
            # elementwise ops a layer, the same bits)
            heads = qkv[:, : q_size + kv_size].view(t, self.num_heads + self.num_kv_heads, self.head_dim)
            (qk,) = self.rotary_emb(positions, heads)
            q, k = qk[:, : self.num_heads], qk[:, self.num_heads:]
        else:
            q = self.q_norm(qkv[:, :q_size].reshape(t, self.num_heads, self.head_dim))
            k = self.k_norm(qkv[:, q_size: q_size + kv_size].reshape(t, self.num_kv_heads, self.head_dim))
            q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q.reshape(t, -1), k.reshape(t, -1), v))


class GatedMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, tp: Group, bias: bool = False,
                 reduce_results: bool = True):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2, bias=bias, tp=tp)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=bias, tp=tp,
                                           reduce_results=reduce_results)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, tp: Group, qk_norm: bool):
        super().__init__()
        hf = config.hf
        attention_bias = getattr(hf, "attention_bias", False)
        self.self_attn = GQAAttention(config, tp, bias=attention_bias, qk_norm=qk_norm, o_bias=attention_bias)
        self.mlp = GatedMLP(hf.hidden_size, hf.intermediate_size, tp, bias=getattr(hf, "mlp_bias", False))
        self.input_layernorm = RMSNorm(hf.hidden_size, hf.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(hf.hidden_size, hf.rms_norm_eps)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        normed, x = self.post_attention_layernorm.add_residual(self.self_attn(positions, self.input_layernorm(x)), x)
        return x + self.mlp(normed)


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, groups: ParallelGroups, qk_norm: bool):
        super().__init__()
        hf = config.hf
        self.embed_tokens = VocabParallelEmbedding(hf.vocab_size, hf.hidden_size, groups.tp)
        self.layers = nn.ModuleList(
            [LlamaDecoderLayer(config, groups.tp, qk_norm) for _ in range(hf.num_hidden_layers)])
        self.norm = RMSNorm(hf.hidden_size, hf.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        fused = fused_decoder_layer.layer_step(self.layers, x, positions)  # one native call a layer, or None
        for layer in self.layers:
            x = layer(positions, x) if fused is None else fused(layer, x)
        return self.norm(x)


class LlamaForCausalLM(nn.Module):
    qk_norm = False
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, config: ModelConfig, groups: ParallelGroups, with_mtp: bool = False):
        super().__init__()
        if with_mtp:
            raise ValueError(f"{config.architecture} has no MTP layers: speculative_config.method 'mtp' needs a "
                             "DeepSeek-V3 / GLM-4.x checkpoint with num_nextn_predict_layers > 0")
        hf = config.hf
        self.model = LlamaModel(config, groups, self.qk_norm)
        self.lm_head = ParallelLMHead(hf.vocab_size, hf.hidden_size, groups.tp)
        if getattr(hf, "tie_word_embeddings", False):
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # input_ids, positions: [T] -> final normed hidden states [T, hidden]
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head.compute_logits(hidden)


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True

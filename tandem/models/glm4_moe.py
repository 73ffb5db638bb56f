"""GLM-4.5 / 4.6 (Glm4Moe): DeepSeek-V3's MoE decoder and MTP layers with GQA attention instead of MLA.

Attention has q/k/v bias, optional per-head q/k RMSNorm, and neox-style RoPE on the first
head_dim * partial_rotary_factor dims.
"""

from __future__ import annotations

from torch import nn

from tandem.config import ModelConfig
from tandem.distributed.groups import Group
from tandem.models.deepseek_v3 import DeepseekV3DecoderLayer, DeepseekV3ForCausalLM
from tandem.models.llama import GQAAttention

# transformers' Glm4MoeConfig default when a config names none (released configs say 0.5).
_DEFAULT_PARTIAL_ROTARY_FACTOR = 0.5


class Glm4MoeDecoderLayer(DeepseekV3DecoderLayer):
    @staticmethod
    def make_attention(config: ModelConfig, tp: Group) -> nn.Module:
        hf = config.hf
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
        # transformers >= 5 keeps the factor in rope_parameters; released configs have it at top level.
        factor = (getattr(hf, "rope_parameters", None) or {}).get(
            "partial_rotary_factor", getattr(hf, "partial_rotary_factor", _DEFAULT_PARTIAL_ROTARY_FACTOR))
        return GQAAttention(config, tp, bias=getattr(hf, "attention_bias", False),
                            qk_norm=getattr(hf, "use_qk_norm", False), rotary_dim=int(head_dim * factor))


class Glm4MoeForCausalLM(DeepseekV3ForCausalLM):
    block_cls = Glm4MoeDecoderLayer
    default_first_k_dense_replace = 1  # transformers' Glm4MoeConfig default
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    }

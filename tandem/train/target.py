"""The bundled target: a small DeepseekV3ForCausalLM (MLA + noaux_tc MoE + shared expert) with one MTP layer,
trained jointly. Scope: config, the training module built from Hugging Face's own DeepSeek-V3 blocks (so the
saved checkpoint is exactly what transformers and vLLM load), losses, and aux-loss-free expert balancing.

MTP objective (DeepSeek-V3 §2.2, and tandem's drafting in DESIGN §4): depth 1 pairs the trunk's final-normed
hidden state at position i with the embedding of t_{i+1} and predicts t_{i+2}. Tandem reuses the single MTP
layer for K drafts by feeding back its own pre-norm output, so depths 2..D train exactly that: the input hidden
at position i is the previous depth's output at i - 1 (stale by one more token), the label stays t_{i+2}.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tandem.train.tokenizer import BOS_ID, EOS_ID, PAD_ID

# A released-style DeepSeek-V3 config.json, shrunk: kv_lora_rank 512 and qk_rope_head_dim 64 are kept so that
# vLLM's MLA kernels (which assume them) and transformers load it unmodified.
TARGET_CONFIG: dict[str, Any] = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "vocab_size": 2048,
    "hidden_size": 256,
    "intermediate_size": 512,
    "moe_intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_nextn_predict_layers": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "n_shared_experts": 1,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "routed_scaling_factor": 2.5,
    "n_group": 1,
    "topk_group": 1,
    "topk_method": "noaux_tc",
    "scoring_func": "sigmoid",
    "norm_topk_prob": True,
    "first_k_dense_replace": 1,
    "q_lora_rank": 128,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 32,
    "qk_rope_head_dim": 64,
    "v_head_dim": 64,
    "rope_interleave": True,
    "hidden_act": "silu",
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "rope_scaling": None,
    "attention_bias": False,
    "attention_dropout": 0.0,
    "tie_word_embeddings": False,
    "initializer_range": 0.02,
    "bos_token_id": BOS_ID,
    "eos_token_id": EOS_ID,
    "pad_token_id": PAD_ID,
    # Weights are stored in bfloat16 (the size budget); the model computes in float32, so tandem, transformers and
    # every parallel layout give bit-comparable greedy outputs on CPU.
    "torch_dtype": "float32",
}
MTP_LOSS_WEIGHT = 0.3
BIAS_UPDATE_SPEED = 1e-3  # gamma of DeepSeek-V3's auxiliary-loss-free balancing


def hf_config(raw: dict[str, Any], num_layers: int) -> Any:
    import transformers

    kwargs = {k: v for k, v in raw.items() if k not in ("architectures", "model_type", "torch_dtype", "rope_scaling")}
    kwargs["num_hidden_layers"] = num_layers
    return transformers.DeepseekV3Config(**kwargs)


class MTPHead(nn.Module):
    """The MTP layer's own tensors; its decoder block is `lm.model.layers[L]` and it shares embed and head."""

    def __init__(self, hidden: int, eps: float):
        super().__init__()
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RMSNorm

        self.enorm, self.hnorm = DeepseekV3RMSNorm(hidden, eps), DeepseekV3RMSNorm(hidden, eps)
        self.eh_proj = nn.Linear(2 * hidden, hidden, bias=False)
        self.norm = DeepseekV3RMSNorm(hidden, eps)  # shared_head.norm


class TargetForTraining(nn.Module):
    def __init__(self, raw: dict[str, Any] = TARGET_CONFIG, mtp_depths: int = 3):
        super().__init__()
        import transformers

        self.num_layers = raw["num_hidden_layers"]
        self.mtp_depths = mtp_depths
        # Built with L + 1 layers so the MTP block is named and stored like a trunk MoE layer (model.layers.L.*);
        # config.num_hidden_layers is then set back to L, which is what HF's forward and save_pretrained see.
        self.lm = transformers.DeepseekV3ForCausalLM(hf_config(raw, self.num_layers + 1))
        self.lm.config.num_hidden_layers = self.num_layers
        self.mtp = MTPHead(raw["hidden_size"], raw["rms_norm_eps"])
        self._init_weights()

    def _init_weights(self) -> None:
        # HF's init leaves the router and the expert bias at zero; small random routers make experts differ.
        with torch.no_grad():
            for name, p in self.named_parameters():
                if p.dim() >= 2:
                    nn.init.normal_(p, std=0.02)
                    if name.endswith(("o_proj.weight", "down_proj.weight", "down_proj")):
                        p.mul_(1 / (2 * (self.num_layers + 1)) ** 0.5)  # GPT-2-style residual scaling
                elif name.endswith("weight"):
                    p.fill_(1.0)

    @property
    def layers(self) -> nn.ModuleList:
        return self.lm.model.layers

    def _run_layers(self, h: torch.Tensor, layers: list[nn.Module], pe: tuple[torch.Tensor, torch.Tensor],
                    positions: torch.Tensor, keep: set[int] | None = None
                    ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        kept: dict[int, torch.Tensor] = {}
        for i, layer in enumerate(layers):
            # attention_mask=None: HF's SDPA path is then causal (is_causal) over the whole sequence.
            h = layer(h, attention_mask=None, position_ids=positions, position_embeddings=pe)
            if keep is not None and i in keep:
                kept[i] = h
        return h, kept

    def forward(self, ids: torch.Tensor, keep_layers: set[int] | None = None
                ) -> tuple[torch.Tensor, list[torch.Tensor], dict[int, torch.Tensor]]:
        """ids: [B, T] -> (trunk logits [B, T, V], MTP logits per depth [B, T, V], kept layer outputs [B, T, H]).
        MTP depth d logits at i predict t_{i+2} (the last two positions have no label)."""
        B, T = ids.shape
        positions = torch.arange(T).unsqueeze(0).expand(B, T)
        embed = self.lm.model.embed_tokens(ids)  # [B, T, H]
        pe = self.lm.model.rotary_emb(embed, positions)
        h, kept = self._run_layers(embed, list(self.layers[: self.num_layers]), pe, positions, keep_layers)
        h = self.lm.model.norm(h)  # [B, T, H] final-normed: what tandem feeds the MTP layer
        logits = self.lm.lm_head(h)
        # MTP input token at i is t_{i+1}; the embedding at position 0 is zeroed, as tandem and vLLM feed it.
        next_embed = torch.cat([embed[:, 1:], torch.zeros_like(embed[:, :1])], dim=1)
        next_embed[:, 0] = 0
        e = self.mtp.enorm(next_embed)
        mtp_logits, prev = [], h
        for depth in range(self.mtp_depths):
            if depth:
                prev = torch.cat([torch.zeros_like(prev[:, :1]), prev[:, :-1]], dim=1)  # stale by one token
            x = self.mtp.eh_proj(torch.cat([e, self.mtp.hnorm(prev)], dim=-1))
            prev, _ = self._run_layers(x, [self.layers[self.num_layers]], pe, positions)
            mtp_logits.append(self.lm.lm_head(self.mtp.norm(prev)))
        return logits, mtp_logits, kept

    def loss(self, ids: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
        logits, mtp_logits, _ = self(ids)
        V = logits.shape[-1]
        main = F.cross_entropy(logits[:, :-1].reshape(-1, V), ids[:, 1:].reshape(-1))
        total, stats = main, {"loss": main.item()}
        for d, ml in enumerate(mtp_logits, 1):
            # depth d at position i predicts t_{i+2}; depth d >= 2 has no valid input at its first d - 1 positions
            lo = d - 1
            mtp = F.cross_entropy(ml[:, lo:-2].reshape(-1, V), ids[:, lo + 2:].reshape(-1))
            total = total + MTP_LOSS_WEIGHT * mtp
            stats[f"mtp{d}"] = mtp.item()
        return total, stats

    @torch.no_grad()
    def balance_experts(self, counts: list[torch.Tensor]) -> None:
        """Aux-loss-free balancing: raise the selection bias of under-loaded experts, lower the over-loaded."""
        for gate, count in zip(self.gates(), counts, strict=True):
            gate.e_score_correction_bias += BIAS_UPDATE_SPEED * torch.sign(count.mean() - count)

    def gates(self) -> list[nn.Module]:
        return [layer.mlp.gate for layer in self.layers if hasattr(layer.mlp, "gate")]

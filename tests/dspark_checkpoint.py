"""Builder of tiny random DSpark drafter folders (config.json + model.safetensors) for a tiny target checkpoint.
Scope: the on-disk layout of docs/dspark.md with weights large enough that drafts vary (and the Markov head matters).

Weights are seeded per tensor name, so dropping a tensor or changing the config leaves the others unchanged.
"""

from __future__ import annotations

import json
import zlib
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

_DEFAULTS: dict[str, Any] = {
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "intermediate_size": 96,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "block_size": 4,
    "target_layer_ids": [0, 1],
    "markov_rank": 8,
}


def _std(name: str) -> float:
    if name.startswith("markov_head."):
        return 1.0  # a Markov correction of std ~3 against target logits of std ~6: it changes some argmaxes
    if name.startswith("confidence_head."):
        return 0.3
    if name == "fc.weight":
        return 0.1
    return 0.2


def _value(name: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    g = torch.Generator()
    g.manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63))
    noise = torch.randn(shape, generator=g)
    if name.endswith("norm.weight"):  # RMSNorm scales
        return 1.0 + 0.1 * noise
    return _std(name) * noise


def drafter_tensor_shapes(cfg: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    h, d, v, ffn = cfg["hidden_size"], cfg["head_dim"], cfg["vocab_size"], cfg["intermediate_size"]
    shapes: dict[str, tuple[int, ...]] = {
        "fc.weight": (h, len(cfg["target_layer_ids"]) * cfg["target_hidden_size"]),
        "hidden_norm.weight": (h,), "norm.weight": (h,),
        "markov_head.markov_w1.weight": (v, cfg["markov_rank"]),
        "markov_head.markov_w2.weight": (v, cfg["markov_rank"]),
        "confidence_head.weight": (1, h), "confidence_head.bias": (1,),
    }
    for i in range(cfg["num_hidden_layers"]):
        p = f"layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (cfg["num_attention_heads"] * d, h),
            p + "self_attn.k_proj.weight": (cfg["num_key_value_heads"] * d, h),
            p + "self_attn.v_proj.weight": (cfg["num_key_value_heads"] * d, h),
            p + "self_attn.o_proj.weight": (h, cfg["num_attention_heads"] * d),
            p + "mlp.gate_proj.weight": (ffn, h), p + "mlp.up_proj.weight": (ffn, h),
            p + "mlp.down_proj.weight": (h, ffn),
        }
    return shapes


def build_dspark_drafter(target: Path, path: Path, *, seed: int = 0, overrides: dict[str, Any] | None = None,
                         drop: tuple[str, ...] = (), bigrams: dict[int, int] | None = None,
                         boost: float = 10.0) -> Path:
    """Write a random drafter for the checkpoint in `target` into `path`; `overrides` update config.json (the
    tensors follow it), `drop` leaves tensors out. The noise token defaults to the last vocabulary id.

    `bigrams` (previous token -> next token, e.g. read off the target's greedy outputs) make the Markov head
    full-rank and add `boost` to each pair's logit: a random drafter is never accepted, one that "memorised"
    the target's continuations is, so the accept-some / accept-all paths get exercised."""
    target_cfg = json.loads((Path(target) / "config.json").read_text())
    vocab = target_cfg["vocab_size"]
    cfg: dict[str, Any] = {
        "architectures": ["DSparkDrafter"], "model_type": "dspark", **_DEFAULTS,
        "vocab_size": vocab, "hidden_size": target_cfg["hidden_size"], "target_hidden_size": target_cfg["hidden_size"],
        "noise_token_id": vocab - 1, **({"markov_rank": vocab} if bigrams else {}), **(overrides or {}),
    }
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    shapes = drafter_tensor_shapes(cfg)
    tensors = {name: _value(name, shape, seed) for name, shape in shapes.items() if name not in drop}
    if bigrams:
        # markov(prev) = w2 @ w1[prev] = sqrt(boost) * w2[:, prev]: boost on the memorised next token, noise elsewhere
        tensors["markov_head.markov_w1.weight"] = boost**0.5 * torch.eye(vocab)
        w2 = 0.3 * tensors["markov_head.markov_w2.weight"]
        w2[list(bigrams.values()), list(bigrams)] = boost**0.5
        tensors["markov_head.markov_w2.weight"] = w2
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path

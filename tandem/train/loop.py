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

from tandem.data.gsm8k import Problem, arithmetic_drill, format_example, synthetic_stream
from tandem.train.target import TARGET_CONFIG, TargetForTraining
from tandem.train.tokenizer import BOS_ID


@dataclass(frozen=True)
class Phase:
    steps: int
    batch_size: int
    seq_len: int
    synthetic_share: float = 0.5  # of examples: synthetic problems (the rest GSM8K train, or drills)
    drill_share: float = 0.0  # of examples: one-line arithmetic drills
    peak_lr: float = 2e-3
    # Start over from the weights as a saved checkpoint holds them (bfloat16-rounded) with a fresh optimizer and
    # LR schedule, so `--resume-from CHECKPOINT --start-phase i` continues exactly as the one-process run does.
    restart: bool = False


# Most steps on short sequences (cheap attention), then a long phase so 5-shot prompts (~850-1,300 tokens)
# sit inside the trained context, then an arithmetic phase: after the first two the model has GSM8K's layout
# down but computes 4*6 = 16, so the last phase spends its tokens on drills and synthetic problems.
DEFAULT_PHASES = (Phase(520, 12, 512), Phase(80, 4, 1536),
                  Phase(260, 12, 512, synthetic_share=0.45, drill_share=0.4, peak_lr=1e-3, restart=True))


def packed_sequences(gsm8k: list[Problem], encode: Any, seed: int, seq_len: int,
                     synthetic_share: float = 0.5, drill_share: float = 0.0) -> Iterator[list[int]]:
    """Endless [BOS, example, example, ...] rows of exactly seq_len tokens; each row starts at an example
    boundary (as a few-shot prompt does), the example that overflows is cut."""
    rng = random.Random(seed)
    synthetic = synthetic_stream(seed)
    order: list[int] = []

    def next_example() -> list[int]:
        draw = rng.random()
        if draw < drill_share:
            return encode(format_example(arithmetic_drill(rng)))
        if not gsm8k or draw < drill_share + synthetic_share:
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
    """Warmup then cosine to 10% over one schedule (a phase with its own peak starts a schedule of its own)."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def _optimizer(model: TargetForTraining, peak_lr: float) -> torch.optim.Optimizer:
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                             lr=peak_lr, betas=(0.9, 0.95))


@torch.no_grad()
def _round_like_checkpoint(model: TargetForTraining) -> None:
    for p in model.parameters():
        p.copy_(p.to(torch.bfloat16).float())  # the routing bias is a buffer and stays float32, as saved


def _schedules(phases: tuple[Phase, ...]) -> list[tuple[int, int]]:
    """Per phase: (step within its LR schedule, that schedule's length); a restart phase begins a new schedule."""
    out, bounds = [], []
    for i, ph in enumerate(phases):
        if i == 0 or ph.restart:
            bounds.append(i)
    for b, start in enumerate(bounds):
        end = bounds[b + 1] if b + 1 < len(bounds) else len(phases)
        total = sum(ph.steps for ph in phases[start:end])
        offset = 0
        for ph in phases[start:end]:
            out.append((offset, total))
            offset += ph.steps
    return out


def load_for_training(folder: Path, config: dict[str, Any] = TARGET_CONFIG) -> TargetForTraining:
    """A saved checkpoint (save_target's layout) back into the training module, in float32."""
    from safetensors.torch import load_file

    model = TargetForTraining(config)
    tensors = load_file(str(folder / "model.safetensors"))
    mtp = f"model.layers.{config['num_hidden_layers']}."
    own = {"enorm.weight": model.mtp.enorm.weight, "hnorm.weight": model.mtp.hnorm.weight,
           "eh_proj.weight": model.mtp.eh_proj.weight, "shared_head.norm.weight": model.mtp.norm.weight}
    state = model.lm.state_dict()
    with torch.no_grad():
        for leaf, param in own.items():
            param.copy_(tensors.pop(mtp + leaf).float())
        for leaf in ("embed_tokens.weight", "shared_head.head.weight"):
            tensors.pop(mtp + leaf)  # copies of the trunk's embedding and head
        for name in list(tensors):
            # per-expert checkpoint tensors -> HF's fused [E, 2I, H] gate_up_proj and [E, H, I] down_proj
            if ".mlp.experts." in name:
                prefix, expert, leaf = name.rsplit(".", 2)[0].rsplit(".", 1)[0], int(name.split(".")[-3]), name
                kind = leaf.split(".")[-2]
                value = tensors.pop(name).float()
                inter = value.shape[0] if kind != "down_proj" else value.shape[1]
                if kind == "gate_proj":
                    state[f"{prefix}.gate_up_proj"][expert, :inter] = value
                elif kind == "up_proj":
                    state[f"{prefix}.gate_up_proj"][expert, inter:] = value
                else:
                    state[f"{prefix}.down_proj"][expert] = value
        for name, value in tensors.items():
            state[name].copy_(value.to(state[name].dtype))
    return model


def train_target(gsm8k: list[Problem], encode: Any, phases: tuple[Phase, ...] = DEFAULT_PHASES, seed: int = 0,
                 peak_lr: float = 2e-3, log: Any = print, config: dict[str, Any] = TARGET_CONFIG,
                 start_phase: int = 0, resume_from: Path | None = None,
                 ) -> tuple[TargetForTraining, list[dict[str, float]]]:
    """`phases[i].peak_lr` of the first phase of each schedule sets that schedule's peak (`peak_lr` overrides
    the first phase's, for tests). `resume_from` + `start_phase`: continue a saved checkpoint at a restart phase."""
    torch.manual_seed(seed)
    if resume_from is not None:
        if not phases[start_phase].restart:
            raise ValueError(f"start_phase={start_phase}: resuming needs a restart phase (bf16 weights, fresh "
                             "optimizer), as only those begin from what a checkpoint holds")
        model = load_for_training(resume_from, config).train()
    else:
        model = TargetForTraining(config).train()
    counts: list[torch.Tensor] = [torch.zeros(config["n_routed_experts"]) for _ in model.gates()]

    def count_hook(index: int) -> Any:
        def hook(_module: Any, _inputs: Any, output: tuple[torch.Tensor, ...]) -> None:
            counts[index] += torch.bincount(output[2].flatten(), minlength=len(counts[index])).float()
        return hook

    for i, gate in enumerate(model.gates()):
        gate.register_forward_hook(count_hook(i))

    schedules = _schedules(phases)
    history: list[dict[str, float]] = []
    step = sum(ph.steps for ph in phases[:start_phase])
    start = time.perf_counter()
    opt = None
    for index in range(start_phase, len(phases)):
        phase = phases[index]
        peak = peak_lr if index == 0 else phase.peak_lr
        if opt is None or phase.restart:
            if phase.restart:
                _round_like_checkpoint(model)
            opt = _optimizer(model, peak)
            schedule_peak = peak
        stream = packed_sequences(gsm8k, encode, seed + step, phase.seq_len, phase.synthetic_share,
                                  phase.drill_share)
        offset, total = schedules[index]
        for local in range(phase.steps):
            ids = torch.tensor([next(stream) for _ in range(phase.batch_size)])  # [B, T]
            for group in opt.param_groups:
                group["lr"] = _lr(offset + local, total, schedule_peak)
            for c in counts:
                c.zero_()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss, stats = model.loss(ids)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            model.balance_experts(counts)
            stats = {"step": step, "phase": index, "seq_len": phase.seq_len,
                     "elapsed_s": round(time.perf_counter() - start, 1), **{k: round(v, 4) for k, v in stats.items()}}
            history.append(stats)
            if step % 10 == 0 or local == phase.steps - 1:
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

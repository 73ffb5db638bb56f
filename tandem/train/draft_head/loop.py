"""The optimisation loop over cached features: length-bucketed batches, AdamW with warmup + cosine, held-out
evaluation (the acceptance curve in OUT/train_log.jsonl), checkpoints that a rerun resumes, and a wall-clock
deadline that shortens the schedule instead of cutting it off mid-decay."""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from tandem.train.draft_head.features import FeatureStore
from tandem.train.draft_head.head import DraftHead
from tandem.train.draft_head.objective import evaluate, make_batch, ttt_loss
from tandem.train.draft_head.vocab import DraftVocab

MAX_EVAL_SEQUENCES = 64
GRAD_CLIP = 0.5
MIN_LR_SHARE = 0.1


@dataclass(frozen=True)
class LoopConfig:
    epochs: int
    batch_tokens: int
    lr: float
    num_steps: int  # TTT depth
    seed: int
    deadline: float  # time.time() by which training must have stopped
    bf16: bool = True  # autocast: bf16 matmuls ran ~2.8x faster than fp32 on the 2-core AVX512-BF16 EPYC
    checkpoint_every: int = 25
    eval_every: int = 40
    max_steps: int | None = None  # the schedule's length when shorter than the epochs' (a run to reproduce)


def split(num_sequences: int, seed: int) -> tuple[list[int], list[int]]:
    order = list(range(num_sequences))
    random.Random(seed).shuffle(order)
    num_eval = min(MAX_EVAL_SEQUENCES, max(1, num_sequences // 20))
    return order[num_eval:], order[:num_eval]


def batches(store: FeatureStore, indices: list[int], batch_tokens: int, rng: random.Random | None,
            ) -> list[list[int]]:
    """Groups whose padded size (rows x longest) stays within batch_tokens; random order when rng is given."""
    order = list(indices)
    if rng is not None:
        rng.shuffle(order)
    out: list[list[int]] = []
    for lo in range(0, len(order), 64):  # sort by length inside windows of 64: little padding, still shuffled
        window = sorted(order[lo:lo + 64], key=lambda i: len(store.rows[i]["ids"]))
        cur: list[int] = []
        for i in window:
            if cur and (len(cur) + 1) * len(store.rows[i]["ids"]) > batch_tokens:
                out.append(cur)
                cur = []
            cur.append(i)
        out.append(cur)
    if rng is not None:
        rng.shuffle(out)
    return out


def lr_at(step: int, total: int, peak: float) -> float:
    warmup = max(1, min(50, total // 10))
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (MIN_LR_SHARE + (1 - MIN_LR_SHARE) * 0.5 * (1 + math.cos(math.pi * progress)))


def train(head: DraftHead, embed: torch.Tensor, store: FeatureStore, vocab: DraftVocab, cfg: LoopConfig,
          out: Path, log: Callable[[dict], None]) -> DraftHead:
    train_idx, eval_idx = split(len(store), cfg.seed)
    eval_batches = batches(store, eval_idx, cfg.batch_tokens, None)
    plan = [b for epoch in range(cfg.epochs)
            for b in batches(store, train_idx, cfg.batch_tokens, random.Random(cfg.seed * 1000 + epoch))]
    plan = plan[:cfg.max_steps]
    to_draft = vocab.to_draft()

    def held_out() -> dict[str, float]:
        return evaluate(head, embed, store, eval_batches, vocab, to_draft, cfg.num_steps, cfg.bf16)

    opt = torch.optim.AdamW(head.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0)
    ckpt_path = out / "checkpoint.pt"
    step, total, tokens_seen = 0, len(plan), 0
    if ckpt_path.is_file():
        state = torch.load(ckpt_path, weights_only=True)
        head.load_state_dict(state["head"])
        opt.load_state_dict(state["opt"])
        step, total, tokens_seen = state["step"], state["total"], state["tokens_seen"]
        log({"stage": "resume", "step": step, "total_steps": total})
    else:
        log({"stage": "train", "train_sequences": len(train_idx), "eval_sequences": len(eval_idx),
             "total_steps": total, **held_out(),
             "step": 0, "tokens_seen": 0})

    def checkpoint() -> None:
        torch.save({"head": head.state_dict(), "opt": opt.state_dict(), "step": step, "total": total,
                    "tokens_seen": tokens_seen}, out / "checkpoint.tmp")
        (out / "checkpoint.tmp").rename(ckpt_path)

    start, first_step, planned = time.time(), step, len(plan)
    bar = tqdm(total=total, initial=step, desc="draft head")
    while step < total and time.time() < cfg.deadline:
        lr = lr_at(step, total, cfg.lr)
        for group in opt.param_groups:
            group["lr"] = lr
        batch = make_batch(store, plan[step], cfg.num_steps)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.bf16):
            loss, stats = ttt_loss(head, embed, batch, vocab, to_draft, cfg.num_steps)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), GRAD_CLIP)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        tokens_seen += batch.num_tokens
        bar.update(1)
        if step - first_step == 10 or (step - first_step) % cfg.eval_every == 0:
            # fit the schedule to the time left at the pace so far (evaluations included at ~1 step each), again
            # every evaluation: a machine that gets busier (or quieter) moves the end of the cosine, not past it
            per_step = (time.time() - start) / (step - first_step)
            fits = min(planned, step + int((cfg.deadline - time.time()) / per_step * 0.9))
            if fits != total:
                total = max(step + 1, fits)
                log({"stage": "schedule", "seconds_per_step": round(per_step, 3), "total_steps": total})
                bar.total = total
        if step % 10 == 0:
            log({"stage": "train", "step": step, "tokens_seen": tokens_seen, "lr": round(lr, 7),
                 **{k: round(v, 4) for k, v in stats.items()}})
        if step % cfg.eval_every == 0 or step == total:
            log({"stage": "eval", "step": step, "tokens_seen": tokens_seen,
                 **held_out()})
        if step % cfg.checkpoint_every == 0 or step == total:
            checkpoint()
    bar.close()
    checkpoint()
    return head

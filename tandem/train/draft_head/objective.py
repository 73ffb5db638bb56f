"""Batches of cached sequences and the TTT objective: soft cross-entropy against the target's distribution
renormalised to the draft vocabulary, top-1 agreement with the target's full-vocabulary argmax, and the simulated
greedy acceptance length.

Index map for one sequence x[0..n-1] with response start s (t = training index, j = TTT step):
    aux[t], id x[t+1+j], position t+j -> predicts x[t+2+j]; label = target top-k at index t+1+j.
    Valid when the predicted token is a response token that exists: s <= t+2+j <= n-1.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import torch

from tandem.train.draft_head.features import FeatureStore
from tandem.train.draft_head.head import DraftHead
from tandem.train.draft_head.vocab import DraftVocab

STEP_DECAY = 0.8  # a later step only counts when the earlier ones were accepted


@dataclass
class Batch:
    aux: torch.Tensor  # [B, T, A*H] float32
    input_ids: torch.Tensor  # [B, T + D - 1]: [b, u] = x[u + 1]
    next_ids: torch.Tensor  # [B, T + D - 1]: [b, u] = x[u + 2], the token step j at t = u - j predicts
    label_ids: torch.Tensor  # [B, T + D - 1, k] target top-k ids at index u + 1
    label_probs: torch.Tensor  # [B, T + D - 1, k]
    valid: torch.Tensor  # [B, T + D - 1] bool: x[u + 2] is a response token that exists
    num_tokens: int


def make_batch(store: FeatureStore, indices: list[int], num_steps: int) -> Batch:
    rows = [store.get(i) for i in indices]
    lengths = [len(store.rows[i]["ids"]) for i in indices]
    t = max(lengths) - 1
    width = t + num_steps - 1
    b, k = len(indices), rows[0][1].shape[1]
    aux = torch.zeros(b, t, rows[0][0].shape[1])
    input_ids = torch.zeros(b, width, dtype=torch.long)
    next_ids = torch.full((b, width), -1, dtype=torch.long)
    label_ids = torch.zeros(b, width, k, dtype=torch.long)
    label_probs = torch.zeros(b, width, k)
    valid = torch.zeros(b, width, dtype=torch.bool)
    for r, (i, (a, top_ids, top_probs)) in enumerate(zip(indices, rows, strict=True)):
        ids, s, n = torch.tensor(store.rows[i]["ids"]), store.rows[i]["response_start"], lengths[r]
        aux[r, :n - 1] = a[:n - 1].float()
        input_ids[r, :n - 1] = ids[1:]
        next_ids[r, :n - 2] = ids[2:]
        label_ids[r, :n - 1], label_probs[r, :n - 1] = top_ids[1:], top_probs[1:]
        valid[r, max(s - 2, 0):n - 2] = True
    return Batch(aux, input_ids, next_ids, label_ids, label_probs, valid, int(valid.sum()))


def ttt_loss(head: DraftHead, embed: torch.Tensor, batch: Batch, vocab: DraftVocab, to_draft: torch.Tensor,
             num_steps: int, accept_k: int = 3) -> tuple[torch.Tensor, dict[str, float]]:
    t = batch.aux.shape[1]
    hidden = head.ttt_hidden(embed, batch.aux, batch.input_ids, num_steps)
    loss = torch.zeros(())
    stats: dict[str, float] = {}
    hits = []
    for j, step_hidden in enumerate(hidden):
        step_valid = batch.valid[:, j:j + t]  # [B, T]
        # norm + LM head + softmax only at the N valid positions: rows [N, ...] below
        logits = head.lm_head(head.norm(step_hidden[step_valid])).float()  # [N, draft_vocab]
        label_draft = to_draft[batch.label_ids[:, j:j + t][step_valid]]  # [N, k], -1 outside the draft vocab
        probs = batch.label_probs[:, j:j + t][step_valid] * (label_draft >= 0)
        mass = probs.sum(-1)  # [N]
        has_mass = mass > 0
        logp = torch.log_softmax(logits, -1).gather(-1, label_draft.clamp_min(0))  # [N, k]
        ce = -(probs / mass.clamp_min(1e-12)[:, None] * logp).sum(-1)  # [N]
        n = has_mass.sum().clamp_min(1)
        step_ce = (ce * has_mass).sum() / n
        loss = loss + STEP_DECAY ** j * step_ce
        guess = vocab.target_ids[logits.argmax(-1)]  # [N] target ids
        stats[f"ce{j}"] = step_ce.item()
        stats[f"top1_{j}"] = (guess == batch.label_ids[:, j:j + t, 0][step_valid]).sum().item() / max(
            int(step_valid.sum()), 1)
        hit = torch.zeros_like(step_valid)
        hit[step_valid] = guess == batch.next_ids[:, j:j + t][step_valid]
        hits.append(hit)
    accepted = torch.stack(hits[:accept_k], -1).long().cumprod(-1).sum(-1)  # [B, T] leading hits
    counted = batch.valid[:, :t]
    stats["accept_len"] = 1.0 + accepted[counted].float().mean().item() if counted.any() else 1.0
    stats["loss"] = loss.item()
    return loss, stats


def init_head(head: DraftHead, target_lm_head: torch.Tensor, vocab: DraftVocab, seed: int) -> None:
    """Small random weights, unit norms, and lm_head rows copied from the target's head at the draft ids."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in head.named_parameters():
            if name == "lm_head.weight":
                p.copy_(target_lm_head[vocab.target_ids].float())
            elif p.dim() == 1:
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)


def init_from_target_layer(head: DraftHead, layer: dict[str, torch.Tensor], final_norm: torch.Tensor) -> None:
    """The decoder layer starts as the target's layer at the last aux id, reading that aux stream: fc selects it
    (identity on its block, zero elsewhere), the hidden half of q/k/v and the rest of the layer are the target's, the
    embedding half stays init_head's small random weights, and the final norm is the target's. At step 0 the head
    then computes exactly that target layer over the stream entering it, a trained starting point for what it must
    learn instead of random features (SmolLM2-135M, 1,536 prompts, 160 steps from scratch: held-out acceptance
    length 1.70 -> 1.75, step-0 cross-entropy 3.59 -> 3.04). `layer`: the target layer's tensors named as in its
    checkpoint below `model.layers.N.` (q_proj / k_proj / v_proj / o_proj, the MLP, the two norms). A Qwen3
    layer's q_norm / k_norm have no place in the head's Llama layer: for Qwen3 a close start, not an exact one."""
    mid, h = head.midlayer, head.shape.hidden_size
    with torch.no_grad():
        for name in ("q_proj", "k_proj", "v_proj"):
            getattr(mid.self_attn, name).weight[:, h:] = layer[f"self_attn.{name}.weight"]
        mid.self_attn.o_proj.weight.copy_(layer["self_attn.o_proj.weight"])
        for name in ("gate_proj", "up_proj", "down_proj"):
            getattr(mid.mlp, name).weight.copy_(layer[f"mlp.{name}.weight"])
        mid.hidden_norm.weight.copy_(layer["input_layernorm.weight"])
        mid.post_attention_layernorm.weight.copy_(layer["post_attention_layernorm.weight"])
        head.norm.weight.copy_(final_norm)
        head.fc.weight.zero_()
        head.fc.weight[:, -h:] = torch.eye(h)


def warm_start(head: DraftHead, vocab: DraftVocab, folder: Path, target_vocab_size: int,
               aux_layers: list[int]) -> int:
    """Continue from a trained head folder (`--init-from`): every weight is copied, and the LM head row of each
    draft id whose target token the old vocabulary also held (the rest keep init_head's rows). Returns the rows
    copied. A head of another shape, target vocabulary or aux-layer choice is refused, naming the difference."""
    from tandem.train.draft_head.export import load_head

    old, old_vocab, config = load_head(folder)
    wanted = dataclasses.replace(head.shape, draft_vocab_size=old.shape.draft_vocab_size)
    checks = [("head shape", old.shape, wanted), ("vocab_size", config["vocab_size"], target_vocab_size),
              ("eagle_aux_hidden_state_layer_ids", config["eagle_aux_hidden_state_layer_ids"], aux_layers)]
    for name, got, want in checks:
        if got != want:
            raise ValueError(f"--init-from {folder} does not fit this target: its {name} is {got}, "
                             f"this target needs {want}")
    old_rows = old_vocab.to_draft()[vocab.target_ids]  # [draft_vocab] old draft id per new one, -1 if absent
    kept = old_rows >= 0
    sources = dict(old.named_parameters())
    with torch.no_grad():
        for name, p in head.named_parameters():
            src = sources[name]
            if name == "lm_head.weight":
                p[kept] = src[old_rows[kept]]
            else:
                p.copy_(src)
    return int(kept.sum())


def evaluate(head: DraftHead, embed: torch.Tensor, store: FeatureStore, batches: list[list[int]],
             vocab: DraftVocab, to_draft: torch.Tensor, num_steps: int, bf16: bool = False) -> dict[str, float]:
    """Token-weighted held-out metrics (accept_len weighted by positions)."""
    totals: dict[str, float] = {}
    weight = 0
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        for indices in batches:
            batch = make_batch(store, indices, num_steps)
            _, stats = ttt_loss(head, embed, batch, vocab, to_draft, num_steps)
            for key, value in stats.items():
                totals[key] = totals.get(key, 0.0) + value * batch.num_tokens
            weight += batch.num_tokens
    return {f"eval_{k}": round(v / max(weight, 1), 5) for k, v in totals.items()}

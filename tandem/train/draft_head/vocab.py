"""The draft vocabulary: the most frequent response tokens (plus the target's end tokens), as EAGLE-3's `d2t`
offsets and `t2d` mask.

Worked example, target vocab 6, draft ids kept = target ids [1, 4, 5] (sorted ascending):
    d2t = [1 - 0, 4 - 1, 5 - 2] = [1, 3, 3]   (target id = draft id + d2t[draft id])
    t2d = [F, T, F, F, T, T]
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class DraftVocab:
    target_ids: torch.Tensor  # [draft_vocab] int64, ascending
    target_vocab_size: int

    @property
    def size(self) -> int:
        return int(self.target_ids.numel())

    @property
    def d2t(self) -> torch.Tensor:
        return self.target_ids - torch.arange(self.size)

    @property
    def t2d(self) -> torch.Tensor:
        mask = torch.zeros(self.target_vocab_size, dtype=torch.bool)
        mask[self.target_ids] = True
        return mask

    def to_draft(self) -> torch.Tensor:
        """[target_vocab] int64: draft id of each target id, -1 outside the draft vocabulary."""
        index = torch.full((self.target_vocab_size,), -1, dtype=torch.long)
        index[self.target_ids] = torch.arange(self.size)
        return index


def response_counts(rows: list[dict[str, Any]]) -> Counter[int]:
    counts: Counter[int] = Counter()
    for r in rows:
        counts.update(r["ids"][r["response_start"]:])
    return counts


def build_vocab(counts: Counter[int], size: int, target_vocab_size: int, always: list[int]) -> DraftVocab:
    if not 1 <= size <= target_vocab_size:
        raise ValueError(f"draft_vocab_size={size} is not allowed: 1 to the target's vocab_size {target_vocab_size}")
    chosen = [t for t in always if 0 <= t < target_vocab_size][:size]
    # ties broken by token id, so the vocabulary is a pure function of the data
    for tok, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])):
        if len(chosen) == size:
            break
        if tok not in chosen:
            chosen.append(tok)
    taken = set(chosen)
    rest = (t for t in range(target_vocab_size) if t not in taken)
    while len(chosen) < size:  # less data than vocabulary: fill with the lowest unused ids
        chosen.append(next(rest))
    return DraftVocab(torch.tensor(sorted(chosen), dtype=torch.long), target_vocab_size)


def coverage(counts: Counter[int], sizes: tuple[int, ...] = (8192, 16384, 32768)) -> dict[str, float]:
    """Share of response tokens that a vocabulary of the top-n response tokens would contain."""
    total = sum(counts.values()) or 1
    ranked = sorted(counts.values(), reverse=True)
    return {f"coverage_{n // 1024}k": round(sum(ranked[:n]) / total, 5) for n in sizes}

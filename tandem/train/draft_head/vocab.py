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
    # less data than vocabulary: fill with the lowest unused ids, since BPE numbers its tokens in merge order
    # (SmolLM2, 512 responses: held-out 16K coverage 90.7% from the counts alone, 96.8% with this fill)
    while len(chosen) < size:
        chosen.append(next(rest))
    return DraftVocab(torch.tensor(sorted(chosen), dtype=torch.long), target_vocab_size)


def coverage(vocab: DraftVocab, counts: Counter[int]) -> float:
    """Share of the counted tokens inside the vocabulary."""
    mask = vocab.t2d
    return round(sum(c for tok, c in counts.items() if bool(mask[tok])) / max(sum(counts.values()), 1), 5)


def heldout_coverage(train: Counter[int], heldout: Counter[int], target_vocab_size: int, always: list[int],
                     sizes: tuple[int, ...] = (8192, 16384, 32768)) -> dict[str, float]:
    """Coverage of held-out response tokens by vocabularies of each size built from the training responses."""
    return {f"heldout_coverage_{n // 1024}k": coverage(build_vocab(train, n, target_vocab_size, always), heldout)
            for n in sizes if n <= target_vocab_size}

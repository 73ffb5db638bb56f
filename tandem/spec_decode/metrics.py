"""Speculative-decoding counters with vLLM's definitions.

num_drafts: request-steps that verified >= 1 draft; acceptance rate = accepted / draft tokens;
mean acceptance length = 1 + accepted / drafts (the bonus / recovered token included).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecDecodeStats:
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)
    # the drafter's own counters by name, summed over steps (DSpark: confidence_sum, num_confidences)
    draft_stats: dict[str, float] = field(default_factory=dict)

    def add_draft_stats(self, stats: dict[str, float]) -> None:
        for name, value in stats.items():
            self.draft_stats[name] = self.draft_stats.get(name, 0.0) + value

    @property
    def mean_confidence(self) -> float:
        """DSpark's confidence head, averaged over every proposed draft."""
        n = self.draft_stats.get("num_confidences", 0.0)
        return self.draft_stats.get("confidence_sum", 0.0) / n if n else 0.0

    def observe(self, num_draft_tokens: int, num_accepted: int) -> None:
        if num_draft_tokens == 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_pos) < num_draft_tokens:
            self.accepted_per_pos += [0] * (num_draft_tokens - len(self.accepted_per_pos))
        for pos in range(num_accepted):
            self.accepted_per_pos[pos] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

"""The small, tensor-free, picklable description of one step that rank 0 sends to every rank."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class RowSampling:
    temperature: float
    top_k: int
    top_p: float
    min_p: float
    seed: int
    num_logprobs: int | None


@dataclass(frozen=True)
class ScheduledRow:
    """One request's work this step: run `token_ids` at positions num_computed_tokens + i."""

    request_id: str
    token_ids: list[int]
    num_computed_tokens: int
    block_ids: list[int]
    # a prompt chunk (split over PCP ranks) rather than a decode row (replicated on every rank)
    is_prefill: bool
    sampling: RowSampling | None  # None: a prompt chunk that does not reach the prompt's end


@dataclass(frozen=True)
class StepPlan:
    rows: list[ScheduledRow] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(len(r.token_ids) for r in self.rows)


@dataclass
class StepOutput:
    """Per sampling row of the plan, in order: the sampled token and optional logprobs."""

    sampled_token_ids: list[int]
    logprobs: list[dict[int, float] | None]

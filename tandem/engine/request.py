"""A request's state on rank 0: its tokens, progress and KV blocks."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from tandem.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)  # identity: the scheduler's queue look-ups must not compare token lists field by field
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    seed: int  # resolved: the user's seed, else drawn from the engine's generator
    prompt: str | None = None
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)  # hashes of the full blocks cached so far
    spec_token_ids: list[int] = field(default_factory=list)  # drafts to verify in the next step
    num_cached_tokens: int = -1  # prefix-cache hit on first scheduling; -1 = not scheduled yet
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    output_text: str = ""
    logprobs: list[dict[int, float]] | None = None
    prompt_logprobs: list[dict[int, float] | None] | None = None  # filled as the prompt is computed
    # time.monotonic() seconds: RequestOutput.metrics (vLLM's request timings)
    arrival_time: float = field(default_factory=time.monotonic)
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None

    def metrics(self) -> dict[str, float]:
        """arrival / first_scheduled / first_token / last_token / finished times (the ones reached), and the
        derived time_in_queue and time_to_first_token (from arrival), plus num_generation_tokens."""
        out = {name: value for name in ("arrival_time", "first_scheduled_time", "first_token_time",
                                         "last_token_time", "finished_time")
               if (value := getattr(self, name)) is not None}
        if self.first_scheduled_time is not None:
            out["time_in_queue"] = self.first_scheduled_time - self.arrival_time
        if self.first_token_time is not None:
            out["time_to_first_token"] = self.first_token_time - self.arrival_time
        out["num_generation_tokens"] = float(len(self.output_token_ids))
        return out

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_slice(self, start: int, end: int) -> list[int]:
        """all_token_ids[start:end] without copying the rest: a decode step costs O(its tokens)."""
        num_prompt = len(self.prompt_token_ids)
        if start >= num_prompt:
            return self.output_token_ids[start - num_prompt:end - num_prompt]
        head = self.prompt_token_ids[start:end]
        return head + self.output_token_ids[:max(0, end - num_prompt)] if end > num_prompt else head

    def token_at(self, index: int) -> int:
        num_prompt = len(self.prompt_token_ids)
        return self.prompt_token_ids[index] if index < num_prompt else self.output_token_ids[index - num_prompt]

    @property
    def finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

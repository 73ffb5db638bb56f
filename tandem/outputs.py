"""What generate() returns, vLLM-shaped."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop" | "length" | "abort" | "error" | None while running
    stop_reason: int | str | None = None
    # per generated token: {token_id: logprob} for the top-n plus the sampled token
    logprobs: list[dict[int, float]] | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    error: str | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    # SamplingParams.prompt_logprobs: per prompt token, {token_id: logprob} (None for the first token)
    prompt_logprobs: list[dict[int, float] | None] | None = None

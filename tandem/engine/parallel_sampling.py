"""Parallel sampling (`SamplingParams.n > 1`): one request fans out into n child requests that the scheduler
runs like any other; their completions are gathered back into one RequestOutput with n choices.

As in vLLM, child i is named `f"{i}_{parent_id}"` and, when the parent has a seed, samples with seed + i, so
choice i of a seeded request equals the same prompt sent alone with seed + i. The children are admitted
together; with prefix caching the later ones hit the first one's prompt blocks in that same step (the
scheduler registers blocks as it schedules them; see BlockManager.cache_full_blocks).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from tandem.engine.request import Request
from tandem.outputs import CompletionOutput, RequestOutput
from tandem.sampling_params import SamplingParams


def child_params(params: SamplingParams, index: int) -> SamplingParams:
    seed = None if params.seed is None else params.seed + index
    return replace(params, n=1, seed=seed)


def merged_metrics(a: dict[str, float], b: dict[str, float]) -> dict[str, float]:
    """The parent's timings from its children's: the earliest start of each kind, the latest end, tokens summed."""
    out = dict(a)
    for name, value in b.items():
        if name not in out:
            out[name] = value
        elif name in ("last_token_time", "finished_time"):
            out[name] = max(out[name], value)
        elif name == "num_generation_tokens":
            out[name] += value
        else:
            out[name] = min(out[name], value)
    return out


def child_id(parent_id: str, index: int) -> str:
    return f"{index}_{parent_id}"


@dataclass
class ParentRequest:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    children: list[Request]
    done: dict[int, CompletionOutput] = field(default_factory=dict)
    num_cached_tokens: int = 0
    prompt_logprobs: list[dict[int, float] | None] | None = None
    metrics: dict[str, float] = field(default_factory=dict)

    def finish_child(self, index: int, output: RequestOutput) -> RequestOutput | None:
        """Record child `index`'s completion; the gathered output once every child has finished."""
        completion = output.outputs[0]
        self.done[index] = replace(completion, index=index)
        self.num_cached_tokens = max(self.num_cached_tokens, output.num_cached_tokens)
        if self.prompt_logprobs is None:
            self.prompt_logprobs = output.prompt_logprobs  # the same prompt in every child
        self.metrics = merged_metrics(self.metrics, output.metrics)
        if len(self.done) < len(self.children):
            return None
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids,
                             [self.done[i] for i in range(len(self.children))], finished=True,
                             num_cached_tokens=self.num_cached_tokens, metrics=self.metrics,
                             prompt_logprobs=self.prompt_logprobs)

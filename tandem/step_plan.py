"""The small, tensor-free, picklable description of one step that rank 0 sends to every rank."""

from __future__ import annotations

from dataclasses import dataclass, field

from tandem.structured_output.params import GrammarSpec


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
    """One request's work this step: run `token_ids` at positions num_computed_tokens + i.

    A decode row is [last token, draft 1 .. draft K]: the target verifies the K drafts and samples
    up to K + 1 tokens. A prompt chunk that stops short of the prompt's end samples nothing.
    """

    request_id: str
    token_ids: list[int]
    num_computed_tokens: int
    block_ids: list[int]
    # a prompt chunk (split over PCP ranks) rather than a decode row (replicated on every rank)
    is_prefill: bool
    sampling: RowSampling | None  # None: a prompt chunk that does not reach the prompt's end
    num_draft_tokens: int = 0  # the last num_draft_tokens of token_ids are drafts to verify
    # the token after this chunk, for drafters that read "next token" ids; None when it is sampled
    next_token_id: int | None = None
    # a prompt chunk of a request that asked for prompt logprobs: top-n at each position whose next token is known
    prompt_logprobs: int | None = None
    # on admission, for proposers that keep a token history (n-gram): the tokens before num_computed_tokens
    # (a prefix-cache hit), sent once
    prefix_token_ids: list[int] | None = None
    # on admission, for a request whose output a grammar constrains: what every rank builds its matcher from
    grammar: GrammarSpec | None = None


@dataclass(frozen=True)
class StepPlan:
    rows: list[ScheduledRow] = field(default_factory=list)
    num_spec_tokens: int = 0  # drafts to propose for the next step (0: none)
    # requests finished or aborted since the previous plan: ranks drop any per-request state they keep
    finished_request_ids: list[str] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(len(r.token_ids) for r in self.rows)


@dataclass
class StepOutput:
    """Per sampling row of the plan, in order: the emitted tokens (accepted drafts + one sampled token),
    their logprobs when asked, and the drafts proposed for the next step (empty when none)."""

    sampled_token_ids: list[list[int]]
    logprobs: list[list[dict[int, float]] | None]
    draft_token_ids: list[list[int]] = field(default_factory=list)
    # the drafter's own counters for this step by name (DSpark: confidence_sum, num_confidences), summed by the engine
    draft_stats: dict[str, float] = field(default_factory=dict)
    # request id -> logprobs of tokens row.num_computed_tokens + 1, + 2, ... (prompt_logprobs rows only)
    prompt_logprobs: dict[str, list[dict[int, float]]] = field(default_factory=dict)
    draft_s: float = 0.0  # wall seconds this rank spent in the drafter's hooks (observe + propose), for "auto" K
    pcp_gathered_bytes: int = 0  # bytes this rank received from PCP all-gathers in the step (K/V, queries, partials)
    grammar_s: float = 0.0  # wall seconds this rank spent on grammar masks and matchers in the step


# a draft stat: a step whose drafter deferred its per-step pass whole (MTP's step 0 at K = 0, mtp_catch_up.py), the
# number of tokens it deferred
STEP0_DEFERRED = "step0_deferred_tokens"

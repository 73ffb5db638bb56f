"""One rank's grammar matchers: the token bitmask of every logits row of a step, applied in one batched call, and
the matchers advanced by the emitted tokens. Does nothing for a step without a constrained request.

Every rank holds the same matchers and feeds them the same emitted tokens (sampling is identical on every rank,
DESIGN §3), so every rank computes the same masks: nothing crosses ranks.

Under speculation a request's K drafts are verified on K + 1 logits rows; row j gets the mask of the state after
drafts 1..j. Worked example, drafts [a, b] (rows r0 r1 r2):
    r0: mask(s)            accept a -> s.a
    r1: mask(s.a)          accept b -> s.a.b
    r2: mask(s.a.b)        roll back 2 -> s
A draft the grammar refuses ends the walk: it is masked out of its own row, so verification rejects it and the
rows after it are never read (they stay unconstrained). After verification the matcher takes the emitted tokens
(the accepted drafts and the one sampled token), so a rejected draft leaves no trace.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import torch

from tandem.config import EngineConfig
from tandem.structured_output.backend import Matcher
from tandem.structured_output.compiler import grammar_compiler
from tandem.worker.input_batch import InputBatch

if TYPE_CHECKING:  # the step protocol imports this package's GrammarSpec
    from tandem.step_plan import StepPlan

logger = logging.getLogger("tandem")


class GrammarMasks:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.matchers: dict[str, Matcher] = {}  # request id -> its matcher (the configured backend's)
        self.mask_s = 0.0  # seconds spent filling and applying masks and advancing matchers, summed

    def admit(self, plan: StepPlan) -> None:
        """A matcher for each newly admitted constrained request (kept across preemption: its output stays)."""
        for row in plan.rows:
            if row.grammar is not None and row.request_id not in self.matchers:
                self.matchers[row.request_id] = grammar_compiler(self.config).matcher(row.grammar)

    def maybe_mask(self, plan: StepPlan, batch: InputBatch, logits: torch.Tensor) -> torch.Tensor:
        """[sum_i (K_i + 1), V] logits -> the same rows with tokens the grammar forbids at -inf (a copy: the raw
        logits stay for logprobs); `logits` itself when no row is constrained."""
        if not self.matchers:
            return logits
        start = time.perf_counter()
        rows = self._constrained(plan, batch)
        if not rows:
            return logits
        import xgrammar as xgr

        backend = grammar_compiler(self.config).backend
        bitmask = xgr.allocate_token_bitmask(logits.shape[0], logits.shape[-1])  # [T, ceil(V / 32)] int32, all on
        drafts = batch.draft_token_ids.tolist()
        num_walked = [0] * len(rows)  # drafts each matcher took, to roll back
        walking = [n for n, (m, *_) in enumerate(rows) if not m.is_terminated()]
        indices: list[int] = []
        depth = 0
        while walking:
            targets = [rows[n][1] + depth for n in walking]
            backend.fill([rows[n][0] for n in walking], bitmask, targets)
            indices += targets
            still = []
            for n in walking:  # the walk goes on past draft `depth` only while the grammar takes it
                matcher, _, draft_start, k = rows[n]
                if depth < k and matcher.accept_token(drafts[draft_start + depth]):
                    num_walked[n] += 1
                    if not matcher.is_terminated():
                        still.append(n)
            walking, depth = still, depth + 1
        for (matcher, *_), n in zip(rows, num_walked, strict=True):
            if n:
                matcher.rollback(n)
        masked = logits.clone()
        # both backends write one bitmask layout (backend.py), so xgrammar's CPU kernel applies either; rows left out
        # are all-allowed anyway, and the kernel is ~8x faster at batch 1 without indices
        every_row = len(indices) == logits.shape[0]
        xgr.apply_token_bitmask_inplace(masked, bitmask.to(logits.device), indices=None if every_row else indices)
        self.mask_s += time.perf_counter() - start
        return masked

    def advance(self, plan: StepPlan, batch: InputBatch, emitted: list[list[int]]) -> None:
        """Feed each constrained request the tokens it emitted this step."""
        if not self.matchers:
            return
        start = time.perf_counter()
        for j, i in enumerate(batch.sample_rows):
            matcher = self.matchers.get(plan.rows[i].request_id)
            if matcher is None:
                continue
            for token in emitted[j]:
                if matcher.is_terminated():
                    break
                if not matcher.accept_token(token):  # masks make this impossible; never fail the step for it
                    logger.warning("request %s: the grammar refused emitted token %d", plan.rows[i].request_id,
                                   token)
                    break
        self.mask_s += time.perf_counter() - start

    def free(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self.matchers.pop(request_id, None)

    def _constrained(self, plan: StepPlan, batch: InputBatch) -> list[tuple[Matcher, int, int, int]]:
        """(matcher, first logits row, first draft index, K) of each constrained sampling row."""
        out = []
        first_row = draft_start = 0
        for i, k in zip(batch.sample_rows, batch.num_draft_tokens, strict=True):
            matcher = self.matchers.get(plan.rows[i].request_id)
            if matcher is not None:
                out.append((matcher, first_row, draft_start, k))
            first_row, draft_start = first_row + k + 1, draft_start + k
        return out

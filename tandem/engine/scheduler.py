"""Continuous batching with a token budget, chunked prefill, FCFS and preemption by recompute.

Each step serves running requests first (a decode is one token, an unfinished prompt continues
with a chunk), then admits waiting ones. When the KV pool is short, the most recently arrived
running request is preempted: its blocks are freed and it re-enters the waiting queue at the
front, to be recomputed later from its prompt + generated tokens.
"""

from __future__ import annotations

import time
from collections import deque

from tandem.config import CacheConfig, ModelConfig, SchedulerConfig, SpeculativeConfig
from tandem.engine.block_manager import BlockManager
from tandem.engine.request import Request, RequestStatus
from tandem.engine.spec_policy import SpecPolicy
from tandem.step_plan import RowSampling, ScheduledRow, StepOutput, StepPlan


class Scheduler:
    def __init__(self, scheduler_config: SchedulerConfig, cache_config: CacheConfig, model_config: ModelConfig,
                 num_blocks: int, spec_config: SpeculativeConfig | None = None, policy: SpecPolicy | None = None,
                 num_kv_pools: int = 1):
        self.config = scheduler_config
        self.spec = spec_config or SpeculativeConfig()
        self.policy = policy  # num_speculative_tokens "auto": picks K each step
        self.lookahead = self.spec.num_lookahead_slots
        self.max_model_len = model_config.max_model_len
        self.block_manager = BlockManager(num_blocks, cache_config.block_size, cache_config.enable_prefix_caching,
                                          key_next_token=self.spec.prefix_keys_next_token,
                                          num_pools=num_kv_pools)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self._finished_ids: list[str] = []  # since the last plan

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def release(self, request_ids: list[str]) -> None:
        """Ids the ranks hold state for without a Request here (the "auto" profile's rows): the next plan frees them."""
        self._finished_ids += request_ids

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> StepPlan:
        budget = self.config.max_num_batched_tokens
        rows: list[ScheduledRow] = []
        scheduled: list[Request] = []
        # K only sets the drafts decode rows verify now and the K proposed at the end of the step. With no decode
        # row running (a new batch's first step), "auto" chooses after admission, over the rows it will run: before
        # it, it saw no row at all and fell back to the K the previous batch's tail ended on
        decoding = any(r.num_tokens - r.num_computed_tokens == 1 for r in self.running)
        k = self._num_spec_tokens(self.running) if decoding or self.policy is None else 0
        for req in list(self.running):
            if req not in self.running:
                continue  # preempted while making room for an earlier request
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            drafts = self._drafts(req, k, budget) if n == 1 else []
            if n <= 0 or not self._allocate_or_preempt(req, n + len(drafts)):
                continue
            rows.append(self._row(req, n, drafts))
            self.block_manager.cache_full_blocks(req, req.num_computed_tokens + n)
            scheduled.append(req)
            budget -= n + len(drafts)
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            # Waiting requests hold no blocks: a failed admission releases its prefix hits (they
            # stay cached), so requests queued behind preemptions can never pin the pool.
            # prompt logprobs need every prompt position computed, so such a request takes no prefix hit (as vLLM)
            hit = self.block_manager.match_prefix(req) if req.sampling_params.prompt_logprobs is None else 0
            req.num_computed_tokens = hit
            n = req.num_tokens - hit
            # A prompt that completes in this step samples now, so its drafter writes ahead as well.
            ahead = self.lookahead if n <= budget else 0
            if (not self.config.enable_chunked_prefill and n > budget) or \
                    not self.block_manager.allocate(req, self._slots(hit + min(n, budget), ahead)):
                self.block_manager.free(req)
                req.num_computed_tokens = 0
                break
            n = min(n, budget)
            self.block_manager.record_prefix_query(req.num_tokens, hit)
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = hit
                req.first_scheduled_time = time.monotonic()
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            rows.append(self._row(req, n, [], admitted=True))
            self.block_manager.cache_full_blocks(req, hit + n)  # later admissions of this step may hit them
            scheduled.append(req)
            budget -= n
        if self.policy is not None and not decoding:
            k = self._num_spec_tokens(scheduled)
        self._scheduled = scheduled
        finished, self._finished_ids = self._finished_ids, []
        return StepPlan(rows=rows, num_spec_tokens=k, finished_request_ids=finished)

    def _num_spec_tokens(self, requests: list[Request]) -> int:
        if self.policy is not None:
            return self.policy.choose(len(requests))
        return self.spec.num_tokens_for_batch(len(requests)) if self.spec.enabled else 0

    def _drafts(self, req: Request, k: int, budget: int) -> list[int]:
        """The drafts a decode row verifies: at most K, the budget, and what max_tokens/max_model_len allow."""
        sp = req.sampling_params
        room = self.max_model_len - req.num_tokens - 1
        if sp.max_tokens is not None:
            room = min(room, sp.max_tokens - len(req.output_token_ids) - 1)
        return req.spec_token_ids[: max(0, min(k, budget - 1, room))]

    def _slots(self, num_tokens: int, ahead: int) -> int:
        """KV slots a request needs: its tokens after this step plus the drafter's look-ahead, which never
        reaches past max_model_len (the draft positions there are clamped and write nothing)."""
        return min(num_tokens + ahead, max(self.max_model_len, num_tokens))

    def _allocate_or_preempt(self, req: Request, n: int) -> bool:
        total = self._slots(req.num_computed_tokens + n, self.lookahead)
        while not self.block_manager.allocate(req, total):
            victim = self.running[-1]
            self._preempt(victim)
            if victim is req:
                return False
        return True

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.block_manager.free(req)
        req.num_computed_tokens = 0
        req.spec_token_ids = []
        req.status = RequestStatus.WAITING
        self.waiting.appendleft(req)
        self.num_preemptions += 1

    def _row(self, req: Request, n: int, drafts: list[int], admitted: bool = False) -> ScheduledRow:
        start = req.num_computed_tokens
        reaches_end = start + n == req.num_tokens
        sp = req.sampling_params
        sampling = RowSampling(sp.temperature, sp.top_k, sp.top_p, sp.min_p, req.seed,
                               sp.logprobs) if reaches_end else None
        prompt_logprobs = sp.prompt_logprobs if start < len(req.prompt_token_ids) - 1 else None
        prefix = req.token_slice(0, start) if admitted and self.spec.keeps_token_history else None
        next_token = None if reaches_end else req.token_at(start + n)
        grammar = sp.structured_outputs.spec if admitted and sp.structured_outputs is not None else None
        return ScheduledRow(req.request_id, req.token_slice(start, start + n) + drafts, start, list(req.block_ids),
                            is_prefill=start < req.num_tokens - 1, sampling=sampling,
                            num_draft_tokens=len(drafts), next_token_id=next_token,
                            prompt_logprobs=prompt_logprobs, prefix_token_ids=prefix, grammar=grammar)

    def update(self, plan: StepPlan, output: StepOutput) -> list[tuple[Request, ScheduledRow, int]]:
        """Advance computed counts, rolling back rejected drafts (their KV slots are simply overwritten
        later), and store the next drafts; return (request, row, sampling index) for each sampling row."""
        sampled = []
        k = 0
        for row, req in zip(plan.rows, self._scheduled, strict=True):
            req.num_computed_tokens += len(row.token_ids)
            if row.sampling is not None:
                num_accepted = len(output.sampled_token_ids[k]) - 1
                req.num_computed_tokens -= row.num_draft_tokens - num_accepted
                req.spec_token_ids = output.draft_token_ids[k] if output.draft_token_ids else []
                sampled.append((req, row, k))
                k += 1
            self.block_manager.cache_full_blocks(req)
        return sampled

    def finish(self, req: Request, reason: str, stop_reason: int | str | None = None) -> None:
        self._finished_ids.append(req.request_id)
        req.status = RequestStatus.FINISHED
        req.finish_reason, req.stop_reason = reason, stop_reason
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.block_manager.free(req)

"""LLMEngine (rank 0): admits requests, schedules steps, applies sampled tokens and stop rules."""

from __future__ import annotations

import itertools
import logging
import random
import time

from tandem.attention.backend import select_target_backends
from tandem.config import ConfigError, EngineConfig, kv_pools
from tandem.engine.metrics import Counter, EngineStats, Gauge, Metric, Vector
from tandem.engine.output_processor import OutputProcessor
from tandem.engine.parallel_sampling import ParentRequest, child_id, child_params
from tandem.engine.request import Request
from tandem.engine.scheduler import Scheduler
from tandem.engine.spec_policy import SpecPolicy, profile
from tandem.executor.multiproc import MultiprocExecutor
from tandem.executor.torchrun import TorchrunExecutor, launched_by_torchrun
from tandem.executor.uniproc import UniprocExecutor
from tandem.outputs import CompletionOutput, RequestOutput
from tandem.sampling_params import SamplingParams
from tandem.spec_decode.draft_mode import resolve_draft_mode
from tandem.spec_decode.metrics import SpecDecodeStats
from tandem.step_plan import STEP0_DEFERRED
from tandem.structured_output.compiler import grammar_compiler
from tandem.tokenizer import Tokenizer

logger = logging.getLogger("tandem")
LOG_INTERVAL_S = 10.0
DEFERRAL_METRICS = {  # drafter -> (deferred tokens, caught-up tokens) counters
    "mtp": ("tandem:spec_decode_mtp_deferred_step0_tokens", "tandem:spec_decode_mtp_caught_up_tokens"),
    "eagle3": ("tandem:spec_decode_eagle3_deferred_step0_tokens", "tandem:spec_decode_eagle3_caught_up_tokens"),
    "dspark": ("tandem:spec_decode_dspark_deferred_context_tokens",
               "tandem:spec_decode_dspark_caught_up_context_tokens"),
}


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config.validate()
        self.tokenizer = Tokenizer(config.model_config.model)
        # A backend that cannot serve this layout fails here, before any rank starts.
        select_target_backends(config)
        self.spec = config.speculative_config
        self.draft_mode = resolve_draft_mode(config)
        self.executor = _make_executor(config)
        try:
            self.scheduler = self._start(config)
        except BaseException:
            self.executor.shutdown()  # the ranks started: a refused pool or a failed profile must not leave them
            raise
        self.requests: dict[str, Request] = {}
        self.parents: dict[str, ParentRequest] = {}  # parallel sampling (n > 1), by the parent's id
        self._child_of: dict[str, tuple[ParentRequest, int]] = {}  # child id -> (parent, choice index)
        self.stats = EngineStats()
        self.outputs = OutputProcessor(self.tokenizer, self.scheduler, self.stats, config.model_config.max_model_len)
        self._ids = itertools.count()
        self._rng = random.Random(config.model_config.seed)
        self._last_log, self._last_log_tokens = time.monotonic(), 0

    def _start(self, config: EngineConfig) -> Scheduler:
        """What follows the ranks' start: the KV capacity check, the "auto" K policy and its start-up profile."""
        # sharded PCP KV: every rank holds its own pool of num_kv_blocks; the scheduler sees all P pools
        pools = kv_pools(config)
        num_blocks = self.executor.num_kv_blocks * pools
        capacity = num_blocks * config.cache_config.block_size
        if capacity < config.model_config.max_model_len:
            per_rank = f" ({pools} ranks x {num_blocks // pools})" if pools > 1 else ""
            kv_dtype = str(config.cache_config.kv_dtype(config.model_config.dtype)).removeprefix("torch.")
            raise ConfigError(f"the KV cache holds {capacity} tokens ({num_blocks} blocks{per_rank} of "
                              f"kv_cache_dtype={config.cache_config.cache_dtype!r}: {kv_dtype}), fewer than "
                              f"max_model_len={config.model_config.max_model_len}: lower max_model_len, "
                              "give the cache more memory (kv_cache_memory_bytes / num_gpu_blocks), store it narrower "
                              "(kv_cache_dtype bfloat16 / fp8)"
                              + ("" if pools > 1 or config.parallel_config.prefill_context_parallel_size == 1
                                 else " or shard the KV over the PCP ranks (pcp_kv_layout='sharded')"))
        if self.spec.enabled:
            logger.info("speculative decoding: %s, draft mode %s (%s)", self.spec.method, self.draft_mode.mode,
                        self.draft_mode.reason)
        self.spec_stats = SpecDecodeStats()
        self.policy = SpecPolicy(self.spec.max_k) if self.spec.enabled and self.spec.auto else None
        scheduler = Scheduler(config.scheduler_config, config.cache_config, config.model_config, num_blocks,
                                   self.spec, self.policy, num_kv_pools=pools)
        if self.policy is not None:  # its step costs; the next plan frees the synthetic rows on every rank
            scheduler.release(profile(self.policy, self.executor.execute, config, num_blocks))
        return scheduler

    def add_request(self, prompt: str | list[int], params: SamplingParams,
                    request_id: str | None = None) -> Request | ParentRequest | RequestOutput:
        """Queue a request (n > 1: its n children); a request that cannot run comes back at once as a failed
        RequestOutput."""
        vocab = self.config.model_config.get("vocab_size")
        for name in ("logprobs", "prompt_logprobs"):  # vLLM's max_logprobs: at most the vocabulary, at submission
            if vocab is not None and (getattr(params, name) or 0) > vocab:
                raise ValueError(f"SamplingParams.{name}={getattr(params, name)} is invalid: at most the "
                                 f"vocabulary size ({vocab})")
        request_id = request_id if request_id is not None else str(next(self._ids))
        text = prompt if isinstance(prompt, str) else None
        token_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        error = self._check_prompt(token_ids)
        if error is not None:
            self.stats.num_requests_failed += 1
            return RequestOutput(request_id, text, token_ids, [CompletionOutput(0, "", [], "error")],
                                 finished=True, error=error)
        if params.structured_outputs is not None:
            # compiled before the request is queued: no step waits on a compile (the server compiles it even
            # earlier, off its event loop, and this finds it cached); an invalid grammar raises GrammarError here
            grammar_compiler(self.config).compile(params.structured_outputs.spec)
            self.stats.num_structured_requests += 1
        if params.n == 1:
            return self._add(request_id, token_ids, params, text)
        children = [self._add(child_id(request_id, i), token_ids, child_params(params, i), text)
                    for i in range(params.n)]
        parent = ParentRequest(request_id, text, token_ids, children)
        self.parents[request_id] = parent
        for i, child in enumerate(children):
            self._child_of[child.request_id] = (parent, i)
        return parent

    def _add(self, request_id: str, token_ids: list[int], params: SamplingParams, text: str | None) -> Request:
        seed = params.seed if params.seed is not None else self._rng.getrandbits(62)
        req = Request(request_id, token_ids, params, seed, prompt=text)
        if params.prompt_logprobs is not None:
            req.prompt_logprobs = [None]  # the first token has no context to be predicted from
        self.requests[request_id] = req
        self.scheduler.add(req)
        self.stats.num_prompt_tokens += len(token_ids)
        return req

    def _check_prompt(self, token_ids: list[int]) -> str | None:
        max_len = self.config.model_config.max_model_len
        vocab = self.config.model_config.get("vocab_size")
        if not token_ids:
            return "the prompt is empty"
        if len(token_ids) >= max_len:
            return (f"the prompt has {len(token_ids)} tokens, but max_model_len is {max_len}: "
                    "the prompt plus at least one generated token must fit")
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in token_ids):
            return "the prompt's token ids must be integers"
        if vocab is not None and not all(0 <= t < vocab for t in token_ids):
            return f"the prompt has token ids outside the vocabulary [0, {vocab})"
        return None

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[RequestOutput]:
        """Run one step; return the requests that finished in it."""
        self._maybe_log_stats()
        start = time.perf_counter()
        plan = self.scheduler.schedule()
        if not plan.rows:
            return []
        output = self.executor.execute(plan)
        self.stats.pcp_gathered_bytes += output.pcp_gathered_bytes
        self.stats.grammar_s += output.grammar_s
        self.outputs.record_prompt_logprobs(plan, output, self.requests)
        self.spec_stats.add_draft_stats(output.draft_stats)
        finished = []
        for req, row, k in self.scheduler.update(plan, output):
            emitted = output.sampled_token_ids[k]
            self.spec_stats.observe(row.num_draft_tokens, len(emitted) - 1)
            self.outputs.append(req, emitted, output.logprobs[k])
            if req.finished:
                del self.requests[req.request_id]
                done = self._gather(self.outputs.make_output(req))
                if done is not None:
                    finished.append(done)
        if self.policy is not None:
            self.policy.record_step(plan, output, time.perf_counter() - start)
        return finished

    def _gather(self, output: RequestOutput) -> RequestOutput | None:
        """A finished request's output, or for a child of a parallel-sampling request the parent's gathered
        output once its last child finishes (None before)."""
        parent_and_index = self._child_of.pop(output.request_id, None)
        if parent_and_index is None:
            return output
        parent, index = parent_and_index
        gathered = parent.finish_child(index, output)
        if gathered is not None:
            del self.parents[parent.request_id]
        return gathered

    def abort_request(self, request_id: str) -> None:
        """Abort a request (for a parallel-sampling request, all of its unfinished children)."""
        parent = self.parents.pop(request_id, None)
        ids = [c.request_id for c in parent.children] if parent is not None else [request_id]
        for rid in ids:
            self._child_of.pop(rid, None)
            req = self.requests.pop(rid, None)
            if req is not None:
                self.scheduler.finish(req, "abort")
                self.outputs.forget(rid)

    def _maybe_log_stats(self) -> None:
        now = time.monotonic()
        if now - self._last_log < LOG_INTERVAL_S:
            return
        tokens = self.stats.num_generation_tokens
        rate = (tokens - self._last_log_tokens) / (now - self._last_log)
        self._last_log, self._last_log_tokens = now, tokens
        spec = (f", spec decode: acceptance rate {self.spec_stats.acceptance_rate:.3f}, mean acceptance length "
                f"{self.spec_stats.mean_acceptance_length:.3f}" if self.spec.enabled else "")
        logger.info("generation %.1f tokens/s, running %d, waiting %d, KV cache %.1f%%%s", rate,
                    len(self.scheduler.running), len(self.scheduler.waiting),
                    100 * self.scheduler.block_manager.usage(), spec)

    def get_metrics(self) -> list[Metric]:
        bm, s = self.scheduler.block_manager, self.stats
        return [
            Counter("tandem:prompt_tokens", s.num_prompt_tokens),
            Counter("tandem:generation_tokens", s.num_generation_tokens),
            Counter("tandem:request_success", s.num_requests_finished),
            Counter("tandem:request_failed", s.num_requests_failed),
            Counter("tandem:num_preemptions", self.scheduler.num_preemptions),
            Counter("tandem:pcp_gathered_bytes", s.pcp_gathered_bytes),  # rank 0's, over the PCP group
            Counter("tandem:prefix_cache_queries", bm.num_queried_tokens),
            Counter("tandem:prefix_cache_hits", bm.num_hit_tokens),
            Gauge("tandem:num_requests_running", len(self.scheduler.running)),
            Gauge("tandem:num_requests_waiting", len(self.scheduler.waiting)),
            Gauge("tandem:kv_cache_usage_perc", bm.usage()),
            *self._structured_output_metrics(),
            *self._spec_metrics(),
        ]

    def _structured_output_metrics(self) -> list[Metric]:
        if not self.stats.num_structured_requests:
            return []
        compiles = grammar_compiler(self.config).stats
        return [Counter("tandem:structured_output_requests", self.stats.num_structured_requests),
                Counter("tandem:grammar_compiles", compiles.num_compiles),
                Counter("tandem:grammar_compile_cache_hits", compiles.num_cache_hits),
                Counter("tandem:grammar_compile_seconds", compiles.compile_s),
                Counter("tandem:grammar_mask_seconds", self.stats.grammar_s)]

    def _spec_metrics(self) -> list[Metric]:
        if not self.spec.enabled:
            return []
        st = self.spec_stats
        return [
            Counter("tandem:spec_decode_num_drafts", st.num_drafts),
            Counter("tandem:spec_decode_num_draft_tokens", st.num_draft_tokens),
            Counter("tandem:spec_decode_num_accepted_tokens", st.num_accepted_tokens),
            Vector("tandem:spec_decode_num_accepted_tokens_per_pos", list(st.accepted_per_pos)),
            Gauge("tandem:spec_decode_acceptance_rate", st.acceptance_rate),
            Gauge("tandem:spec_decode_mean_acceptance_length", st.mean_acceptance_length),
            *([Gauge("tandem:spec_decode_dspark_mean_confidence", st.mean_confidence)]
              if "confidence_sum" in st.draft_stats else []),
            *self._deferral_metrics(),
            *(self.policy.metrics() if self.policy is not None else []),
        ]

    def _deferral_metrics(self) -> list[Metric]:
        """"auto" with MTP: tokens whose step 0 waited for a drafting step (K = 0), and those it then caught up;
        with DSpark: tokens whose context write waited, and those written with a later step's."""
        names = DEFERRAL_METRICS.get(self.spec.method or "")
        if names is None or self.policy is None:
            return []
        stats = self.spec_stats.draft_stats
        return [Counter(names[0], stats.get(STEP0_DEFERRED, 0.0)), Counter(names[1], stats.get("catch_up_tokens", 0.0))]

    def shutdown(self) -> None:
        self.executor.shutdown()


def _make_executor(config: EngineConfig) -> UniprocExecutor | MultiprocExecutor | TorchrunExecutor:
    if launched_by_torchrun():
        return TorchrunExecutor(config)
    if config.parallel_config.world_size > 1:
        return MultiprocExecutor(config)
    return UniprocExecutor(config)


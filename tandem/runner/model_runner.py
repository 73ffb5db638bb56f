"""One rank's model runner: StepPlan in, sampled tokens out. Keep this file minimal."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from tandem import native
from tandem.attention import kv_scales
from tandem.attention.backend import select_target_backends
from tandem.attention.forward_context import forward_context
from tandem.attention.layer import Attention, MLAAttention
from tandem.compilation.compile import compile_model, warmup_passes
from tandem.config import EngineConfig
from tandem.distributed.groups import SINGLE_RANK, ParallelGroups
from tandem.layers.cpu_gemm import prepack_linears
from tandem.layers.sampler import sample, top_logprobs
from tandem.models.loader import build_model
from tandem.spec_decode.draft_mode import resolve_draft_mode
from tandem.spec_decode.factory import build_proposer
from tandem.spec_decode.proposer import Proposer, TargetStep
from tandem.spec_decode.rejection_sampler import rejection_sample
from tandem.step_plan import StepOutput, StepPlan
from tandem.structured_output.grammar_masks import GrammarMasks
from tandem.worker.host_memory import keep_freed_memory
from tandem.worker.input_batch import InputBuffers, global_attention_metadata, padding_batch, prepare_inputs
from tandem.worker.kv_cache import allocate_kv_caches, attention_modules, bytes_per_block
from tandem.worker.pcp_hooks import LocalBatch, make_pcp_hooks

R = TypeVar("R")


def serving_native(method: Callable[..., R]) -> Callable[..., R]:
    """A runner method that runs the model: the native kernels serve this runner's model meanwhile."""
    @functools.wraps(method)
    def run(self: ModelRunner, *args: Any, **kwargs: Any) -> R:
        with native.serving(self.native):
            return method(self, *args, **kwargs)
    return run


class ModelRunner:
    def __init__(self, config: EngineConfig, groups: ParallelGroups = SINGLE_RANK):
        self.config = config
        self.groups = groups
        self.device = config.device
        keep_freed_memory()  # steps reuse their activations' pages instead of faulting fresh ones in (host_memory.py)
        self.block_size = config.cache_config.block_size
        # MTP layers only ever draft: without MTP drafting their weights and KV cache would be dead weight
        self.model = build_model(config.model_config, groups, self.device,
                                 with_mtp=config.speculative_config.uses_mtp_layers)
        self.backends = select_target_backends(config)
        self.draft_mode = resolve_draft_mode(config)
        # an MTP drafter sharded like the target attends on the target's metadata, so its backend must split too
        mtp_on_target = config.speculative_config.uses_mtp_layers and self.draft_mode.mode == "sharded"
        split = all(cls.splits_prompt_keys() for cls in self.backends.values()) and (
            not mtp_on_target or (self.draft_mode.backend is not None and self.draft_mode.backend.splits_prompt_keys()))
        self.pcp = make_pcp_hooks(groups.pcp, self.block_size, config.parallel_config.pcp_kv_layout, split)
        # sharded KV: the target's cache (and a sharded MTP drafter's) holds this rank's pool of blocks, a
        # replicated drafter's cache every rank's (DESIGN §5's KV-placement column)
        self.kv_pools = groups.pcp.size if self.pcp.kv_sharded else 1
        self.compilation = config.compilation_config
        self.inputs = InputBuffers(max(config.scheduler_config.max_num_batched_tokens,
                                       max(self.compilation.capture_sizes)), self.device)
        self.num_padding_tokens = 0  # padding tokens run so far (tests read it)
        self.warmed_up_sizes: list[int] = []
        self.proposer: Proposer = build_proposer(config, self.model, self.draft_mode, self.backends)
        # the model the native kernels serve in this runner's steps; which dtypes they serve depends on MLA
        # (tandem/native/__init__.py)
        self.native = native.Serving(config.model_config.dtype,
                                     mla=any(getattr(m, "kind", None) == MLAAttention.kind
                                             for m in self.model.modules()),
                                     on=self.compilation.native_kernels)
        if torch.device(self.device).type == "cpu":
            with native.serving(self.native):
                native.enabled()  # a first build (about a minute) happens while the engine starts, not in a generate
        # oneDNN-packed weights on the CPU (AMX's layout for bf16 where it runs); compiled pieces get theirs from
        # inductor's freezing
        prepack_linears(self.model, lm_head_only=self.compilation.compiles, amx=self.compilation.native_kernels)
        compile_model(self.model, self.compilation)
        # distributions the last proposal's drafts were sampled from, per request (probabilistic drafting)
        self.draft_probs: dict[str, torch.Tensor] = {}
        self.grammar = GrammarMasks(config)  # per-request matchers of constrained requests

    @property
    def kv_dtype(self) -> torch.dtype:
        """The KV caches' dtype (kv_cache_dtype), the target's and every drafter's."""
        return self.config.cache_config.kv_dtype(self.config.model_config.dtype)

    def num_kv_blocks(self) -> int:
        cache = self.config.cache_config
        if cache.num_gpu_blocks is not None:
            return cache.num_gpu_blocks
        dtype = self.kv_dtype  # the budget counts bytes: fp8 holds 2x bf16's tokens, 4x float32's
        replicated = self._replicated_kv_modules()
        own = [m for m in attention_modules(self.model) if m not in replicated]
        per_block = bytes_per_block(own, self.backends, self.block_size, dtype)
        # a drafter's own cache shares the pool; replicated beside sharded KV, it holds every rank's blocks
        per_block += self.kv_pools * (bytes_per_block(replicated, self.backends, self.block_size, dtype)
                                      + self.proposer.kv_bytes_per_block(self.block_size, dtype))
        return max(1, cache.kv_cache_memory_bytes // max(per_block, 1))

    def _replicated_kv_modules(self) -> list[Attention | MLAAttention]:
        """Attention modules whose cache holds every rank's blocks under sharded KV: a replicated MTP drafter's."""
        mtp = getattr(self.model, "mtp", None)
        if not self.pcp.kv_sharded or mtp is None or self.draft_mode.mode == "sharded":
            return []
        return attention_modules(mtp)

    def allocate_kv_cache(self, num_blocks: int) -> None:
        """`num_blocks`: this rank's pool (the same on every rank)."""
        self.num_blocks = num_blocks
        dtype = self.kv_dtype
        replicated = self._replicated_kv_modules()
        own = [m for m in attention_modules(self.model) if m not in replicated]
        allocate_kv_caches(own, self.backends, num_blocks, self.block_size, dtype, self.device)
        allocate_kv_caches(replicated, self.backends, num_blocks * self.kv_pools, self.block_size, dtype, self.device)
        self.proposer.allocate_kv_cache(num_blocks * self.kv_pools, self.block_size, dtype, self.device)
        if self.compilation.pads or self.compilation.compiles:
            self.warmup()
        if self.config.cache_config.calculate_kv_scales:  # after warmup (padding writes nothing): real K/V's scales
            kv_scales.arm(attention_modules(self.model) + self.proposer.kv_layers(),
                          lambda x: self.groups.pcp.all_reduce_max(self.groups.tp.all_reduce_max(x)))

    @torch.inference_mode()
    @serving_native
    def warmup(self) -> None:
        """Run every capture size, largest first, on padding only (no row: nothing is written or sampled), target
        then drafter as the selected draft mode runs it. Compiled pieces are compiled here, and their graphs captured.
        Every rank runs the same sizes in the same order, so the TP/EP collectives inside match up."""
        k = self.config.speculative_config.max_num_speculative_tokens
        for size in reversed(self.compilation.capture_sizes):
            if size > self.config.scheduler_config.max_num_batched_tokens:
                continue
            for _ in range(warmup_passes(self.model)):  # CUDA graphs: the first pass warms up, the second captures
                batch = padding_batch(size, self.device)
                local = LocalBatch(batch.input_ids, batch.positions, global_attention_metadata(batch, self.block_size))
                with forward_context(local.attn_metadata, self.backends):
                    hidden = torch.zeros_like(self.model(local.input_ids, local.positions))  # padding rows are zero
                self.proposer.warmup(TargetStep(StepPlan(), batch, local, hidden, self.pcp), k)
            self.warmed_up_sizes.append(size)

    @torch.inference_mode()
    @serving_native
    def execute(self, plan: StepPlan) -> StepOutput:
        self._free(plan.finished_request_ids)
        self.grammar.admit(plan)
        gathered_before, grammar_before = self.pcp.bytes_gathered, self.grammar.mask_s
        # GLOBAL batch, same on every rank; under PIECEWISE padded up to a capture size
        batch = prepare_inputs(plan, self.block_size, self.device, self.compilation.padded_size(plan.num_tokens),
                               self.inputs)
        self.num_padding_tokens += batch.num_padding
        local = self.pcp.maybe_partition(batch)  # identity at PCP size 1
        with forward_context(local.attn_metadata, self.backends, self.pcp.kv_gather(), self.pcp.kv_exchange()):
            hidden = self.model(local.input_ids, local.positions)  # [T_r, H]
        step = TargetStep(plan, batch, local, self.pcp.mask_padding(hidden, batch), self.pcp)
        start = time.perf_counter()
        self.proposer.observe(step)  # drafter context that every target token feeds (DSpark, MTP's inputs)
        draft_s = time.perf_counter() - start
        prompt_logprobs = self._prompt_logprobs(step)
        emitted, logprobs = self._verify_or_sample(step)
        start = time.perf_counter()
        proposal = self.proposer.propose(step, emitted, plan.num_spec_tokens)
        draft_s += time.perf_counter() - start
        if proposal.draft_probs is not None:
            ids = [plan.rows[i].request_id for i in batch.sample_rows]
            self.draft_probs = dict(zip(ids, proposal.draft_probs, strict=True))
        return StepOutput(emitted, logprobs, proposal.draft_token_ids, proposal.stats, prompt_logprobs, draft_s,
                          self.pcp.bytes_gathered - gathered_before, self.grammar.mask_s - grammar_before)

    def _free(self, request_ids: list[str]) -> None:
        if request_ids:
            self.proposer.free(request_ids)
            self.grammar.free(request_ids)
            for rid in request_ids:
                self.draft_probs.pop(rid, None)

    def _prompt_logprobs(self, step: TargetStep) -> dict[str, list[dict[int, float]]]:
        """For prompt chunks that asked for prompt logprobs: at each position whose next token is known (the
        chunk's own tokens, then next_token_id), top-n logprobs plus that token's. Only those rows' hidden
        states cross PCP ranks."""
        asks = [(i, row) for i, row in enumerate(step.plan.rows) if row.prompt_logprobs is not None]
        if not asks:
            return {}
        qsl = step.batch.query_start_loc_np.tolist()
        rows, targets, spans = [], [], []
        for i, row in asks:
            nxt = row.token_ids[1:] + ([row.next_token_id] if row.next_token_id is not None else [])
            spans.append((row, len(targets), len(nxt)))
            rows += range(qsl[i], qsl[i] + len(nxt))
            targets += nxt
        h = step.hidden_rows(torch.tensor(rows, dtype=torch.int64))  # [N, H]
        entries = top_logprobs(self.model.compute_logits(h), torch.tensor(targets),
                               max(r.prompt_logprobs or 0 for _, r in asks))
        return {row.request_id: entries[start:start + n] for row, start, n in spans}

    def _verify_or_sample(self, step: TargetStep) -> tuple[list[list[int]], list[list[dict[int, float]] | None]]:
        batch = step.batch
        if batch.sampling is None:
            return [], []
        # only the rows whose logits are computed cross PCP ranks, not every prompt token's hidden state
        logits = self.model.compute_logits(step.hidden_rows(batch.logits_indices))  # [sum_i (K_i + 1), V] f32
        emitted = self._emit(step, self.grammar.maybe_mask(step.plan, batch, logits))
        self.grammar.advance(step.plan, batch, emitted)
        return emitted, self._logprobs(step, logits, emitted)  # logprobs of the raw model, as without a grammar

    def _emit(self, step: TargetStep, logits: torch.Tensor) -> list[list[int]]:
        batch = step.batch
        assert batch.sampling is not None
        if not any(batch.num_draft_tokens):
            return [[t] for t in sample(logits, batch.sampling).tolist()]
        draft_probs = None
        if self.config.speculative_config.draft_sample_method == "probabilistic" and self.draft_probs:
            # a row without drafts (a prompt's last chunk) has no distributions to look up
            draft_probs = torch.cat([self.draft_probs[step.plan.rows[i].request_id][:k]
                                     for i, k in zip(batch.sample_rows, batch.num_draft_tokens, strict=True) if k])
        emitted, _ = rejection_sample(logits, batch.draft_token_ids, draft_probs, batch.num_draft_tokens,
                                      batch.sampling)
        return emitted

    @staticmethod
    def _logprobs(step: TargetStep, logits: torch.Tensor,
                  emitted: list[list[int]]) -> list[list[dict[int, float]] | None]:
        batch = step.batch
        assert batch.sampling is not None
        num = batch.sampling.max_num_logprobs
        if num is None:
            return [None] * len(emitted)
        out, start = [], 0
        for tokens, k in zip(emitted, batch.num_draft_tokens, strict=True):
            rows = logits[start:start + len(tokens)]
            out.append(top_logprobs(rows, torch.tensor(tokens), num))
            start += k + 1
        return out

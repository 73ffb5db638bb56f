"""One rank's model runner: StepPlan in, sampled tokens out. Keep this file minimal."""

from __future__ import annotations

import torch

from tandem.attention.backend import AttentionBackend, select_backend
from tandem.attention.forward_context import forward_context
from tandem.config import EngineConfig
from tandem.distributed.groups import SINGLE_RANK, ParallelGroups
from tandem.engine.step_plan import StepOutput, StepPlan
from tandem.layers.sampler import sample, top_logprobs
from tandem.models.loader import build_model
from tandem.worker.input_batch import InputBatch, prepare_inputs
from tandem.worker.kv_cache import allocate_kv_caches, attention_modules, bytes_per_block
from tandem.worker.pcp_hooks import PCPHooks


class ModelRunner:
    def __init__(self, config: EngineConfig, groups: ParallelGroups = SINGLE_RANK):
        self.config = config
        self.device = config.device
        self.block_size = config.cache_config.block_size
        self.model = build_model(config.model_config, groups, self.device)
        self.backends = self._select_backends()
        self.pcp = PCPHooks(groups.pcp, self.block_size)

    def _select_backends(self) -> dict[str, type[AttentionBackend]]:
        attn = self.config.attention_config
        use_pcp = self.config.parallel_config.prefill_context_parallel_size > 1
        kinds = {m.kind for m in attention_modules(self.model)}
        return {kind: select_backend(kind, attn.backend_per_kind.get(kind, attn.backend), use_pcp)
                for kind in sorted(kinds)}

    def num_kv_blocks(self) -> int:
        cache = self.config.cache_config
        if cache.num_gpu_blocks is not None:
            return cache.num_gpu_blocks
        per_block = bytes_per_block(self.model, self.backends, self.block_size, self.config.model_config.dtype)
        return max(1, cache.kv_cache_memory_bytes // max(per_block, 1))

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        allocate_kv_caches(self.model, self.backends, num_blocks, self.block_size,
                           self.config.model_config.dtype, self.device)

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> StepOutput:
        batch = prepare_inputs(plan, self.block_size, self.device)  # GLOBAL batch, same on every rank
        local = self.pcp.maybe_partition(batch)  # identity at PCP size 1
        with forward_context(local.attn_metadata, self.backends, self.pcp.gather_kv):
            hidden = self.model(local.input_ids, local.positions)  # [T_local, hidden]
        hidden = self.pcp.maybe_restore(hidden)  # [T_global, hidden]
        return self._sample(batch, hidden)

    def _sample(self, batch: InputBatch, hidden: torch.Tensor) -> StepOutput:
        if batch.sampling is None:
            return StepOutput([], [])
        logits = self.model.compute_logits(hidden[batch.logits_indices])  # [S, vocab] float32
        tokens = sample(logits, batch.sampling)
        num = batch.sampling.max_num_logprobs
        logprobs = top_logprobs(logits, tokens, num) if num is not None else [None] * len(tokens)
        return StepOutput(tokens.tolist(), logprobs)


"""One rank's model runner: StepPlan in, sampled tokens out. Keep this file minimal."""

from __future__ import annotations

import torch

from tandem.attention.backend import select_target_backends
from tandem.attention.forward_context import forward_context
from tandem.config import EngineConfig
from tandem.distributed.groups import SINGLE_RANK, ParallelGroups
from tandem.engine.step_plan import StepOutput, StepPlan
from tandem.layers.sampler import sample, top_logprobs
from tandem.models.dspark import load_dspark_drafter
from tandem.models.loader import build_model
from tandem.models.registry import attention_kind
from tandem.spec_decode.draft_mode import resolve_draft_mode
from tandem.spec_decode.dspark_proposer import DSparkProposer
from tandem.spec_decode.mtp_proposer import MTPProposer, ShardedStep
from tandem.spec_decode.rejection_sampler import rejection_sample
from tandem.worker.input_batch import InputBatch, global_attention_metadata, padding_batch, prepare_inputs
from tandem.worker.kv_cache import allocate_kv_caches, bytes_per_block
from tandem.worker.pcp_hooks import PCPHooks


class ModelRunner:
    def __init__(self, config: EngineConfig, groups: ParallelGroups = SINGLE_RANK):
        self.config = config
        self.device = config.device
        self.block_size = config.cache_config.block_size
        self.model = build_model(config.model_config, groups, self.device,
                                 with_mtp=config.speculative_config.method == "mtp")
        if config.speculative_config.method != "mtp" and getattr(self.model, "mtp", None) is not None:
            # MTP layers only ever draft: without MTP drafting their weights and their KV cache are dead weight
            self.model.mtp = None
        self.backends = select_target_backends(config)
        self.pcp = PCPHooks(groups.pcp, self.block_size)
        spec = config.speculative_config
        self.draft_mode = resolve_draft_mode(config)
        self.compilation = config.compilation_config
        self.num_padding_tokens = 0  # padding tokens run so far (tests read it)
        self.warmed_up_sizes: list[int] = []
        self.proposer = self._build_proposer()
        # Only replicated MTP drafting reads the target's hidden state at every global token; otherwise just the
        # logits rows are gathered from the PCP ranks.
        self._drafts_from_global_hidden = isinstance(self.proposer, MTPProposer) and self.draft_mode.mode != "sharded"
        # distributions the last proposal's drafts were sampled from, per request (probabilistic drafting)
        self.draft_probs: dict[str, torch.Tensor] | None = (
            {} if self.proposer is not None and spec.draft_sample_method == "probabilistic" else None)

    def _build_proposer(self) -> MTPProposer | DSparkProposer | None:
        spec, model = self.config.speculative_config, self.config.model_config
        probabilistic = spec.draft_sample_method == "probabilistic"
        if spec.method == "mtp":
            assert self.draft_mode.backend is not None
            backends = {attention_kind(model.architecture): self.draft_mode.backend}
            return MTPProposer(self.model.mtp, backends, self.block_size, model.max_model_len, probabilistic,
                               self.config.compilation_config.padded_size)
        if spec.method == "dspark":  # always replicated over the global batch (DESIGN §5)
            assert spec.model is not None
            drafter = load_dspark_drafter(spec.model, model, spec.max_num_speculative_tokens, self.device)
            return DSparkProposer(drafter, self.model, self.block_size, probabilistic)
        return None

    def num_kv_blocks(self) -> int:
        cache = self.config.cache_config
        if cache.num_gpu_blocks is not None:
            return cache.num_gpu_blocks
        dtype = self.config.model_config.dtype
        per_block = bytes_per_block(self.model, self.backends, self.block_size, dtype)
        if isinstance(self.proposer, DSparkProposer):  # the drafter's own cache shares the block pool
            per_block += self.proposer.kv_bytes_per_block(self.block_size, dtype)
        return max(1, cache.kv_cache_memory_bytes // max(per_block, 1))

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        allocate_kv_caches(self.model, self.backends, num_blocks, self.block_size,
                           self.config.model_config.dtype, self.device)
        if isinstance(self.proposer, DSparkProposer):
            self.proposer.allocate_kv_cache(num_blocks, self.block_size, self.config.model_config.dtype, self.device)
        if self.compilation.pads:
            self.warmup()

    @torch.inference_mode()
    def warmup(self) -> None:
        """Run every capture size once, largest first, on padding only (no row: nothing is written or
        sampled), target then drafter as the selected draft mode runs it: sharded MTP on the target's own
        metadata and backends, replicated MTP on the drafter's. Every rank runs the same sizes in the same
        order, so the TP/EP collectives inside match up."""
        for size in reversed(self.compilation.capture_sizes):
            if size > self.config.scheduler_config.max_num_batched_tokens:
                continue
            batch = padding_batch(size, self.device)
            meta = global_attention_metadata(batch, self.block_size)
            with forward_context(meta, self.backends):
                hidden = torch.zeros_like(self.model(batch.input_ids, batch.positions))  # padding rows are zero
            if isinstance(self.proposer, DSparkProposer):
                self.proposer.write_context(batch, torch.zeros_like(self.proposer.take_aux_hidden()))
            elif isinstance(self.proposer, MTPProposer):
                backends = self.backends if self.draft_mode.mode == "sharded" else self.proposer.backends
                k = self.config.speculative_config.max_num_speculative_tokens
                self.proposer.warmup(batch, meta, hidden, backends, k)
            self.warmed_up_sizes.append(size)

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> StepOutput:
        # GLOBAL batch, same on every rank; under PIECEWISE padded up to a capture size
        batch = prepare_inputs(plan, self.block_size, self.device, self.compilation.padded_size(plan.num_tokens))
        self.num_padding_tokens += batch.num_padding
        local = self.pcp.maybe_partition(batch)  # identity at PCP size 1
        with forward_context(local.attn_metadata, self.backends, self.pcp.gather_kv):
            hidden = self.model(local.input_ids, local.positions)  # [T_local, hidden]
        if batch.num_padding and local.token_idx is None:  # PCP size 1: padding ran with the batch
            hidden = hidden.masked_fill(batch.is_padding[:, None], 0)
        hidden_local = hidden
        if self._drafts_from_global_hidden:
            # under PCP, padding is on no rank and restore() gives it zero rows
            hidden = self.pcp.maybe_restore(hidden)  # [T_global(+padding), hidden]
            logits_hidden = hidden[batch.logits_indices] if batch.sampling is not None else None
        else:
            # only the rows whose logits are computed cross ranks, not every prompt token's hidden state
            hidden = None
            logits_hidden = self.pcp.maybe_restore_rows(hidden_local, batch.logits_indices) \
                if batch.sampling is not None else None
        self._maybe_write_draft_context(batch)
        prompt_logprobs = self._prompt_logprobs(plan, batch, hidden, hidden_local)
        emitted, logprobs = self._verify_or_sample(plan, batch, logits_hidden)
        sharded = ShardedStep(local, hidden_local, self.pcp) if self.draft_mode.mode == "sharded" else None
        drafts = self._propose(plan, batch, hidden, emitted, sharded)
        confidence = (0.0, 0)
        if isinstance(self.proposer, DSparkProposer) and drafts and self.proposer.last_confidence is not None:
            scores = self.proposer.last_confidence  # [S, K]
            confidence = (float(scores.sum()), scores.numel())
        return StepOutput(emitted, logprobs, drafts, confidence, prompt_logprobs)

    def _maybe_write_draft_context(self, batch: InputBatch) -> None:
        """DSpark's context K/V covers every target token, so it is written on every step, sampling or not."""
        if isinstance(self.proposer, DSparkProposer):
            aux = self.pcp.maybe_restore(self.proposer.take_aux_hidden())  # [T_global, n_layers * hidden]
            if batch.num_padding:
                aux = aux.masked_fill(batch.is_padding[:, None], 0)
            self.proposer.write_context(batch, aux)

    def _prompt_logprobs(self, plan: StepPlan, batch: InputBatch, hidden: torch.Tensor | None,
                         hidden_local: torch.Tensor) -> dict[str, list[dict[int, float]]]:
        """For prompt chunks that asked for prompt logprobs: at each position whose next token is known (the
        chunk's own tokens, then next_token_id), top-n logprobs plus that token's. Only those rows' hidden
        states cross PCP ranks."""
        asks = [(i, row) for i, row in enumerate(plan.rows) if row.prompt_logprobs is not None]
        if not asks:
            return {}
        qsl = batch.query_start_loc_cpu.tolist()
        rows, targets, spans = [], [], []
        for i, row in asks:
            nxt = row.token_ids[1:] + ([row.next_token_id] if row.next_token_id is not None else [])
            spans.append((row, len(targets), len(nxt)))
            rows += range(qsl[i], qsl[i] + len(nxt))
            targets += nxt
        idx = torch.tensor(rows, dtype=torch.int64)
        h = hidden[idx] if hidden is not None else self.pcp.maybe_restore_rows(hidden_local, idx)  # [N, H]
        entries = top_logprobs(self.model.compute_logits(h), torch.tensor(targets), max(r.prompt_logprobs or 0
                                                                                        for _, r in asks))
        return {row.request_id: entries[start:start + n] for row, start, n in spans}

    def _verify_or_sample(self, plan: StepPlan, batch: InputBatch, logits_hidden: torch.Tensor | None
                          ) -> tuple[list[list[int]], list[list[dict[int, float]] | None]]:
        """logits_hidden: [sum_i (K_i + 1), H] the target's states at batch.logits_indices."""
        if batch.sampling is None or logits_hidden is None:
            return [], []
        logits = self.model.compute_logits(logits_hidden)  # [sum_i (K_i + 1), vocab] float32
        emitted = self._emit(plan, batch, logits)
        return emitted, self._logprobs(batch, logits, emitted)

    def _emit(self, plan: StepPlan, batch: InputBatch, logits: torch.Tensor) -> list[list[int]]:
        assert batch.sampling is not None
        if not any(batch.num_draft_tokens):
            return [[t] for t in sample(logits, batch.sampling).tolist()]
        draft_probs = None
        if self.draft_probs is not None:
            # a row without drafts (a prompt's last chunk) has no distributions to look up
            draft_probs = torch.cat([self.draft_probs[plan.rows[i].request_id][:k]
                                     for i, k in zip(batch.sample_rows, batch.num_draft_tokens, strict=True) if k])
        emitted, _ = rejection_sample(logits, batch.draft_token_ids, draft_probs, batch.num_draft_tokens,
                                      batch.sampling)
        return emitted

    def _propose(self, plan: StepPlan, batch: InputBatch, hidden: torch.Tensor | None, emitted: list[list[int]],
                 sharded: ShardedStep | None) -> list[list[int]]:
        if isinstance(self.proposer, MTPProposer):
            # MTP's step 0 runs on every step, sampling or not, so its own KV covers the whole context
            drafts, probs = self.proposer.propose(plan, batch, hidden, emitted, plan.num_spec_tokens, sharded)
        elif self.proposer is not None and plan.num_spec_tokens and emitted:
            drafts, probs = self.proposer.propose(plan, batch, hidden, emitted, plan.num_spec_tokens)
        else:
            return []
        if self.draft_probs is not None and probs is not None:
            ids = [plan.rows[i].request_id for i in batch.sample_rows]
            self.draft_probs = dict(zip(ids, probs, strict=True))
        return drafts

    @staticmethod
    def _logprobs(batch: InputBatch, logits: torch.Tensor,
                  emitted: list[list[int]]) -> list[list[dict[int, float]] | None]:
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


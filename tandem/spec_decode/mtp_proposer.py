"""MTP drafter: K draft tokens per sampling row from the checkpoint's multi-token-prediction module(s).

Step 0 runs over every token of the step (prompt chunks too, so the MTP layer's own paged KV covers
the whole context): the token at position q is paired with the target's hidden state at q and the
*next* token id, so each row's ids are shifted left by one and its last valid slot gets the token
that follows it (the next prompt token of a chunk, or the freshly emitted token of a sampling row).
Steps 1..K-1 are one-token decodes that feed back the MTP layer's own pre-norm hidden state.

Example, decode row [t9 d1 d2] (positions 9, 10, 11) where the target accepted d1 and emitted x:
shifted ids [d1 x ?], the draft is sampled at slot 1 (position 10), step 1 runs at position 11.
Draft step 0 runs in one of the two modes of DESIGN §5: replicated, over the GLOBAL batch with metadata
rebuilt from global positions, sequence lengths and block tables; or sharded, on the rank's PCP segments
with the target's local metadata (ids shifted globally, then localized) and restored before sampling.
Steps 1..K-1 are global decodes either way.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from tandem.attention.backend import AttentionBackend
from tandem.attention.batch import PAD_SLOT_ID, AttentionBatch, KVShard
from tandem.attention.forward_context import forward_context
from tandem.models.mtp import DeepSeekMTP
from tandem.spec_decode.draft_sampling import pack_drafts, sample_draft
from tandem.spec_decode.mtp_catch_up import DeferredStep0
from tandem.spec_decode.proposer import Proposal, TargetStep
from tandem.step_plan import STEP0_DEFERRED, StepPlan
from tandem.worker.input_batch import InputBatch


class MTPProposer:
    """`sharded`: draft step 0 on the rank's PCP segments with the target's metadata (DESIGN §5's PCP-sharded
    mode); otherwise replicated over the global batch with `backends`, the drafter's own."""

    def __init__(self, mtp: DeepSeekMTP, backends: dict[str, type[AttentionBackend]], block_size: int,
                 max_model_len: int, probabilistic: bool, sharded: bool,
                 target_backends: dict[str, type[AttentionBackend]],
                 padded_size: Callable[[int], int] = lambda n: n, defers: bool = False):
        self.mtp, self.backends, self.block_size = mtp, backends, block_size
        self.max_model_len, self.probabilistic, self.sharded = max_model_len, probabilistic, sharded
        self.target_backends = target_backends
        self.padded_size = padded_size  # PIECEWISE: draft decodes of S rows run at this many tokens
        # decode tokens of K = 0 steps whose step 0 has not run (mtp_catch_up.defers_step0 says where it defers)
        self.defers, self.deferred = defers, DeferredStep0(block_size)

    def kv_bytes_per_block(self, block_size: int, dtype: torch.dtype) -> int:
        return 0  # the MTP layers' attention modules are part of the target model, sized with it

    def allocate_kv_cache(self, num_blocks: int, block_size: int, dtype: torch.dtype, device: str) -> None:
        pass  # allocated with the target's layers

    def kv_layers(self) -> list[nn.Module]:
        return []  # the MTP layers' attention modules are the target model's

    def free(self, request_ids: list[str]) -> None:
        self.deferred.free(request_ids)

    def observe(self, step: TargetStep) -> None:
        if not self.sharded:
            self.global_states(step)  # replicated step 0 reads every global token's state: restore it once, now

    def local_states(self, step: TargetStep) -> torch.Tensor:
        """[T_r, H] what draft step 0 reads of the target at this rank's tokens: its final-normed hidden states."""
        return step.hidden_local

    def global_states(self, step: TargetStep) -> torch.Tensor:
        """[T(+padding), H] the same in global order (restored once a step)."""
        return step.global_hidden()

    @torch.inference_mode()
    def propose(self, step: TargetStep, emitted: list[list[int]], k: int) -> Proposal:
        """K drafts per sampling row, and for probabilistic drafting each row's draft distributions [K, V].
        Step 0 keeps the MTP layer's own KV covering the whole context: it runs on every step, sampling or not,
        except a decode step proposing nothing (K = 0), whose tokens it takes at the next step that drafts
        (mtp_catch_up.py; the sharded mode at PCP > 1 runs it every step)."""
        plan, batch = step.plan, step.batch
        if self.defers and k == 0 and self.deferred.defer_decodes(plan, emitted, self.global_states(step)):
            return Proposal([[] for _ in emitted], stats={STEP0_DEFERRED: float(batch.num_tokens - batch.num_padding)})
        shifted, last_idx = self._shifted_ids(plan, batch, emitted)  # global: a next token may be remote
        if self.defers and k == 0 and last_idx and self.deferred.can_defer(plan, batch, last_idx):
            self.deferred.defer(plan, batch, shifted, self.global_states(step), last_idx)
            return Proposal([[] for _ in last_idx], stats={STEP0_DEFERRED: float(batch.num_tokens - batch.num_padding)})
        extension = self.deferred.extend(plan, batch, shifted, self.global_states(step)) if self.defers else None
        sample_idx = last_idx  # each sampling row's last valid token among step 0's outputs
        if extension is not None:  # the deferred tokens ride along, each row now a longer causal run
            with forward_context(extension.attn_metadata, self.backends):
                h_logits, h_feedback = self.mtp(extension.input_ids, extension.positions, extension.hidden, 0)
            sample_idx = [extension.sample_index(i, idx) for i, idx in zip(batch.sample_rows, last_idx, strict=True)]
        elif self.sharded:
            h_logits, h_feedback = self._sharded_step0(shifted, step)  # [T_r, H] each
        else:
            with forward_context(step.pcp.global_metadata(batch, step.local), self.backends):
                h_logits, h_feedback = self.mtp(shifted, batch.positions, self.global_states(step), 0)  # [T, H] each
        stats = extension.stats if extension is not None else {}
        if k == 0 or not last_idx:
            return Proposal([[] for _ in last_idx], stats=stats)  # step 0 only kept the MTP layer's KV up to date
        if self.sharded and extension is None:  # only the S rows that draft cross ranks
            h_logits = step.pcp.maybe_restore_rows(h_logits, last_idx)
            feedback = step.pcp.maybe_restore_rows(h_feedback, last_idx)
        else:
            h_logits, feedback = h_logits[sample_idx], h_feedback[sample_idx]  # [S, H] each
        positions = batch.positions[last_idx]  # [S] position of each row's last valid token
        tokens, probs = self.sample(h_logits, 0, batch, positions + 2)
        drafts, draft_probs = [tokens], [probs]
        num_rows = len(last_idx)
        # a sharded drafter's own KV is sharded like the target's: its decodes attend over owned keys too (rows that
        # every rank holds, merged over the ranks)
        kv_shard = step.pcp.kv_shard() if self.sharded else None
        kv_exchange = step.pcp.kv_exchange(replicated_rows=True) if self.sharded else None
        # The draft decodes' key bound comes from THIS step's global batch (the seed PR's review finding: a bound
        # kept from the previous proposal misses a request that just accepted all K drafts plus its bonus token);
        # only the K - 1 draft decodes read it
        decode = DraftDecodeMetadata(plan, batch, self.block_size, self.max_model_len,
                                     draft_max_seq_len(batch, k, self.max_model_len), kv_shard) if k > 1 else None
        for i in range(1, k):
            assert decode is not None
            step_pos = positions + i
            ids, pos, fb = self._pad_decode(drafts[-1], step_pos.clamp(max=self.max_model_len - 1), feedback)
            with forward_context(decode.at(step_pos), self.backends, kv_exchange=kv_exchange):
                h_logits, feedback = self.mtp(ids, pos, fb, i)
            h_logits, feedback = h_logits[:num_rows], feedback[:num_rows]  # padding samples nothing
            tokens, probs = self.sample(h_logits, i, batch, step_pos + 2)
            drafts.append(tokens)
            draft_probs.append(probs)
        token_ids, q = pack_drafts(drafts, draft_probs, self.probabilistic)
        return Proposal(token_ids, q, stats)

    def sample(self, h_logits: torch.Tensor, spec_step_idx: int, batch: InputBatch,
               positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """h_logits: [S, H] -> (drafts [S], their distributions [S, V] when probabilistic); positions: [S] of the
        drafts (the keys of their noise)."""
        return sample_draft(self.mtp.compute_logits(h_logits, spec_step_idx), batch.sampling, positions,
                            self.probabilistic)

    def _pad_decode(self, ids: torch.Tensor, positions: torch.Tensor, feedback: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Pad S one-token rows to the capture size: id 0, position 0, zero hidden state. The padding tokens
        are in no attention row, so they read nothing and write nothing."""
        num_pad = self.padded_size(ids.shape[0]) - ids.shape[0]
        if num_pad <= 0:
            return ids, positions, feedback
        return (torch.cat((ids, ids.new_zeros(num_pad))), torch.cat((positions, positions.new_zeros(num_pad))),
                torch.cat((feedback, feedback.new_zeros(num_pad, feedback.shape[1]))))

    def warmup(self, step: TargetStep, k: int) -> None:
        """Step 0 and the draft decodes at one capture size, on padding only (see ModelRunner.warmup), in the
        selected draft mode: sharded on the target's own metadata and backends, replicated on the drafter's."""
        batch, hidden = step.batch, self.local_states(step)  # padding only: the same rows on every rank
        meta = step.local.attn_metadata
        with forward_context(meta, self.target_backends if self.sharded else self.backends):
            _, feedback = self.mtp(batch.input_ids, batch.positions, hidden, 0)
        for i in range(1, k):
            with forward_context(meta, self.backends):
                _, feedback = self.mtp(batch.input_ids, batch.positions, torch.zeros_like(feedback), i)

    def _sharded_step0(self, shifted: torch.Tensor, step: TargetStep) -> tuple[torch.Tensor, torch.Tensor]:
        """Draft step 0 on the rank-local segments, reusing the target's local metadata and PCP buffers;
        the caller gathers the sampling rows of the [T_r, H] outputs in global order."""
        local, pcp = step.local, step.pcp
        with forward_context(local.attn_metadata, self.backends, pcp.kv_gather(), pcp.kv_exchange()):
            return self.mtp(pcp.localize(shifted), local.positions, self.local_states(step), 0)  # [T_r, H] each

    def _shifted_ids(self, plan: StepPlan, batch: InputBatch,
                     emitted: list[list[int]]) -> tuple[torch.Tensor, list[int]]:
        qsl = batch.query_start_loc_np
        shifted = torch.roll(batch.input_ids, -1)  # [T]; each row's last slot is fixed below
        shifted[batch.num_tokens - batch.num_padding:] = 0  # padding stays id 0
        # the slots to fix and their ids (a later fix of a slot wins), written in one indexed assignment
        fixes = {int(qsl[i + 1]) - 1: row.next_token_id for i, row in enumerate(plan.rows)
                 if row.next_token_id is not None}
        last_idx = []
        for s, i in enumerate(batch.sample_rows):
            idx = int(qsl[i + 1]) - 1 - batch.num_draft_tokens[s] + len(emitted[s]) - 1  # last valid token of row i
            fixes[idx] = emitted[s][-1]
            last_idx.append(idx)
        if fixes:
            shifted[torch.tensor(list(fixes))] = torch.tensor(list(fixes.values()), dtype=shifted.dtype,
                                                              device=shifted.device)
        return shifted, last_idx


class DraftDecodeMetadata:
    """The attention batches of the K-1 one-token draft decodes of S rows: the block table rows, the key bound and
    the block counts are fixed for the proposal; each decode only moves the positions. Every decode after the first
    names the first as its `base`, so a backend may move its first plan on instead of planning anew.

    A slot beyond a row's reserved blocks (or max_model_len) writes nothing. `max_seq_len` bounds the keys any
    row may read; a row beyond it is a bug, never a silent truncation."""

    def __init__(self, plan: StepPlan, batch: InputBatch, block_size: int, max_model_len: int, max_seq_len: int,
                 kv_shard: KVShard | None = None):
        self.block_size, self.max_model_len, self.max_seq_len = block_size, max_model_len, max_seq_len
        self.kv_shard = kv_shard  # sharded KV: rows over this rank's own keys, merged
        self.table = batch.block_table[batch.sample_rows]  # [S, max_blocks]
        device = self.table.device
        self.num_blocks = torch.tensor([len(plan.rows[i].block_ids) for i in batch.sample_rows], device=device)
        n = len(batch.sample_rows)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32)
        self.base: AttentionBatch | None = None

    def at(self, positions: torch.Tensor) -> AttentionBatch:
        """positions: [S] of this decode's tokens -> its attention batch."""
        block_idx = positions // self.block_size
        valid = (block_idx < self.num_blocks) & (positions < self.max_model_len)
        safe_idx = torch.where(valid, block_idx, 0)
        slots = self.table.gather(1, safe_idx[:, None]).squeeze(1).long() * self.block_size \
            + positions % self.block_size
        slots = torch.where(valid, slots, PAD_SLOT_ID)
        writes = slots >= 0
        clamped = positions.clamp(max=self.max_model_len - 1)
        seq_lens = (clamped + 1).to(torch.int32).cpu()
        if positions.shape[0] and int(seq_lens.max()) > self.max_seq_len:
            raise RuntimeError(f"draft attention bound {self.max_seq_len} does not cover a draft row of "
                               f"{int(seq_lens.max())} keys")
        decode = AttentionBatch(positions=clamped, query_start_loc_cpu=self.query_start_loc, seq_lens_cpu=seq_lens,
                                block_table=self.table, block_size=self.block_size,
                                write_rows=writes.nonzero().squeeze(1), write_slots=slots[writes],
                                key_bound=self.max_seq_len, base=self.base, kv_shard=self.kv_shard)
        if self.base is None and self.kv_shard is None:  # owned keys are planned per decode (kv_ownership.py)
            self.base = decode
        return decode


def draft_max_seq_len(batch: InputBatch, k: int, max_model_len: int) -> int:
    """Keys the draft decodes of this step may read: the longest sampling row's upper bound (its seq_len with
    every draft of the step accepted) + K, clamped to max_model_len. Computed from the current GLOBAL batch,
    never from the previous proposal's value and never from a rank-local segment."""
    if not batch.sample_rows:
        return 0
    upper = int(batch.seq_lens_cpu[batch.sample_rows].max())
    return min(upper + k, max_model_len)

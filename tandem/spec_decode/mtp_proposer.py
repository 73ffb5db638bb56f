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
from dataclasses import dataclass

import torch

from tandem.attention.backend import AttentionBackend
from tandem.attention.forward_context import forward_context
from tandem.attention.metadata import PAD_SLOT_ID, AttentionMetadata, build_attention_metadata
from tandem.engine.step_plan import StepPlan
from tandem.models.mtp import DeepSeekMTP
from tandem.spec_decode.draft_sampling import pack_drafts, sample_draft
from tandem.worker.input_batch import InputBatch, global_attention_metadata
from tandem.worker.pcp_hooks import LocalBatch, PCPHooks


@dataclass
class ShardedStep:
    """What sharded drafting reuses from the target's step: its local view, hidden states and PCP hooks."""

    local: LocalBatch
    hidden_local: torch.Tensor  # [T_r, H] the target's rank-local final-normed hidden states
    pcp: PCPHooks


class MTPProposer:
    def __init__(self, mtp: DeepSeekMTP, backends: dict[str, type[AttentionBackend]], block_size: int,
                 max_model_len: int, probabilistic: bool, padded_size: Callable[[int], int] = lambda n: n):
        self.mtp, self.backends, self.block_size = mtp, backends, block_size
        self.max_model_len, self.probabilistic = max_model_len, probabilistic
        self.padded_size = padded_size  # PIECEWISE: draft decodes of S rows run at this many tokens

    @torch.inference_mode()
    def propose(self, plan: StepPlan, batch: InputBatch, hidden: torch.Tensor | None, emitted: list[list[int]],
                k: int, sharded: ShardedStep | None = None) -> tuple[list[list[int]], list[torch.Tensor] | None]:
        """hidden: [T, H] the target's final-normed states in global order -> (K drafts per sampling
        row, and for probabilistic drafting each row's draft distributions [K, V]). With `sharded`, draft
        step 0 runs on this rank's PCP segments instead of the whole global batch (and `hidden` is unused:
        the rank-local states come with `sharded`)."""
        # The draft decodes' key bound comes from THIS step's global batch, before any draft metadata is built
        # (the seed PR's review finding: a bound kept from the previous proposal misses a request that just
        # accepted all K drafts plus its bonus token).
        max_seq_len = draft_max_seq_len(batch, k, self.max_model_len)
        shifted, last_idx = self._shifted_ids(plan, batch, emitted)  # global: a next token may be remote
        if sharded is None:
            assert hidden is not None, "replicated MTP drafting needs the target's global hidden states"
            meta = global_attention_metadata(batch, self.block_size)
            with forward_context(meta, self.backends):
                h_logits, h_feedback = self.mtp(shifted, batch.positions, hidden, 0)  # [T, H] each
        else:
            h_logits, h_feedback = self._sharded_step0(shifted, sharded)  # [T_r, H] each
        if k == 0 or not last_idx:
            return [[] for _ in last_idx], None  # step 0 only kept the MTP layer's KV up to date
        if sharded is None:
            h_logits, feedback = h_logits[last_idx], h_feedback[last_idx]  # [S, H] each
        else:  # only the S rows that draft cross ranks
            h_logits = sharded.pcp.maybe_restore_rows(h_logits, last_idx)
            feedback = sharded.pcp.maybe_restore_rows(h_feedback, last_idx)
        positions = batch.positions[last_idx]  # [S] position of each row's last valid token
        tokens, probs = sample_draft(self.mtp.compute_logits(h_logits, 0), batch.sampling, positions + 2,
                                     self.probabilistic)
        drafts, draft_probs = [tokens], [probs]
        num_rows = len(last_idx)
        for step in range(1, k):
            step_pos = positions + step
            meta = self._decode_metadata(plan, batch, step_pos, max_seq_len)
            ids, pos, fb = self._pad_decode(drafts[-1], step_pos.clamp(max=self.max_model_len - 1), feedback)
            with forward_context(meta, self.backends):
                h_logits, feedback = self.mtp(ids, pos, fb, step)
            h_logits, feedback = h_logits[:num_rows], feedback[:num_rows]  # padding samples nothing
            tokens, probs = sample_draft(self.mtp.compute_logits(h_logits, step), batch.sampling, step_pos + 2,
                                         self.probabilistic)
            drafts.append(tokens)
            draft_probs.append(probs)
        return pack_drafts(drafts, draft_probs, self.probabilistic)

    def _pad_decode(self, ids: torch.Tensor, positions: torch.Tensor, feedback: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Pad S one-token rows to the capture size: id 0, position 0, zero hidden state. The padding tokens
        are in no attention row, so they read nothing and write nothing."""
        num_pad = self.padded_size(ids.shape[0]) - ids.shape[0]
        if num_pad <= 0:
            return ids, positions, feedback
        return (torch.cat((ids, ids.new_zeros(num_pad))), torch.cat((positions, positions.new_zeros(num_pad))),
                torch.cat((feedback, feedback.new_zeros(num_pad, feedback.shape[1]))))

    def warmup(self, batch: InputBatch, meta: AttentionMetadata, hidden: torch.Tensor,
               backends: dict[str, type[AttentionBackend]], k: int) -> None:
        """Step 0 and the draft decodes at one capture size, on padding only (see ModelRunner.warmup)."""
        with forward_context(meta, backends):
            _, feedback = self.mtp(batch.input_ids, batch.positions, hidden, 0)
        for step in range(1, k):
            with forward_context(meta, self.backends):
                _, feedback = self.mtp(batch.input_ids, batch.positions, torch.zeros_like(feedback), step)

    def _sharded_step0(self, shifted: torch.Tensor, step: ShardedStep) -> tuple[torch.Tensor, torch.Tensor]:
        """Draft step 0 on the rank-local segments, reusing the target's local metadata and PCP buffers;
        the caller gathers the sampling rows of the [T_r, H] outputs in global order."""
        local, pcp = step.local, step.pcp
        ids = shifted if local.token_idx is None else shifted[local.token_idx]  # [T_r]
        with forward_context(local.attn_metadata, self.backends, pcp.gather_kv):
            return self.mtp(ids, local.positions, step.hidden_local, 0)  # [T_r, H] each

    def _shifted_ids(self, plan: StepPlan, batch: InputBatch,
                     emitted: list[list[int]]) -> tuple[torch.Tensor, list[int]]:
        qsl = batch.query_start_loc_cpu.tolist()
        shifted = torch.roll(batch.input_ids, -1)  # [T]; each row's last slot is fixed below
        shifted[batch.num_tokens - batch.num_padding:] = 0  # padding stays id 0
        for i, row in enumerate(plan.rows):
            if row.next_token_id is not None:
                shifted[qsl[i + 1] - 1] = row.next_token_id
        last_idx = []
        for s, i in enumerate(batch.sample_rows):
            idx = qsl[i + 1] - 1 - batch.num_draft_tokens[s] + len(emitted[s]) - 1  # last valid token of row i
            shifted[idx] = emitted[s][-1]
            last_idx.append(idx)
        return shifted, last_idx

    def _decode_metadata(self, plan: StepPlan, batch: InputBatch, positions: torch.Tensor,
                         max_seq_len: int) -> AttentionMetadata:
        """One-token rows at `positions`; a slot beyond a row's reserved blocks (or max_model_len) writes nothing.
        `max_seq_len` bounds the keys any row may read; a row beyond it is a bug, never a silent truncation."""
        table = batch.block_table[batch.sample_rows]  # [S, max_blocks]
        num_blocks = torch.tensor([len(plan.rows[i].block_ids) for i in batch.sample_rows], device=positions.device)
        block_idx = positions // self.block_size
        valid = (block_idx < num_blocks) & (positions < self.max_model_len)
        safe_idx = torch.where(valid, block_idx, 0)
        slots = table.gather(1, safe_idx[:, None]).squeeze(1).long() * self.block_size + positions % self.block_size
        slots = torch.where(valid, slots, PAD_SLOT_ID)
        n = positions.shape[0]
        writes = slots >= 0
        seq_lens = (torch.minimum(positions, torch.tensor(self.max_model_len - 1)) + 1).to(torch.int32).cpu()
        if n and int(seq_lens.max()) > max_seq_len:
            raise RuntimeError(f"draft attention bound {max_seq_len} does not cover a draft row of "
                               f"{int(seq_lens.max())} keys")
        return build_attention_metadata(
            positions.clamp(max=self.max_model_len - 1), torch.arange(n + 1, dtype=torch.int32), seq_lens, table,
            self.block_size, writes.nonzero().squeeze(1), slots[writes])


def draft_max_seq_len(batch: InputBatch, k: int, max_model_len: int) -> int:
    """Keys the draft decodes of this step may read: the longest sampling row's upper bound (its seq_len with
    every draft of the step accepted) + K, clamped to max_model_len. Computed from the current GLOBAL batch,
    never from the previous proposal's value and never from a rank-local segment."""
    if not batch.sample_rows:
        return 0
    upper = int(batch.seq_lens_cpu[batch.sample_rows].max())
    return min(upper + k, max_model_len)

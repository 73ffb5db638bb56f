"""Deferred MTP step 0: decode steps that propose no drafts (the "auto" policy chose K = 0) skip the MTP layer and
keep what its step 0 would have read; the next step that runs step 0 runs it over the deferred tokens too. EAGLE-3
runs the same passes (its head in the MTP layer's place, the aux states in the hidden state's), so it defers alike.

Step 0 keeps the MTP layer's own KV current; at K = 0 its output is not sampled, so it only has to run before the
next draft reads that KV. A deferred token is (position, shifted id, target hidden state), the three inputs step 0
pairs per token. At catch-up each row's deferred tokens are prepended to the row: they sit right before its first
token, so the row becomes one causal query run over consecutive positions, its keys written as it goes.

Example, one request: K = 0 at positions 40 and 41 (deferred), the policy drafts again at the step of position 42.
Step 0 of that step runs the row [40 41 42] (ids [x41 x42 x43], hidden [h40 h41 h42]) instead of [42]; its
sampling index moves from 0 to 2 (`RowExtension.sample_index`).

Only acceptance could ever depend on this (verification is lossless whatever the MTP KV holds), and the KV comes
out the same as if step 0 had run every step (tests/test_mtp_catch_up.py). Deferring is limited to
`MAX_DEFERRED_TOKENS` a request, beyond which the step runs step 0 (catching up) as usual. A prompt whose last
chunk fits under the bound defers too (the step that admits a new batch at K = 0 runs no MTP layer). A block of deferred
tokens that the prefix cache hands to another request before they are caught up carries no MTP KV for them:
that request's drafts read a hole there and are accepted less often, never wrongly.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from tandem.attention.batch import AttentionBatch
from tandem.step_plan import StepPlan
from tandem.worker.input_batch import InputBatch, global_attention_metadata

MAX_DEFERRED_TOKENS = 256  # a request's deferred hidden states, each [H]: bounded memory, a bounded catch-up


def defers_step0(method: str | None, draft_mode: str | None, pcp_size: int) -> bool:
    """Whether an MTP or EAGLE-3 drafter defers step 0 at K = 0: where step 0 runs on the global batch (replicated,
    or any mode at PCP size 1); the sharded mode at PCP > 1 runs it on rank-local segments every step."""
    return method in ("mtp", "eagle3") and (draft_mode != "sharded" or pcp_size == 1)


def defers_at_k0(method: str | None, auto: bool, draft_mode: str | None, pcp_size: int) -> bool:
    """Whether the drafter's per-step pass waits at K = 0 steps for the next step that drafts: MTP's step 0
    (defers_step0), or, under "auto" at PCP size 1, DSpark's context write (dspark_proposer.DeferredContext; at
    PCP > 1 each step's write is a collective over that step's segments)."""
    return defers_step0(method, draft_mode, pcp_size) or (method == "dspark" and auto and pcp_size == 1)


@dataclass
class DeferredTokens:
    """One request's tokens whose MTP step 0 has not run: consecutive positions from `start`."""

    start: int
    ids: list[int] = field(default_factory=list)  # [n] shifted ids (Python ints: one decode's id costs no op)
    hidden: list[torch.Tensor] = field(default_factory=list)  # pieces of [n_i, H], sum n_i = n
    num_tokens: int = 0

    @property
    def end(self) -> int:
        return self.start + self.num_tokens

    def append(self, ids: torch.Tensor, hidden: torch.Tensor) -> None:
        self.ids += ids.tolist()
        self.hidden.append(hidden.clone())  # the target's output buffer may be reused by the next step
        self.num_tokens += ids.shape[0]

    def before(self, position: int) -> DeferredTokens | None:
        """The deferred tokens a row starting at `position` extends back over: those right before it. A row that
        recomputes them (a preempted request's prompt) or starts after a gap takes none; the gap's KV is a hole."""
        if self.start >= position or self.end < position:
            return None
        keep = position - self.start
        if keep == self.num_tokens:
            return self
        return DeferredTokens(self.start, self.ids[:keep], [torch.cat(self.hidden)[:keep]], keep)


@dataclass
class RowExtension:
    """Step 0's batch with the deferred tokens prepended to their rows."""

    input_ids: torch.Tensor  # [T + D] int64 shifted ids
    positions: torch.Tensor  # [T + D] int64
    hidden: torch.Tensor  # [T + D, H] target hidden states
    attn_metadata: AttentionBatch
    offsets: np.ndarray  # [R] deferred tokens prepended at or before row i (a token of row i moves by offsets[i])

    @property
    def stats(self) -> dict[str, float]:
        """The catch-up's size, reported with the proposal: the metrics count it, and "auto" keeps such a step's
        time out of its step-cost corrections (a one-time cost, not what drafting at its K costs)."""
        return {"catch_up_tokens": float(self.offsets[-1]) if len(self.offsets) else 0.0}

    def sample_index(self, row: int, index: int) -> int:
        """Where token `index` of the original batch, in batch row `row`, sits in the extended batch."""
        return index + int(self.offsets[row])


class DeferredStep0:
    """Per-request deferred tokens: `defer` at K = 0, `extend` when step 0 runs again."""

    def __init__(self, block_size: int):
        self.block_size = block_size
        self.deferred: dict[str, DeferredTokens] = {}

    def can_defer(self, plan: StepPlan, batch: InputBatch, last_idx: list[int]) -> bool:
        """Every row samples (decodes, and prompts that end this step) and stays under the bound. A prompt's last
        chunk defers like a decode: its tokens wait with their hidden states, and at a long context its step 0 is
        the costliest pass a K = 0 step would run (a new batch of 82-token prompts over ~8k cached keys: ~60 ms).
        A chunk that does not end its prompt samples nothing and runs step 0 (deferring it would leave the next
        chunk's row starting after a gap of undeferred tokens)."""
        if len(batch.sample_rows) != len(plan.rows):
            return False
        qsl = batch.query_start_loc_np
        for s, i in enumerate(batch.sample_rows):
            earlier = self.deferred.get(plan.rows[i].request_id)
            if (earlier.num_tokens if earlier else 0) + last_idx[s] - int(qsl[i]) + 1 > MAX_DEFERRED_TOKENS:
                return False
        return True

    def defer_decodes(self, plan: StepPlan, emitted: list[list[int]], hidden: torch.Tensor) -> bool:
        """`can_defer` and `defer` for the step "auto" runs most at K = 0: every row one decode token, no drafts.
        Each row's shifted id is its sampled token and its position its computed tokens, so the step costs one
        copy of the rows' hidden states [R, H] and a few dict operations a row (the general path's shifted ids,
        positions and per-row copies were ~0.15 ms of a ~4.5 ms batch-1 step). False, keeping nothing, where a row
        is anything else or would pass the bound: the caller takes the general path."""
        rows = plan.rows
        for row in rows:
            entry = self.deferred.get(row.request_id)
            if (len(row.token_ids) != 1 or row.sampling is None or row.next_token_id is not None
                    or (entry is not None and entry.num_tokens >= MAX_DEFERRED_TOKENS)):
                return False
        states = hidden[: len(rows)].clone()  # [R, H] one token a row, in row order
        for i, row in enumerate(rows):
            pos = row.num_computed_tokens
            entry = self.deferred.get(row.request_id)
            if entry is None or entry.end != pos:  # nothing deferred yet, or a restart: begin at this row
                entry = self.deferred[row.request_id] = DeferredTokens(pos)
            entry.ids.append(emitted[i][-1])
            entry.hidden.append(states[i: i + 1])
            entry.num_tokens += 1
        return True

    def defer(self, plan: StepPlan, batch: InputBatch, shifted: torch.Tensor, hidden: torch.Tensor,
              last_idx: list[int]) -> None:
        """Keep each row's valid tokens (up to its last accepted one; rejected drafts' slots are rewritten later)."""
        qsl, positions = batch.query_start_loc_np, batch.positions.cpu()
        for s, i in enumerate(batch.sample_rows):
            rid, first = plan.rows[i].request_id, int(qsl[i])
            pos = int(positions[first])
            entry = self.deferred.get(rid)
            if entry is None or entry.end != pos:  # nothing deferred yet, or a restart: begin at this row
                entry = self.deferred[rid] = DeferredTokens(pos)
            entry.append(shifted[first: last_idx[s] + 1], hidden[first: last_idx[s] + 1])

    def free(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self.deferred.pop(rid, None)

    def extend(self, plan: StepPlan, batch: InputBatch, shifted: torch.Tensor,
               hidden: torch.Tensor) -> RowExtension | None:
        """Step 0's inputs with every row's deferred tokens prepended (and forgotten), or None when none are."""
        if not self.deferred:
            return None
        qsl, positions = batch.query_start_loc_np, batch.positions.cpu()
        pieces = []
        for i, row in enumerate(plan.rows):
            entry = self.deferred.pop(row.request_id, None)
            pieces.append(entry.before(int(positions[qsl[i]])) if entry is not None else None)
        if all(p is None for p in pieces):
            return None
        ids, pos, states, slots, counts = [], [], [], [], np.zeros(len(plan.rows), dtype=np.int64)
        device = batch.input_ids.device
        for i, piece in enumerate(pieces):
            a, b = int(qsl[i]), int(qsl[i + 1])
            if piece is not None:
                p = torch.arange(piece.start, piece.end, device=device)
                ids.append(torch.tensor(piece.ids, dtype=shifted.dtype, device=device))
                pos.append(p)
                states += piece.hidden
                slots.append(batch.block_table[i].long()[p // self.block_size] * self.block_size
                             + p % self.block_size)
                counts[i] = piece.num_tokens
            ids.append(shifted[a:b])
            pos.append(batch.positions[a:b])
            states.append(hidden[a:b])
            slots.append(batch.slot_mapping[a:b])
        real = int(qsl[-1])  # graph padding stays at the end, in no row
        ids.append(shifted[real:])
        pos.append(batch.positions[real:])
        states.append(hidden[real:])
        slots.append(batch.slot_mapping[real:])
        offsets = np.cumsum(counts)
        extended = InputBatch(torch.cat(ids), torch.cat(pos), (batch.query_start_loc_np
                                                                 + np.concatenate(([0], offsets))).astype(np.int32),
                              batch.seq_lens_cpu, batch.block_table, torch.cat(slots), batch.is_prefill_cpu,
                              batch.sample_rows, batch.num_draft_tokens, batch.logits_indices,
                              batch.draft_token_ids, batch.sampling, batch.num_padding)
        return RowExtension(extended.input_ids, extended.positions, torch.cat(states),
                            global_attention_metadata(extended, self.block_size), offsets)


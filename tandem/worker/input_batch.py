"""The GLOBAL input batch every rank builds identically from a StepPlan.

Worked example, block_size 4, plan rows = [A: decode at position 9, B: prompt chunk of 3 tokens
starting at position 4 (tokens 4, 5, 6), reaching the prompt's end]:
    input_ids        [a9, b4, b5, b6]
    positions        [9, 4, 5, 6]
    query_start_loc  [0, 1, 4]
    seq_lens         [10, 7]                  (keys visible after this step)
    slot_mapping     [A.blocks[2]*4+1, B.blocks[1]*4+0, +1, +2]
    logits_indices   [0, 3]                   (last token of each sampling row)
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from tandem.attention.metadata import PAD_SLOT_ID, AttentionMetadata, build_attention_metadata
from tandem.engine.step_plan import StepPlan
from tandem.layers.sampler import SamplingMetadata


@dataclass
class InputBatch:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    query_start_loc_cpu: torch.Tensor  # [R + 1] int32
    seq_lens_cpu: torch.Tensor  # [R] int32
    block_table: torch.Tensor  # [R, max_blocks] int32
    slot_mapping: torch.Tensor  # [T] int64
    is_prefill_cpu: torch.Tensor  # [R] bool
    # Sampling rows: a prompt chunk reaching the prompt's end, or a decode row [last, d_1 .. d_K]
    # whose K + 1 logits verify the K drafts.
    sample_rows: list[int]  # [S] index of each sampling row among the batch rows
    num_draft_tokens: list[int]  # [S] K_i
    logits_indices: torch.Tensor  # [sum_i (K_i + 1)] int64 token rows whose logits are computed
    draft_token_ids: torch.Tensor  # [sum_i K_i] int64
    sampling: SamplingMetadata | None  # per sampling row; positions = position of its first sampled token
    # PIECEWISE padding: tokens [num_real, T) belong to no row (id 0, position 0, PAD_SLOT_ID: no KV write,
    # no logits); their hidden states are zeroed after the target runs.
    num_padding: int = 0

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]

    @property
    def is_padding(self) -> torch.Tensor:  # [T] bool, the global padding mask
        mask = torch.zeros(self.num_tokens, dtype=torch.bool, device=self.input_ids.device)
        mask[self.num_tokens - self.num_padding:] = True
        return mask


def prepare_inputs(plan: StepPlan, block_size: int, device: str, padded_size: int | None = None) -> InputBatch:
    """`padded_size`: the capture size to pad the step's tokens to (PIECEWISE), or None."""
    rows = plan.rows
    q_lens = np.array([len(r.token_ids) for r in rows], dtype=np.int64)
    starts = np.array([r.num_computed_tokens for r in rows], dtype=np.int64)
    qsl = np.zeros(len(rows) + 1, dtype=np.int32)
    np.cumsum(q_lens, out=qsl[1:])
    positions = np.concatenate([np.arange(s, s + n) for s, n in zip(starts, q_lens, strict=True)])
    max_blocks = max(len(r.block_ids) for r in rows)
    block_table = np.zeros((len(rows), max_blocks), dtype=np.int32)
    for i, r in enumerate(rows):
        block_table[i, : len(r.block_ids)] = r.block_ids
    row_of_token = np.repeat(np.arange(len(rows)), q_lens)
    slots = block_table[row_of_token, positions // block_size].astype(np.int64) * block_size + positions % block_size
    input_ids = np.fromiter((t for r in rows for t in r.token_ids), dtype=np.int64, count=int(q_lens.sum()))
    sample_rows = [i for i, r in enumerate(rows) if r.sampling is not None]
    num_drafts = [rows[i].num_draft_tokens for i in sample_rows]
    ends = qsl[1:][sample_rows].astype(np.int64)
    logits_indices = np.concatenate([np.arange(e - k - 1, e) for e, k in zip(ends, num_drafts, strict=True)]
                                    or [np.zeros(0, dtype=np.int64)])
    draft_ids = [t for i in sample_rows for t in rows[i].token_ids[len(rows[i].token_ids) - rows[i].num_draft_tokens:]]

    num_padding = max(0, (padded_size or 0) - len(input_ids))
    if num_padding:
        input_ids = np.concatenate([input_ids, np.zeros(num_padding, dtype=np.int64)])
        positions = np.concatenate([positions, np.zeros(num_padding, dtype=np.int64)])
        slots = np.concatenate([slots, np.full(num_padding, PAD_SLOT_ID, dtype=np.int64)])

    def t(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(a).to(device)

    return InputBatch(
        input_ids=t(input_ids), positions=t(positions), query_start_loc_cpu=torch.from_numpy(qsl),
        seq_lens_cpu=torch.from_numpy((starts + q_lens).astype(np.int32)), block_table=t(block_table),
        slot_mapping=t(slots), is_prefill_cpu=torch.tensor([r.is_prefill for r in rows], dtype=torch.bool),
        sample_rows=sample_rows, num_draft_tokens=num_drafts, logits_indices=t(logits_indices),
        draft_token_ids=torch.tensor(draft_ids, dtype=torch.int64, device=device),
        sampling=_sampling_metadata(plan, sample_rows, starts + q_lens - np.array(
            [r.num_draft_tokens for r in rows], dtype=np.int64), device),
        num_padding=num_padding)


def _sampling_metadata(plan: StepPlan, sample_rows: list[int], first_sampled: np.ndarray,
                       device: str) -> SamplingMetadata | None:
    if not sample_rows:
        return None
    specs = [s for i in sample_rows if (s := plan.rows[i].sampling) is not None]
    temps = [s.temperature if s.temperature >= 1e-5 else 0.0 for s in specs]
    logprobs = [s.num_logprobs for s in specs if s.num_logprobs is not None]
    return SamplingMetadata(
        temperature=torch.tensor(temps, dtype=torch.float32, device=device),
        top_k=torch.tensor([s.top_k for s in specs], dtype=torch.int64, device=device),
        top_p=torch.tensor([s.top_p for s in specs], dtype=torch.float32, device=device),
        min_p=torch.tensor([s.min_p for s in specs], dtype=torch.float32, device=device),
        seeds=torch.tensor([s.seed for s in specs], dtype=torch.int64, device=device),
        positions=torch.from_numpy(first_sampled[sample_rows].astype(np.int64)).to(device),
        max_num_logprobs=max(logprobs) if logprobs else None,
        all_greedy=all(t == 0.0 for t in temps))


def padding_batch(size: int, device: str) -> InputBatch:
    """A batch of `size` padding tokens and no rows: what warmup runs at each capture size."""
    def zeros(*shape: int, dtype: torch.dtype = torch.int64) -> torch.Tensor:
        return torch.zeros(shape, dtype=dtype, device=device)

    return InputBatch(
        input_ids=zeros(size), positions=zeros(size), query_start_loc_cpu=torch.zeros(1, dtype=torch.int32),
        seq_lens_cpu=torch.zeros(0, dtype=torch.int32), block_table=zeros(0, 1, dtype=torch.int32),
        slot_mapping=torch.full((size,), PAD_SLOT_ID, dtype=torch.int64, device=device),
        is_prefill_cpu=torch.zeros(0, dtype=torch.bool), sample_rows=[], num_draft_tokens=[],
        logits_indices=zeros(0), draft_token_ids=zeros(0), sampling=None, num_padding=size)


def global_attention_metadata(batch: InputBatch, block_size: int) -> AttentionMetadata:
    """Attention metadata of the whole global batch: every row, every valid slot written once."""
    writes = batch.slot_mapping >= 0
    return build_attention_metadata(batch.positions, batch.query_start_loc_cpu, batch.seq_lens_cpu,
                                    batch.block_table, block_size, writes.nonzero().squeeze(1),
                                    batch.slot_mapping[writes])

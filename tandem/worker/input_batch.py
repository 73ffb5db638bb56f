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

from tandem.attention.batch import PAD_SLOT_ID, AttentionBatch
from tandem.layers.sampler import SamplingMetadata
from tandem.step_plan import StepPlan


@dataclass
class InputBatch:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    query_start_loc_np: np.ndarray  # [R + 1] int32
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
    def query_start_loc_cpu(self) -> torch.Tensor:  # [R + 1] int32, sharing query_start_loc_np's memory
        return torch.from_numpy(self.query_start_loc_np)

    @property
    def is_padding(self) -> torch.Tensor:  # [T] bool, the global padding mask
        mask = torch.zeros(self.num_tokens, dtype=torch.bool, device=self.input_ids.device)
        mask[self.num_tokens - self.num_padding:] = True
        return mask


class InputBuffers:
    """Persistent host buffers the step's token-level inputs are written into (and, off the CPU, device buffers
    they are copied to in one transfer each): no per-step allocation of ids, positions or slots, and the
    compiled model (CUDA graphs above all) always reads its inputs from the same storage."""

    @torch.inference_mode()  # inference tensors, as every other step input: the compiled model's guards agree
    def __init__(self, max_num_tokens: int, device: str):
        self.max_num_tokens = max_num_tokens
        self.device = device
        self.input_ids_np = np.zeros(max_num_tokens, dtype=np.int64)
        self.positions_np = np.zeros(max_num_tokens, dtype=np.int64)
        self.slots_np = np.zeros(max_num_tokens, dtype=np.int64)
        on_cpu = torch.device(device).type == "cpu"
        self.input_ids = torch.from_numpy(self.input_ids_np) if on_cpu else torch.zeros_like(
            torch.from_numpy(self.input_ids_np), device=device)
        self.positions = torch.from_numpy(self.positions_np) if on_cpu else torch.zeros_like(self.input_ids)
        self.slot_mapping = torch.from_numpy(self.slots_np) if on_cpu else torch.zeros_like(self.input_ids)
        self.on_cpu = on_cpu

    def upload(self, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The first num_tokens of ids, positions and slots as device tensors (views of the persistent ones)."""
        if not self.on_cpu:
            for host, dev in ((self.input_ids_np, self.input_ids), (self.positions_np, self.positions),
                              (self.slots_np, self.slot_mapping)):
                dev[:num_tokens].copy_(torch.from_numpy(host[:num_tokens]), non_blocking=True)
        return self.input_ids[:num_tokens], self.positions[:num_tokens], self.slot_mapping[:num_tokens]


def prepare_inputs(plan: StepPlan, block_size: int, device: str, padded_size: int | None = None,
                   buffers: InputBuffers | None = None) -> InputBatch:
    """`padded_size`: the capture size to pad the step's tokens to (PIECEWISE), or None. `buffers`: the
    runner's persistent buffers (a batch made without them gets its own)."""
    rows = plan.rows
    num_rows = len(rows)
    q_lens = np.fromiter((len(r.token_ids) for r in rows), dtype=np.int64, count=num_rows)
    starts = np.fromiter((r.num_computed_tokens for r in rows), dtype=np.int64, count=num_rows)
    qsl = np.zeros(num_rows + 1, dtype=np.int32)
    np.cumsum(q_lens, out=qsl[1:])
    num_real = int(qsl[-1])
    num_tokens = max(num_real, padded_size or 0)
    if buffers is None or num_tokens > buffers.max_num_tokens:
        buffers = InputBuffers(num_tokens, device)
    row_of_token = np.repeat(np.arange(num_rows), q_lens)  # [T_real]
    positions = buffers.positions_np[:num_tokens]
    np.add(starts[row_of_token], np.arange(num_real) - qsl[:-1][row_of_token], out=positions[:num_real])
    max_blocks = max(len(r.block_ids) for r in rows)
    block_table = np.zeros((num_rows, max_blocks), dtype=np.int32)
    for i, r in enumerate(rows):
        block_table[i, : len(r.block_ids)] = r.block_ids
    real_pos = positions[:num_real]
    slots = buffers.slots_np[:num_tokens]
    slots[:num_real] = block_table[row_of_token, real_pos // block_size].astype(np.int64) * block_size \
        + real_pos % block_size
    ids = buffers.input_ids_np[:num_tokens]
    ids[:num_real] = np.fromiter((t for r in rows for t in r.token_ids), dtype=np.int64, count=num_real)
    # padding: id 0, position 0, no KV write
    ids[num_real:], positions[num_real:], slots[num_real:] = 0, 0, PAD_SLOT_ID
    sample_rows = [i for i, r in enumerate(rows) if r.sampling is not None]
    num_drafts = [rows[i].num_draft_tokens for i in sample_rows]
    ends = qsl[1:][sample_rows].astype(np.int64)
    logits_indices = np.concatenate([np.arange(e - k - 1, e) for e, k in zip(ends, num_drafts, strict=True)]
                                    or [np.zeros(0, dtype=np.int64)])
    draft_ids = [t for i in sample_rows for t in rows[i].token_ids[len(rows[i].token_ids) - rows[i].num_draft_tokens:]]
    input_ids, positions_t, slot_mapping = buffers.upload(num_tokens)

    def t(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(a).to(device)

    return InputBatch(
        input_ids=input_ids, positions=positions_t, query_start_loc_np=qsl,
        seq_lens_cpu=torch.from_numpy((starts + q_lens).astype(np.int32)), block_table=t(block_table),
        slot_mapping=slot_mapping, is_prefill_cpu=torch.tensor([r.is_prefill for r in rows], dtype=torch.bool),
        sample_rows=sample_rows, num_draft_tokens=num_drafts, logits_indices=t(logits_indices),
        draft_token_ids=torch.tensor(draft_ids, dtype=torch.int64, device=device),
        sampling=_sampling_metadata(plan, sample_rows, starts + q_lens - np.array(
            [r.num_draft_tokens for r in rows], dtype=np.int64), device),
        num_padding=num_tokens - num_real)


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
        input_ids=zeros(size), positions=zeros(size), query_start_loc_np=np.zeros(1, dtype=np.int32),
        seq_lens_cpu=torch.zeros(0, dtype=torch.int32), block_table=zeros(0, 1, dtype=torch.int32),
        slot_mapping=torch.full((size,), PAD_SLOT_ID, dtype=torch.int64, device=device),
        is_prefill_cpu=torch.zeros(0, dtype=torch.bool), sample_rows=[], num_draft_tokens=[],
        logits_indices=zeros(0), draft_token_ids=zeros(0), sampling=None, num_padding=size)


def global_attention_metadata(batch: InputBatch, block_size: int) -> AttentionBatch:
    """The attention batch of the whole global batch: every row, every valid slot written once."""
    writes = batch.slot_mapping >= 0
    return AttentionBatch(positions=batch.positions, query_start_loc_cpu=batch.query_start_loc_cpu,
                          seq_lens_cpu=batch.seq_lens_cpu, block_table=batch.block_table, block_size=block_size,
                          write_rows=writes.nonzero().squeeze(1), write_slots=batch.slot_mapping[writes])

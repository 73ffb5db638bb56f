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
    logits_indices: torch.Tensor  # [S] int64, rows whose next token is sampled
    sampling: SamplingMetadata | None

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]


def prepare_inputs(plan: StepPlan, block_size: int, device: str) -> InputBatch:
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
    logits_indices = qsl[1:][sample_rows].astype(np.int64) - 1

    def t(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(a).to(device)

    return InputBatch(
        input_ids=t(input_ids), positions=t(positions), query_start_loc_cpu=torch.from_numpy(qsl),
        seq_lens_cpu=torch.from_numpy((starts + q_lens).astype(np.int32)), block_table=t(block_table),
        slot_mapping=t(slots), is_prefill_cpu=torch.tensor([r.is_prefill for r in rows], dtype=torch.bool),
        logits_indices=t(logits_indices),
        sampling=_sampling_metadata(plan, sample_rows, starts + q_lens, device))


def _sampling_metadata(plan: StepPlan, sample_rows: list[int], seq_lens: np.ndarray,
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
        positions=torch.from_numpy(seq_lens[sample_rows].astype(np.int64)).to(device),
        max_num_logprobs=max(logprobs) if logprobs else None,
        all_greedy=all(t == 0.0 for t in temps))

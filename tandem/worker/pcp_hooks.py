"""The model runner's PCP hooks: partition the global batch into this rank's view, gather prefill K/V
over the PCP group before the cache write, and restore hidden states to global order.

At PCP size 1 the partition is the identity and the gather/restore are no-ops, so the runner calls
the same three hooks either way.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem.attention.metadata import AttentionMetadata, build_attention_metadata
from tandem.distributed.groups import Group
from tandem.worker.input_batch import InputBatch, global_attention_metadata
from tandem.worker.pcp import (
    PCPPartition,
    local_metadata,
    pad_local,
    partition,
    restore,
    restore_rows,
    row_gather,
    select_rows,
)


@dataclass
class LocalBatch:
    input_ids: torch.Tensor  # [T_r] int64
    positions: torch.Tensor  # [T_r] int64
    token_idx: torch.Tensor | None  # [T_r] int64 global index of each local token; None at PCP size 1
    attn_metadata: AttentionMetadata
    part: PCPPartition | None  # None at PCP size 1


class PCPHooks:
    def __init__(self, pcp: Group, block_size: int):
        self.pcp = pcp
        self.block_size = block_size
        self.part: PCPPartition | None = None

    def maybe_partition(self, batch: InputBatch) -> LocalBatch:
        if self.pcp.size == 1:
            self.part = None
            meta = global_attention_metadata(batch, self.block_size)
            return LocalBatch(batch.input_ids, batch.positions, None, meta, None)
        real_slots = batch.slot_mapping[: batch.num_tokens - batch.num_padding]  # padding never writes
        writes = real_slots >= 0
        # graph padding belongs to no rank's segments; restore() gives it zero rows
        part = partition(batch.query_start_loc_cpu.numpy(), batch.is_prefill_cpu.numpy(), self.pcp.size,
                         batch.num_padding)
        view = local_metadata(part, self.pcp.rank, batch.positions.cpu().numpy(), batch.block_table.cpu().numpy())
        device = batch.input_ids.device
        token_idx = torch.from_numpy(view.token_idx).to(device)
        # K/V are written from the gathered [P * max_local] tensor: each global token once, from the copy
        # that kv_write_idx names (prefill tokens from their owner rank, decode tokens from rank 0).
        write_rows = torch.from_numpy(part.kv_write_idx).to(device)[writes]
        meta = build_attention_metadata(
            torch.from_numpy(view.positions).to(device), torch.from_numpy(view.query_start_loc),
            torch.from_numpy(view.seq_lens), torch.from_numpy(view.block_table).to(device), self.block_size,
            write_rows, real_slots[writes])
        self.part = part
        return LocalBatch(batch.input_ids[token_idx], meta.positions, token_idx, meta, part)

    def gather_kv(self, x: torch.Tensor) -> torch.Tensor:
        """[T_r, ...] this rank's new K/V -> [P * max_local, ...] every rank's (identity at PCP size 1)."""
        if self.part is None:
            return x
        return self.pcp.all_gather(pad_local(x, self.part))

    def maybe_restore(self, hidden: torch.Tensor) -> torch.Tensor:
        """[T_r, H] local hidden states -> [T_global, H] in global order."""
        if self.part is None:
            return hidden
        return restore(self.pcp.all_gather(pad_local(hidden, self.part)), self.part)

    def maybe_restore_rows(self, hidden: torch.Tensor, rows: torch.Tensor | list[int]) -> torch.Tensor:
        """[T_r, H] local hidden states -> [len(rows), H], the given global rows only: the all-gather moves
        P * max-rows-per-rank rows instead of P * T_r (logits need one row per sampled token, not the prompt)."""
        if self.part is None:
            return hidden[rows]
        plan = row_gather(self.part, torch.as_tensor(rows).cpu().numpy())
        if plan.max_rows == 0:  # no rows, or padding rows only: every rank knows it, so none all-gathers
            return hidden.new_zeros((len(plan.out_idx), *hidden.shape[1:]))
        return restore_rows(self.pcp.all_gather(select_rows(hidden, plan, self.pcp.rank)), plan)


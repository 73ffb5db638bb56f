"""The model runner's PCP hooks: partition the global batch into this rank's view, gather prefill K/V
over the PCP group before the cache write, and restore hidden states to global order.

Two implementations of one interface, chosen once by `make_pcp_hooks`: at PCP size 1 (`PCPHooks` itself) the
partition is the identity and the gather/restore are no-ops, so the runner calls the same hooks either way and
never asks which layout it runs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from tandem.attention.batch import AttentionBatch, KVShard
from tandem.attention.sharded_kv import ShardedKVExchange, merge_partials
from tandem.distributed.groups import Group
from tandem.worker.input_batch import InputBatch, global_attention_metadata
from tandem.worker.pcp import (
    LocalView,
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
    attn_metadata: AttentionBatch  # what each attention backend builds its own metadata from


class PCPHooks:
    """The interface, and its PCP size 1 implementation: the rank's view is the global batch."""

    kv_sharded = False  # pcp_kv_layout sharded: each token's K/V on one rank (ShardedKVPCPHooks)

    def __init__(self, pcp: Group, block_size: int):
        self.pcp, self.block_size = pcp, block_size
        self.bytes_gathered = 0  # bytes this rank received from PCP collectives so far (tandem:pcp_gathered_bytes)

    def maybe_partition(self, batch: InputBatch) -> LocalBatch:
        return LocalBatch(batch.input_ids, batch.positions, global_attention_metadata(batch, self.block_size))

    def global_metadata(self, batch: InputBatch, local: LocalBatch) -> AttentionBatch:
        """The whole global batch for attention (a replicated drafter's step 0). At PCP size 1 it is the rank's
        own, whose metadata the target's backend built already: no second build a step."""
        return local.attn_metadata

    def localize(self, x: torch.Tensor) -> torch.Tensor:
        """[T_global, ...] -> [T_r, ...] this rank's tokens, in local order."""
        return x

    def mask_padding(self, hidden: torch.Tensor, batch: InputBatch) -> torch.Tensor:
        """Zero the graph-padding rows of the target's [T_r, H] output (they ran with the batch here)."""
        return hidden.masked_fill(batch.is_padding[:, None], 0) if batch.num_padding else hidden

    def gather_kv(self, x: torch.Tensor) -> torch.Tensor:
        """[T_r, ...] this rank's new K/V -> every rank's, in the layout attn_metadata.write_rows index."""
        return x

    def kv_gather(self) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """What forward_context's gather_kv takes: gather_kv, or None where it is the identity (one rank), so the
        attention layers hand their K/V to the backend as they lie instead of packing them for a gather."""
        return None

    def kv_shard(self) -> KVShard | None:
        """Sharded KV: this rank's place among the KV owners (an attention batch of global rows carries it)."""
        return None

    def kv_exchange(self, replicated_rows: bool = False) -> ShardedKVExchange | None:
        """What forward_context's kv_exchange takes under sharded KV, else None: for this step's partition, or
        (`replicated_rows`) for rows that every rank holds in global order (MTP's draft decodes)."""
        return None

    def maybe_restore(self, hidden: torch.Tensor) -> torch.Tensor:
        """[T_r, H] local hidden states -> [T_global(+padding), H] in global order."""
        return hidden

    def num_gathered_rows(self) -> int:
        """Rows that one all-gather of this step's local rows (gather_kv, maybe_restore) hands every rank."""
        return 0

    def maybe_restore_rows(self, hidden: torch.Tensor, rows: torch.Tensor | list[int]) -> torch.Tensor:
        """[T_r, H] local hidden states -> [len(rows), H], the given global rows only."""
        return hidden[rows]


class PartitionedPCPHooks(PCPHooks):
    """PCP size > 1 (worker/pcp.py's index math plus the collectives over the PCP group), the replicated KV layout.

    `split_prompt_keys`: a step with prompt rows attends as under sharded KV (the queries travel: every query of the
    step over the keys of every P-th block of its row, the P partials merged by LSE), reading the replicated cache;
    decode-only steps attend locally. For backends whose prompt chunks do work per key they read (MLA expands each
    latent into per-head keys and values): with each rank's queries over all the keys, every rank repeated that work
    for the whole context (attention/backend.py's `splits_prompt_keys`)."""

    def __init__(self, pcp: Group, block_size: int, split_prompt_keys: bool = False):
        super().__init__(pcp, block_size)
        self.part: PCPPartition | None = None  # this step's partition
        self.token_idx = torch.empty(0, dtype=torch.int64)  # [T_r] global index of each local token
        self.split_prompt_keys = split_prompt_keys
        # this step's attention runs over split keys (sharded KV, or a prompt step with split_prompt_keys): the
        # all-to-all of partials sends global rows each rank holds, concatenated in rank order, in these counts
        self.exchanges = False
        self.send_idx = torch.empty(0, dtype=torch.int64)
        self.send_counts: list[int] = []
        self.gathers_queries = False  # this step has prompt rows, split over the ranks: queries are all-gathered

    def _partition(self, batch: InputBatch) -> tuple[PCPPartition, LocalView, torch.Tensor]:
        """This step's partition and this rank's view of it (kept for the step's gathers), and the slots of the
        real tokens (padding never writes)."""
        # graph padding belongs to no rank's segments; restore() gives it zero rows
        part = partition(batch.query_start_loc_np, batch.is_prefill_cpu.numpy(), self.pcp.size, batch.num_padding)
        view = local_metadata(part, self.pcp.rank, batch.positions.cpu().numpy(), batch.block_table.cpu().numpy())
        self.part = part
        self.token_idx = torch.from_numpy(view.token_idx).to(batch.input_ids.device)
        return part, view, batch.slot_mapping[: batch.num_tokens - batch.num_padding]

    def global_metadata(self, batch: InputBatch, local: LocalBatch) -> AttentionBatch:
        return global_attention_metadata(batch, self.block_size)

    def maybe_partition(self, batch: InputBatch) -> LocalBatch:
        part, view, real_slots = self._partition(batch)
        self.exchanges = self.split_prompt_keys and splits_keys(batch)
        if self.exchanges:
            return self._global_rows(batch, part, view, real_slots, KVShard(self.pcp.rank, self.pcp.size, True))
        writes = real_slots >= 0
        device = batch.input_ids.device
        # K/V are written from the gathered [P * max_local] tensor: each global token once, from the copy
        # that kv_write_idx names (prefill tokens from their owner rank, decode tokens from rank 0).
        write_rows = torch.from_numpy(part.kv_write_idx).to(device)[writes]
        meta = AttentionBatch(
            positions=torch.from_numpy(view.positions).to(device),
            query_start_loc_cpu=torch.from_numpy(view.query_start_loc), seq_lens_cpu=torch.from_numpy(view.seq_lens),
            block_table=torch.from_numpy(view.block_table).to(device), block_size=self.block_size,
            write_rows=write_rows, write_slots=real_slots[writes])
        return LocalBatch(batch.input_ids[self.token_idx], meta.positions, meta)

    def _global_rows(self, batch: InputBatch, part: PCPPartition, view: LocalView, real_slots: torch.Tensor,
                     shard: KVShard) -> LocalBatch:
        """The rank's tokens, attending as every global row over the keys `shard` gives this rank."""
        writes = real_slots >= 0
        device = batch.input_ids.device
        self.send_idx = torch.from_numpy(np.concatenate(part.local_token_idx)).to(device)
        self.send_counts = [len(idx) for idx in part.local_token_idx]
        # decodes only: every rank holds every token in global order already, so the queries need no gather
        self.gathers_queries = bool(batch.is_prefill_cpu.any())
        # every global row, written from the gathered K/V (kv_write_idx); each backend keeps the rows and writes
        # (all of them into a replicated cache, its own blocks' into a sharded one)
        meta = AttentionBatch(positions=batch.positions, query_start_loc_cpu=batch.query_start_loc_cpu,
                              seq_lens_cpu=batch.seq_lens_cpu, block_table=batch.block_table,
                              block_size=self.block_size,
                              write_rows=torch.from_numpy(part.kv_write_idx).to(device)[writes],
                              write_slots=real_slots[writes], kv_shard=shard)
        return LocalBatch(batch.input_ids[self.token_idx], torch.from_numpy(view.positions).to(device), meta)

    def kv_exchange(self, replicated_rows: bool = False) -> ShardedKVExchange | None:
        if not self.exchanges:
            return None
        if replicated_rows:  # rows on every rank: no query gather, every row merged; over a replicated cache local
            return ShardedKVExchange(_identity, self._merge_all) if self.kv_sharded else None
        return ShardedKVExchange(self._gather_queries if self.gathers_queries else self._pad_queries,
                                 self._merge_local)

    def _gather_queries(self, q: torch.Tensor) -> torch.Tensor:
        assert self.part is not None
        return restore(self.all_gather(pad_local(q, self.part)), self.part)  # [T_global(+padding), ...]

    def _pad_queries(self, q: torch.Tensor) -> torch.Tensor:
        assert self.part is not None
        num_pad = self.part.num_tokens + self.part.num_padding - q.shape[0]
        return torch.cat((q, q.new_zeros(num_pad, *q.shape[1:]))) if num_pad else q

    def _merge_local(self, out: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
        """Each rank sends every other rank the partials of that rank's own tokens only (one all-to-all), and
        merges the P partials of its tokens: [T_r, H, Dv]."""
        packed = torch.cat((out.float(), lse[..., None]), dim=-1)[self.send_idx]  # [sum T_r, H, Dv + 1]
        mine = self.send_counts[self.pcp.rank]
        recv = self.pcp.all_to_all(packed, self.send_counts, [mine] * self.pcp.size)
        self.bytes_gathered += recv.numel() * recv.element_size()
        recv = recv.view(self.pcp.size, mine, *packed.shape[1:])
        return merge_partials(recv[..., :-1], recv[..., -1])

    def _merge_all(self, out: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
        """Rows on every rank (MTP's draft decodes): one all-gather of [T, H, Dv + 1] float32, every row merged."""
        packed = self.all_gather(torch.cat((out.float(), lse[..., None]), dim=-1))
        packed = packed.view(self.pcp.size, *out.shape[:-1], out.shape[-1] + 1)
        return merge_partials(packed[..., :-1], packed[..., -1])

    def localize(self, x: torch.Tensor) -> torch.Tensor:
        return x[self.token_idx]

    def mask_padding(self, hidden: torch.Tensor, batch: InputBatch) -> torch.Tensor:
        return hidden  # padding is on no rank's segments

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        self.bytes_gathered += x.numel() * x.element_size() * self.pcp.size
        return self.pcp.all_gather(x)

    def gather_kv(self, x: torch.Tensor) -> torch.Tensor:
        assert self.part is not None
        return self.all_gather(pad_local(x, self.part))

    def kv_gather(self) -> Callable[[torch.Tensor], torch.Tensor] | None:
        return self.gather_kv

    def maybe_restore(self, hidden: torch.Tensor) -> torch.Tensor:
        assert self.part is not None
        return restore(self.all_gather(pad_local(hidden, self.part)), self.part)

    def num_gathered_rows(self) -> int:
        assert self.part is not None
        return self.pcp.size * self.part.max_local_tokens

    def maybe_restore_rows(self, hidden: torch.Tensor, rows: torch.Tensor | list[int]) -> torch.Tensor:
        # the all-gather moves P * max-rows-per-rank rows instead of P * T_r (logits need one row per sampled
        # token, not the prompt)
        assert self.part is not None
        plan = row_gather(self.part, torch.as_tensor(rows).cpu().numpy())
        if plan.max_rows == 0:  # no rows, or padding rows only: every rank knows it, so none all-gathers
            return hidden.new_zeros((len(plan.out_idx), *hidden.shape[1:]))
        return restore_rows(self.all_gather(select_rows(hidden, plan, self.pcp.rank)), plan)


class ShardedKVPCPHooks(PartitionedPCPHooks):
    """PCP size > 1 with pcp_kv_layout sharded: the same query partition, but a token's K/V is written only on
    the rank that owns its block (attention/kv_ownership.py), and attention runs every query of the step over each
    rank's own keys, merging the partials by LSE (attention/sharded_kv.py)."""

    kv_sharded = True

    def maybe_partition(self, batch: InputBatch) -> LocalBatch:
        part, view, real_slots = self._partition(batch)
        self.exchanges = True
        return self._global_rows(batch, part, view, real_slots, self.kv_shard())

    def kv_shard(self) -> KVShard:
        return KVShard(self.pcp.rank, self.pcp.size)


# a prompt step splits its keys when its prompt rows see at least this many keys per query: the keys before a chunk
# (its prefix) are what every rank would otherwise expand again; 32 GSM8K prompts of ~100 tokens (no prefix) on the
# bundled model read 613 output tok/s split against 660 unsplit (the queries' gather and the partials' all-to-all over
# gloo cost more than expanding a chunk's own keys twice)
SPLIT_KEYS_PER_QUERY = 2.0


def splits_keys(batch: InputBatch) -> bool:
    """Whether a replicated PCP step attends over split keys (PartitionedPCPHooks' split_prompt_keys): it has prompt
    rows, and they see SPLIT_KEYS_PER_QUERY keys per query or more. The global batch decides, so every rank agrees."""
    prefill = batch.is_prefill_cpu.numpy()
    if not prefill.any():
        return False
    queries = np.diff(batch.query_start_loc_np)[prefill].sum()
    return int(batch.seq_lens_cpu.numpy()[prefill].sum()) >= SPLIT_KEYS_PER_QUERY * int(queries)


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


def make_pcp_hooks(pcp: Group, block_size: int, kv_layout: str = "replicated",
                   split_prompt_keys: bool = False) -> PCPHooks:
    """`split_prompt_keys` (replicated layout): prompt steps attend over split keys (PartitionedPCPHooks)."""
    if pcp.size == 1:
        return PCPHooks(pcp, block_size)  # one rank owns every block: the layouts coincide
    if kv_layout == "sharded":
        return ShardedKVPCPHooks(pcp, block_size)
    return PartitionedPCPHooks(pcp, block_size, split_prompt_keys)

"""The step's batch as attention sees it: the one input every backend builds its own metadata from.

A "row" is one query segment: a request's new tokens in this step (or, under PCP, one rank-local piece of them).
Row i owns query tokens [query_start_loc[i], query_start_loc[i+1]) whose absolute positions are `positions[...]`,
and may attend to cached keys at positions [0, seq_lens[i]) read through `block_table[i]`. Causality is decided
from positions, never from row offsets, so a row that starts mid-prompt (chunked prefill, a PCP segment) needs
nothing special. What a backend plans from this (padded groups, in-place key runs, native-kernel rows, cu_seqlens)
is its own business (`AttentionBackend.prepare_metadata`), built once per batch and backend (`metadata_for`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from tandem.attention.backend import AttentionBackend

PAD_SLOT_ID = -1  # slot_mapping value meaning "write nothing"


@dataclass(frozen=True)
class KVShard:
    """pcp_kv_layout sharded: this rank is `rank` of `size`, and holds only the K/V of the blocks it owns
    (tandem/attention/kv_ownership.py); the batch's rows and write slots are then global. `replicated`: the cache
    holds every block (the replicated layout's prompt steps that split their keys, worker/pcp_hooks.py): the rank
    writes every key and attends over every size-th block of each row, starting at its rank."""

    rank: int
    size: int
    replicated: bool = False


@dataclass(kw_only=True)
class AttentionBatch:
    positions: torch.Tensor  # [num_tokens] int64
    query_start_loc_cpu: torch.Tensor  # [num_rows + 1] int32
    seq_lens_cpu: torch.Tensor  # [num_rows] int32, keys visible to each row after this step's write
    block_table: torch.Tensor  # [num_rows, max_num_blocks] int32
    block_size: int
    # `write_rows` index the K/V tensor the attention layer hands the backend: this step's own rows, or under PCP the
    # all-gathered rows of every rank
    write_rows: torch.Tensor  # [num_writes] int64 rows of the (gathered) new K/V that are written
    write_slots: torch.Tensor  # [num_writes] int64 their cache slots (PAD_SLOT_ID rows are left out)
    # keys no row reads past (MTP's draft decodes: every decode of a proposal may share one key layout), or None
    key_bound: int | None = None
    # one-token decodes of the same rows as `base` (an earlier decode of the same proposal), each moved on by a
    # position: a backend may move base's metadata on instead of planning anew
    base: AttentionBatch | None = None
    kv_shard: KVShard | None = None  # sharded KV: the rows attend over the keys this rank owns
    prepared: dict[type[AttentionBackend], Any] = field(default_factory=dict, init=False, repr=False,
                                                              compare=False)

    def metadata_for(self, backend: type[AttentionBackend]) -> Any:
        """The backend's own metadata of this batch, built on first use: every layer of a step (and a drafter pass
        over the same batch) reads the same plan."""
        meta = self.prepared.get(backend)
        if meta is None:
            meta = self.prepared[backend] = backend.prepare_metadata(self)
        return meta

"""Per-step attention metadata shared by every layer, and the prefix-gather plan built from it.

A "row" is one query segment: a request's new tokens in this step (or, under PCP, one rank-local
piece of them). Row i owns query tokens [query_start_loc[i], query_start_loc[i+1]) whose absolute
positions are `positions[...]`, and may attend to cached keys at positions [0, seq_lens[i]) read
through `block_table[i]`. Causality is decided from positions, never from row offsets, so a row
that starts mid-prompt (chunked prefill, a PCP segment) needs nothing special.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

PAD_SLOT_ID = -1  # slot_mapping value meaning "write nothing"
SHORT_ROW_TOKENS = 16  # rows up to this many query tokens share one padded attention call
# A long row (a prompt chunk) is attended in blocks of this many queries, each against the keys up to its own
# last position only: one SDPA over the whole row would compute the masked upper triangle too (about twice the
# work of causal attention on CPU, where SDPA does not skip masked tiles).
QUERY_BLOCK = 256


@dataclass
class PrefixGroup:
    """Rows attended in one batched SDPA call, padded to a common query and key length."""

    token_idx: torch.Tensor  # [G, Q] int64 rows of q to gather (padding repeats a valid row)
    token_valid: torch.Tensor  # [G, Q] bool
    kv_slots: torch.Tensor  # [G, S] int64 flat cache slots of keys 0..S-1 (padding -> slot 0)
    mask: torch.Tensor  # [G, 1, Q, S] bool, True = may attend
    # the group is every row of the step in order, G rows of exactly Q (a batch of decodes or of equal
    # verification rows); see covers_all()
    dense: bool = False
    # ~mask, or None when every query may see every gathered key (one request's decode): computed once a step,
    # not once a layer
    blocked: torch.Tensor | None = None

    def with_mask(self, mask: torch.Tensor) -> PrefixGroup:
        return dataclasses.replace(self, mask=mask, blocked=~mask)

    def covers_all(self, num_tokens: int) -> bool:
        """The group is all `num_tokens` query tokens in order (none is graph padding): q.view(G, Q, ...) is its
        query block and its output is the whole output, with no gathers or scatters."""
        return self.dense and self.token_idx.numel() == num_tokens


@dataclass
class AttentionMetadata:
    positions: torch.Tensor  # [num_tokens] int64
    query_start_loc_cpu: torch.Tensor  # [num_rows + 1] int32
    seq_lens_cpu: torch.Tensor  # [num_rows] int32, keys visible to each row after this step's write
    block_table: torch.Tensor  # [num_rows, max_num_blocks] int32
    block_size: int
    groups: list[PrefixGroup]  # short rows together; long rows split into query blocks (QUERY_BLOCK)
    write_rows: torch.Tensor  # [num_writes] int64 rows of the (gathered) new K/V that are written
    write_slots: torch.Tensor  # [num_writes] int64 their cache slots (PAD_SLOT_ID rows are left out)


def build_attention_metadata(positions: torch.Tensor, query_start_loc_cpu: torch.Tensor,
                             seq_lens_cpu: torch.Tensor, block_table: torch.Tensor, block_size: int,
                             write_rows: torch.Tensor, write_slots: torch.Tensor,
                             key_bound: int | None = None) -> AttentionMetadata:
    """`write_rows` index the K/V tensor the attention layer hands the backend: this step's own rows, or
    under PCP the all-gathered rows of every rank. `key_bound`: gather the short rows' keys up to this many
    positions (instead of their current seq_lens), so the same slots serve later decodes of the same rows."""
    return AttentionMetadata(
        positions=positions, query_start_loc_cpu=query_start_loc_cpu, seq_lens_cpu=seq_lens_cpu,
        block_table=block_table, block_size=block_size,
        groups=_plan_groups(positions, query_start_loc_cpu, seq_lens_cpu, block_table, block_size, QUERY_BLOCK,
                            key_bound),
        write_rows=write_rows, write_slots=write_slots)


def row_groups(meta: AttentionMetadata) -> list[PrefixGroup]:
    """Groups whose long rows are whole (not query-blocked), for backends that take a row's new keys from the
    row itself and so need all of its new tokens in one call."""
    return _plan_groups(meta.positions, meta.query_start_loc_cpu, meta.seq_lens_cpu, meta.block_table,
                        meta.block_size, None)


def _plan_groups(positions: torch.Tensor, qsl: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor,
                 block_size: int, query_block: int | None, key_bound: int | None = None) -> list[PrefixGroup]:
    # Short rows (decodes, and verification rows of K + 1 tokens) are batched together, padded to the
    # longest of them; each longer row (a prompt chunk) gets its own groups, so a decode never pads up to
    # a chunk's length and a batch of verifications costs one SDPA call per layer, not one per row.
    # A piece is (row, first query offset in the row, number of queries).
    q_lens = (qsl[1:] - qsl[:-1]).tolist()
    short = [(i, 0, n) for i, n in enumerate(q_lens) if n <= SHORT_ROW_TOKENS]
    groups = [_group(short, positions, qsl, seq_lens, block_table, block_size, key_bound)] if short else []
    for i, n in enumerate(q_lens):
        if n > SHORT_ROW_TOKENS:
            step = query_block or n
            groups += [_group([(i, j, min(step, n - j))], positions, qsl, seq_lens, block_table, block_size)
                       for j in range(0, n, step)]
    return groups


def _group(pieces: list[tuple[int, int, int]], positions: torch.Tensor, qsl: torch.Tensor, seq_lens: torch.Tensor,
           block_table: torch.Tensor, block_size: int, key_bound: int | None = None) -> PrefixGroup:
    device = positions.device
    idx = torch.tensor([row for row, _, _ in pieces], dtype=torch.int64)
    starts = qsl[idx].long() + torch.tensor([off for _, off, _ in pieces], dtype=torch.int64)
    lens = torch.tensor([n for _, _, n in pieces], dtype=torch.int64)
    # Keys past a piece's last query position are never visible (causal), so they are not gathered.
    # A row's positions are consecutive and its last one is seq_len - 1, so a piece ending `tail` tokens before
    # the row's end sees seq_len - tail keys: computed on the CPU, no device read per step.
    tail = (qsl[idx + 1] - qsl[idx]).long() - torch.tensor([off + n for _, off, n in pieces], dtype=torch.int64)
    visible = seq_lens[idx].long() - tail  # [G]
    if key_bound is not None:
        visible = torch.full_like(visible, key_bound)
    q_max, s_max = int(lens.max()), int(visible.max())
    q_off = torch.arange(q_max)
    token_valid = q_off[None, :] < lens[:, None]  # [G, Q]
    token_idx = (starts[:, None] + torch.minimum(q_off[None, :], lens[:, None] - 1)).to(device)
    k_pos = torch.arange(s_max, device=device)  # [S]
    # a key bound may reach past the table's width: those keys are masked, any block id does
    blocks = block_table[idx.to(device)][:, (k_pos // block_size).clamp(max=block_table.shape[1] - 1)].long()
    k_valid = k_pos[None, :] < visible.to(device)[:, None]
    kv_slots = torch.where(k_valid, blocks * block_size + k_pos % block_size, 0)
    q_pos = positions[token_idx]  # [G, Q]
    mask = (k_pos[None, None, :] <= q_pos[:, :, None]) & k_valid[:, None, :]
    num_rows = len(pieces)
    dense = (bool((lens == q_max).all()) and num_rows * q_max == positions.shape[0]
             and bool((starts == torch.arange(num_rows) * q_max).all()))
    mask = mask.unsqueeze(1)
    # Nothing is masked only when every piece is one query that sees all s_max keys (rows of more queries are
    # causal inside; under a key bound the queries sit below it): decided on the CPU, no device read per step.
    nothing_masked = key_bound is None and q_max == 1 and bool((visible == s_max).all())
    return PrefixGroup(token_idx=token_idx, token_valid=token_valid.to(device), kv_slots=kv_slots, mask=mask,
                       dense=dense, blocked=None if nothing_masked else ~mask)


def gather_rows(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """x[idx] for a 2-D index: index_select copies whole rows, several times faster on CPU than advanced
    indexing, which matters because every layer gathers its keys through the block table."""
    return x.index_select(0, idx.flatten()).view(*idx.shape, *x.shape[1:])

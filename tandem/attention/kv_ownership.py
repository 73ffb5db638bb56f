"""Owner-sharded KV under PCP (`pcp_kv_layout: sharded`) as index math: which rank holds a token's K/V, and a
rank's attention rows over the keys it owns. No collectives here (they are in tandem/worker/pcp_hooks.py).

Ownership rule (pure): the paged cache is split in blocks of block_size tokens, and global block id b is local
block b // P of rank b % P. A token's K/V lives on the rank that holds its block, so owner(b) = b % P decides
every read and write, whoever allocated the block. The block manager gives a request's j-th block from rank
j % P's pool (tandem/engine/block_manager.py): a request's keys, and its decode appends, go round-robin over the
ranks, and a request of n blocks needs ceil(n / P) blocks on the fullest rank. Prefix-cache hits reuse a block
at the same index j, so they keep the rule's balance.

Worked example, P = 2, block_size 4: request A has 10 tokens (positions 0..9) in global blocks [6, 3, 8]
(j = 0, 1, 2 from pools 0, 1, 0):
    block 6 -> rank 0, local block 3 (local slots 12..15): positions 0..3
    block 3 -> rank 1, local block 1 (local slots 4..7):   positions 4..7
    block 8 -> rank 0, local block 4 (local slots 16..19): positions 8, 9
A decodes position 9 (seq_len 10). Rank 0 owns keys 0..3 and 8..9: its shared keys (positions below the first
query, 9) are 0..3 and 8 (local slots 12..16, one run), its diag key is 9 (slot 17, where rank 0 alone writes
the new token's K/V). Rank 1 owns keys 4..7: shared slots 4..7, no diag key. Each attends the decode query over
its own keys and the two partials merge by LSE (tandem/attention/sharded_kv.py).
"""

from __future__ import annotations

import numpy as np
import torch

from tandem.attention.batch import AttentionBatch
from tandem.attention.metadata import GATHER_MAX_KEYS, IN_PLACE_MIN_KEYS, MIN_RUN_KEYS, SHORT_ROW_TOKENS
from tandem.attention.sharded_kv import DIAG_CHUNK, OwnedGroup, OwnedRow, ShardedAttentionMetadata


def owner_rank(block_ids: np.ndarray | int, pcp_size: int) -> np.ndarray | int:
    """The rank that holds each global block (the ownership rule)."""
    return block_ids % pcp_size


def block_pool(block_index: int, pcp_size: int) -> int:
    """The rank whose pool the allocator takes a request's block_index-th block from."""
    return block_index % pcp_size


def local_slots(global_slots: np.ndarray, block_size: int, pcp_size: int) -> np.ndarray:
    """Global cache slots (global block id * block_size + offset) -> slots in the owner's local cache."""
    return (global_slots // block_size // pcp_size) * block_size + global_slots % block_size


def owned_writes(write_slots: np.ndarray, block_size: int, rank: int, pcp_size: int) -> tuple[np.ndarray, np.ndarray]:
    """[n] global slots written this step -> (indices of those `rank` owns, their local slots)."""
    keep = np.flatnonzero(owner_rank(write_slots // block_size, pcp_size) == rank)
    return keep, local_slots(write_slots[keep], block_size, pcp_size)


def owned_metadata(batch: AttentionBatch) -> ShardedAttentionMetadata:
    """A batch of global rows (batch.kv_shard set; its write slots global) over the keys this rank owns."""
    assert batch.kv_shard is not None
    rank, size, replicated = batch.kv_shard.rank, batch.kv_shard.size, batch.kv_shard.replicated
    device = batch.positions.device
    groups, rows = owned_plan(batch.positions.cpu().numpy(), batch.query_start_loc_cpu.numpy(),
                              batch.seq_lens_cpu.numpy(), batch.block_table.cpu().numpy(), batch.block_size, rank,
                              size, device, in_place=device.type == "cpu", replicated=replicated)
    if replicated:  # the cache holds every key: every write, at its own slot
        return ShardedAttentionMetadata(rows=rows, groups=groups, write_rows=batch.write_rows,
                                        write_slots=batch.write_slots)
    keep, local = owned_writes(batch.write_slots.cpu().numpy(), batch.block_size, rank, size)
    return ShardedAttentionMetadata(rows=rows, groups=groups,
                                    write_rows=batch.write_rows[torch.from_numpy(keep).to(batch.write_rows.device)],
                                    write_slots=torch.from_numpy(local.astype(np.int64)).to(device))


def owned_plan(positions: np.ndarray, query_start_loc: np.ndarray, seq_lens: np.ndarray, block_table: np.ndarray,
               block_size: int, rank: int, pcp_size: int, device: torch.device | str, in_place: bool = True,
               batch_short_rows: bool = True, replicated: bool = False) -> tuple[list[OwnedGroup], list[OwnedRow]]:
    """Every global row's keys that `rank` owns. positions [T] and query_start_loc [R + 1] index the global
    queries; seq_lens [R] keys each row sees after this step's write; block_table [R, max_blocks] global ids.

    Short rows (at most SHORT_ROW_TOKENS queries) that see few owned keys are padded into one OwnedGroup, one
    batched attention call for all of them (as the replicated layout's PrefixGroup): while the longest stays under
    IN_PLACE_MIN_KEYS owned keys and the group pads to at most GATHER_MAX_KEYS keys; off the CPU (`in_place`
    False) every short row is grouped. The other rows come back one OwnedRow each, short ones with many shared
    keys reading contiguous runs in place. `batch_short_rows=False`: every row alone (the tests' reference).
    `replicated`: the cache holds every block; `rank` takes a row's j-th blocks with j % pcp_size == rank, at their
    global slots."""
    bounds = [(i, int(query_start_loc[i]), int(query_start_loc[i + 1])) for i in range(len(query_start_loc) - 1)]
    bounds = [(i, a, b) for i, a, b in bounds if b > a]
    keys = {i: _owned_keys(int(seq_lens[i]), block_table[i], block_size, rank, pcp_size, replicated)
            for i, _, _ in bounds}
    by_keys = sorted(((i, a, b) for i, a, b in bounds if b - a <= SHORT_ROW_TOKENS and batch_short_rows),
                     key=lambda r: keys[r[0]][0].shape[0])
    while in_place and by_keys and (keys[by_keys[-1][0]][0].shape[0] >= IN_PLACE_MIN_KEYS
                                    or len(by_keys) * keys[by_keys[-1][0]][0].shape[0] > GATHER_MAX_KEYS):
        by_keys.pop()
    grouped = {i for i, _, _ in by_keys}
    groups = [_owned_group([(a, b - a, int(positions[a]), *keys[i]) for i, a, b in bounds if i in grouped], device)
              ] if grouped else []
    rows = [_owned_row(a, b - a, int(positions[a]), *keys[i], device, in_place)
            for i, a, b in bounds if i not in grouped]
    return groups, rows


def _owned_keys(seq_len: int, blocks: np.ndarray, block_size: int, rank: int, pcp_size: int,
                replicated: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """(local slots, positions) of the keys 0..seq_len-1 of one row that `rank` owns, in position order; in a
    replicated cache, of the row's j-th blocks with j % pcp_size == rank, whatever their ids (one pool hands out
    the ids), at their global slots."""
    pos = np.arange(seq_len)
    ids = blocks[pos // block_size].astype(np.int64)
    if replicated:
        mine = pos // block_size % pcp_size == rank
        return ids[mine] * block_size + pos[mine] % block_size, pos[mine]
    mine = owner_rank(ids, pcp_size) == rank
    return local_slots(ids[mine] * block_size + pos[mine] % block_size, block_size, pcp_size), pos[mine]


def _owned_group(rows: list[tuple[int, int, int, np.ndarray, np.ndarray]], device: torch.device | str) -> OwnedGroup:
    """rows: (token_start, num_queries, first position, owned slots, their positions) -> one padded group."""
    g = len(rows)
    q_max = max(n for _, n, _, _, _ in rows)
    s_max = max(1, max(s.shape[0] for _, _, _, s, _ in rows))
    token_idx = np.zeros((g, q_max), dtype=np.int64)
    token_valid = np.zeros((g, q_max), dtype=bool)
    q_pos = np.full((g, q_max), -1, dtype=np.int64)
    kv_slots = np.zeros((g, s_max), dtype=np.int64)
    k_pos = np.full((g, s_max), np.iinfo(np.int64).max, dtype=np.int64)  # padding keys: never visible
    for r, (start, n, first, slots, pos) in enumerate(rows):
        token_idx[r] = start + np.minimum(np.arange(q_max), n - 1)  # padding repeats the row's last query
        token_valid[r, :n] = True
        q_pos[r, :n] = first + np.arange(n)
        kv_slots[r, : slots.shape[0]] = slots
        k_pos[r, : pos.shape[0]] = pos
    visible = k_pos[:, None, :] <= q_pos[:, :, None]  # [G, Q, S]; a padding query (position -1) sees nothing

    def t(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(a).to(device)

    return OwnedGroup(t(token_idx), t(token_valid), t(kv_slots), t(visible))


def _owned_row(token_start: int, num_queries: int, first_pos: int, slots: np.ndarray, pos: np.ndarray,
               device: torch.device | str, in_place: bool) -> OwnedRow:
    """One row from its owned keys' (local slots, positions): shared = before the first query, diag = the rest."""
    shared = slots[pos < first_pos]
    diag_slots, diag_pos = slots[pos >= first_pos], pos[pos >= first_pos]
    long = num_queries > SHORT_ROW_TOKENS
    views: tuple[tuple[int, int], ...] = ()
    gathered = shared
    if in_place and not long and shared.shape[0] >= IN_PLACE_MIN_KEYS:
        # runs of consecutive local slots (a request's blocks back to back in this rank's pool) are read as views;
        # runs too short to pay for their own matmuls are gathered
        cuts = [0, *(np.flatnonzero(np.diff(shared) != 1) + 1).tolist(), shared.shape[0]]
        spans = list(zip(cuts[:-1], cuts[1:], strict=True))
        views = tuple((int(shared[a]), b - a) for a, b in spans if b - a >= MIN_RUN_KEYS)
        rest = [shared[a:b] for a, b in spans if b - a < MIN_RUN_KEYS]
        gathered = np.concatenate(rest) if rest else np.zeros(0, dtype=np.int64)
    q_pos = first_pos + np.arange(num_queries)
    visible = q_pos[:, None] >= diag_pos[None, :]  # [Q, n_d]
    blind = ~visible.any(axis=1) if diag_pos.shape[0] else np.zeros(num_queries, dtype=bool)
    bias, chunks = None, ()
    if long:
        bias = torch.from_numpy(np.where(visible, 0.0, -np.inf).astype(np.float32)).to(device)
        # a query sees the diag keys up to its position: the last query of a chunk sees the most of them
        seen = np.searchsorted(diag_pos, q_pos, side="right")  # [Q]
        chunks = tuple((a, min(a + DIAG_CHUNK, num_queries), int(seen[min(a + DIAG_CHUNK, num_queries) - 1]))
                       for a in range(0, num_queries, DIAG_CHUNK))
    return OwnedRow(token_start, num_queries, views, torch.from_numpy(gathered.astype(np.int64)).to(device),
                    torch.from_numpy(diag_slots.astype(np.int64)).to(device), torch.from_numpy(visible).to(device),
                    bias, torch.from_numpy(blind).to(device) if blind.any() else None, chunks)

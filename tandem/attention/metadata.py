"""The paged CPU backends' metadata (PAGED_SDPA, PAGED_MLA): the step's batch (tandem/attention/batch.py) planned
for the CPU, built by those backends' `prepare_metadata` (plan_batch) and read only by them. The contiguous backends'
row groups and the sharded KV layout's owned-key plan reuse its grouping helpers and bounds.

Short rows (decodes, verification rows) are padded into groups, read in place as contiguous key runs, or handed to
the native kernel; long rows (prompt chunks) are attended whole over their gathered keys; keys that several rows
share are attended once (cascade). Causality is decided from positions, as the batch's docstring says.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from tandem import native
from tandem.attention.batch import AttentionBatch

if TYPE_CHECKING:
    from tandem.attention.backend import AttentionBackend

SHORT_ROW_TOKENS = 16  # rows up to this many query tokens share one padded attention call (or read in place)
# prompt rows up to this many queries that a GQA backend may run through the native CPU kernel instead of per-row
# SDPA over gathered keys (SmolLM2, 32 prompts of 31-115 tokens: 960 SDPA calls a prefill, ~0.3 s of 2.7 s); MLA keeps
# its expanded long-row path (absorbing a prompt row's every query costs more there)
NATIVE_PROMPT_TOKENS = 128
# Short rows are padded into one gathered group (one batched matmul for all of them) while that group stays small;
# a row that sees at least IN_PLACE_MIN_KEYS keys, and the longest rows while the group would pad to more than
# GATHER_MAX_KEYS keys, read their keys in place instead (views of contiguous slot runs, a few small matmuls per
# row). Measured on the CPU (absorbed MLA, 4 and 16 heads, 1-32 rows): the gather wins below ~1k keys a row as
# long as rows x keys stays under ~8k, and past that copying the prefixes costs 2-5x the in-place reads.
IN_PLACE_MIN_KEYS = 1024
GATHER_MAX_KEYS = 8192
# A contiguous run of fewer keys than this is gathered with the row's tail instead of read as its own view:
# two small matmul calls cost about as much as copying this many keys.
MIN_RUN_KEYS = 64
# Cascade attention: when two or more short rows of a step read the same first cache blocks (a prefix-cache hit they
# share: few-shot exemplars, a system prompt) for at least this many keys, those keys are attended once for all of
# those rows' queries (one matmul over keys read once) and each row reads only its own keys beyond them; the two
# parts merge by log-sum-exp. vLLM's cascade attention uses the same bound.
CASCADE_MIN_KEYS = 256


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
    # position of key 0 of kv_slots: the shared prefix's length when the step has one (its keys are attended
    # apart, SharedPrefix), else 0
    key_offset: int = 0

    def with_mask(self, mask: torch.Tensor) -> PrefixGroup:
        return dataclasses.replace(self, mask=mask, blocked=~mask)

    def covers_all(self, num_tokens: int) -> bool:
        """The group is all `num_tokens` query tokens in order (none is graph padding): q.view(G, Q, ...) is its
        query block and its output is the whole output, with no gathers or scatters."""
        return self.dense and self.token_idx.numel() == num_tokens


@dataclass(frozen=True)
class LongPiece:
    """A row of more than SHORT_ROW_TOKENS queries (a prompt chunk, or a PCP piece of one): tokens
    [token_start, token_start + num_queries) at consecutive positions ending at seq_len - 1."""

    token_start: int
    num_queries: int
    seq_len: int


@dataclass(frozen=True)
class LongRow:
    """The long pieces of one request on this rank, attended whole over its keys: piece i sees the cache slots
    kv_slots[:seq_len_i], its first seq_len_i - num_queries_i keys unmasked, its last num_queries_i causally
    (tandem/attention/causal_rows.py). Under PCP a rank holds two pieces of each chunk (DualChunkSwap), whose
    key sets are prefixes of one another: grouping them gathers (and MLA expands) each key once per layer."""

    pieces: tuple[LongPiece, ...]
    kv_slots: torch.Tensor  # [max seq_len] int64
    shares_prefix: bool = False  # its keys start with AttentionMetadata.long_prefix's (it is one of its rows)
    native: bool = False  # also in AttentionMetadata.native_long_rows: a GQA backend on the CPU runs it there

    @property
    def seq_len(self) -> int:
        return self.kv_slots.shape[0]

    @property
    def num_queries(self) -> int:
        return sum(p.num_queries for p in self.pieces)


@dataclass(frozen=True)
class RowKeys:
    """A short row's keys read from the cache in place: `runs` are contiguous slot ranges (a request's blocks
    allocated back to back) read as views, `tail_slots` the keys gathered: runs too short to pay for their own
    matmuls, then the row's own num_queries tokens (always last, so the causal mask is a [Q, Q] triangle).
    Every run key is seen by every query of the row; the order of keys does not matter to softmax."""

    token_start: int
    num_queries: int
    runs: tuple[tuple[int, int], ...]  # (first slot, number of keys)
    tail_slots: torch.Tensor  # [n_tail] int64


@dataclass(frozen=True)
class SharedPrefix:
    """Keys at positions [0, num_keys) that two or more short rows of the step (the largest such set; the member
    rows) read through the same cache blocks (cascade attention, CASCADE_MIN_KEYS): attended once for all the
    members' queries, then merged by LSE with each member's attention over its own keys from num_keys on (their
    group's and RowKeys' keys start there; the other short rows are padded in a group of their own). Every member
    query sits at or after num_keys, so these keys are visible to all of them, unmasked."""

    num_keys: int
    slots: torch.Tensor  # [num_keys] int64 cache slots
    first_slot: int | None  # the slots are first_slot .. first_slot + num_keys - 1 (read as one view), or None
    token_idx: torch.Tensor | None  # [T_members] int64 the member rows' query tokens, or None: every token of the step

    def keys(self, flat: torch.Tensor) -> torch.Tensor:
        """flat [num_slots, ...] -> the prefix's [num_keys, ...]: a view of the cache, or gathered once."""
        if self.first_slot is not None:
            return flat[self.first_slot: self.first_slot + self.num_keys]
        return select_rows(flat, self.slots)


@dataclass(kw_only=True)
class AttentionMetadata(AttentionBatch):
    """The batch and its CPU plan. Every sub-plan is optional: the rows of the step fall into exactly one of them."""

    groups: list[PrefixGroup]  # the short rows, padded together (empty when row_keys reads them in place)
    long_rows: list[LongRow] = dataclasses.field(default_factory=list)
    row_keys: list[RowKeys] | None = None  # the short rows read in place (CPU), or None: `groups` gathers them
    shared_prefix: SharedPrefix | None = None  # keys >= 2 short rows share, attended once for all of them
    # keys that >= 2 long rows (prompt chunks; LongRow.shares_prefix) share: MLA expands their latents once a layer,
    # not once a row (its token_idx is unused)
    long_prefix: SharedPrefix | None = None
    # the short rows for the native CPU kernel (tandem/native), which reads their keys in place through
    # block_table: int32 [R, 5] = (block-table row, first query token, queries, seq_len, first key position), or
    # None: `groups` / `row_keys` serve them
    native_rows: torch.Tensor | None = None
    # the long rows marked `native` (one piece of at most NATIVE_PROMPT_TOKENS queries, no shared long prefix) in
    # the same [R, 5] form, or None
    native_long_rows: torch.Tensor | None = None


def plan_batch(batch: AttentionBatch, backend: type[AttentionBackend]) -> AttentionMetadata:
    """`backend`'s CPU plan of a batch. MTP's draft decodes (`batch.base`) move their first decode's plan on by a
    position; the native kernel reads each row's keys up to its own seq_len, so there a key bound is not needed."""
    if batch.base is not None:
        return advance_decodes(batch.base.metadata_for(backend), batch)
    bound = None if batch.block_table.device.type == "cpu" and native.enabled() else batch.key_bound
    return build_attention_metadata(batch.positions, batch.query_start_loc_cpu, batch.seq_lens_cpu,
                                    batch.block_table, batch.block_size, batch.write_rows, batch.write_slots,
                                    key_bound=bound)


def advance_decodes(base: AttentionMetadata, batch: AttentionBatch) -> AttentionMetadata:
    """The plan of one-token decodes of base's rows at batch's positions: the same rows one position on (a shared
    prefix stays shared); the padded group keeps its keys, gathered up to the key bound, and only re-masks them."""
    moved = dict(positions=batch.positions, seq_lens_cpu=batch.seq_lens_cpu, write_rows=batch.write_rows,
                 write_slots=batch.write_slots)
    if base.native_rows is not None:
        rows = base.native_rows.clone()
        rows[:, 3] = batch.seq_lens_cpu
        return dataclasses.replace(base, native_rows=rows, **moved)
    (group,) = base.groups  # one group of one-token rows, keys gathered up to the key bound
    # (from key_offset on: a shared prefix before it is attended apart and seen by every row)
    k_pos = torch.arange(group.key_offset, group.key_offset + group.kv_slots.shape[1], device=batch.positions.device)
    mask = (k_pos[None, :] <= batch.positions[:, None])[:, None, None, :]  # [S, 1, 1, key bound - key_offset]
    return dataclasses.replace(base, groups=[group.with_mask(mask)], **moved)


def build_attention_metadata(positions: torch.Tensor, query_start_loc_cpu: torch.Tensor,
                             seq_lens_cpu: torch.Tensor, block_table: torch.Tensor, block_size: int,
                             write_rows: torch.Tensor, write_slots: torch.Tensor,
                             key_bound: int | None = None) -> AttentionMetadata:
    """`write_rows` index the K/V tensor the attention layer hands the backend: this step's own rows, or
    under PCP the all-gathered rows of every rank. `key_bound`: gather the short rows' keys up to this many
    positions (instead of their current seq_lens), so the same slots serve later decodes of the same rows."""
    q_lens = (query_start_loc_cpu[1:] - query_start_loc_cpu[:-1]).tolist()
    seq_lens = seq_lens_cpu.tolist()
    short = [i for i, n in enumerate(q_lens) if n <= SHORT_ROW_TOKENS]
    table_np = block_table.numpy() if block_table.device.type == "cpu" else None
    # MTP's bounded draft decodes keep one group (their masks move per decode): all rows share, or none do
    shared, members = _shared_prefix(short, q_lens, seq_lens, query_start_loc_cpu, table_np, block_size, positions,
                                     subset=key_bound is None)
    start = {i: shared.num_keys if shared is not None and i in members else 0 for i in short}  # own keys begin
    native_rows = None
    if table_np is not None and key_bound is None and short and native.enabled():
        native_rows = torch.tensor([[i, int(query_start_loc_cpu[i]), q_lens[i], seq_lens[i], start[i]] for i in short],
                                   dtype=torch.int32)
        short = []  # no padded groups, no in-place views: the kernel reads every short row's keys
    in_place: list[int] = []
    if table_np is not None and key_bound is None:  # off the CPU (and for MTP's bounded drafts) the gather stays
        by_keys = sorted(short, key=lambda i: seq_lens[i] - start[i])
        while by_keys and (seq_lens[by_keys[-1]] - start[by_keys[-1]] >= IN_PLACE_MIN_KEYS
                           or len(by_keys) * (seq_lens[by_keys[-1]] - start[by_keys[-1]]) > GATHER_MAX_KEYS):
            in_place.append(by_keys.pop())
        gathered = set(by_keys)
        short = [i for i in short if i in gathered]  # kept in batch order: a batch of decodes stays dense
    row_keys = [_row_keys(int(query_start_loc_cpu[i]), q_lens[i], seq_lens[i], table_np[i], block_size, start[i])
                for i in sorted(in_place)] if table_np is not None and in_place else None
    # the rows behind the shared prefix and the others are padded apart: their keys start at different positions
    parts = [[i for i in short if i in members], [i for i in short if i not in members]]
    groups = [_group([(i, 0, q_lens[i]) for i in part], positions, query_start_loc_cpu, seq_lens_cpu, block_table,
                     block_size, key_bound, start[part[0]]) for part in parts if part]
    long_ids = [i for i, n in enumerate(q_lens) if n > SHORT_ROW_TOKENS]
    long_prefix, long_members = _shared_prefix(long_ids, q_lens, seq_lens, query_start_loc_cpu, table_np, block_size,
                                               positions, subset=True, name_tokens=False)
    long_rows = _long_rows(long_ids, query_start_loc_cpu, q_lens, seq_lens, block_table, table_np, block_size,
                           positions.device, long_members)
    native_long_rows = None
    if table_np is not None and key_bound is None and long_rows and native.enabled():
        long_rows, native_long_rows = _native_long_rows(long_rows, long_ids, query_start_loc_cpu)
    return AttentionMetadata(
        positions=positions, query_start_loc_cpu=query_start_loc_cpu, seq_lens_cpu=seq_lens_cpu,
        block_table=block_table, block_size=block_size, groups=groups, write_rows=write_rows,
        write_slots=write_slots, key_bound=key_bound, long_rows=long_rows, row_keys=row_keys, shared_prefix=shared,
        long_prefix=long_prefix, native_rows=native_rows, native_long_rows=native_long_rows)


def _native_long_rows(long_rows: list[LongRow], long_ids: list[int],
                      qsl: torch.Tensor) -> tuple[list[LongRow], torch.Tensor | None]:
    """Mark the long rows the native kernel can take whole (one piece, at most NATIVE_PROMPT_TOKENS queries or a
    longer row its AMX tiles take, keys not behind a shared long prefix) -> (the rows, marked; their [R, 5] kernel
    rows, or None)."""
    row_of = {int(qsl[i]): i for i in long_ids}
    picked, marked = [], []
    for lr in long_rows:
        (p, *more) = lr.pieces
        if not more and not lr.shares_prefix and (p.num_queries <= NATIVE_PROMPT_TOKENS
                                                  or native.tiles_long_row(p.num_queries, p.seq_len)):
            picked.append([row_of[p.token_start], p.token_start, p.num_queries, p.seq_len, 0])
            lr = dataclasses.replace(lr, native=True)
        marked.append(lr)
    return marked, torch.tensor(picked, dtype=torch.int32) if picked else None


def _shared_prefix(rows: list[int], q_lens: list[int], seq_lens: list[int], qsl: torch.Tensor,
                   table: np.ndarray | None, block_size: int, positions: torch.Tensor,
                   subset: bool, name_tokens: bool = True) -> tuple[SharedPrefix | None, set[int]]:
    """The whole blocks that the tables of >= 2 of `rows` start with and every one of their queries sees (they end
    before each row's first query), when >= CASCADE_MIN_KEYS keys: -> (the prefix, the rows behind it). `subset`:
    the largest set of rows that start with the same block (a request with another prefix does not turn cascade
    off for the rest), else all rows or none. CPU only (the host block table is at hand there)."""
    if table is None or len(rows) < 2:
        return None, set()
    # blocks wholly before each row's first query: those keys are unmasked for all of its queries
    whole = {i: (seq_lens[i] - q_lens[i]) // block_size for i in rows}
    candidates = [i for i in rows if whole[i] * block_size >= CASCADE_MIN_KEYS]
    if subset:
        by_first: dict[int, list[int]] = {}
        for i in candidates:
            by_first.setdefault(int(table[i, 0]), []).append(i)
        members = max(by_first.values(), key=len, default=[])
    else:
        members = candidates if len(candidates) == len(rows) else []
    if len(members) < 2:
        return None, set()
    limit = min(whole[i] for i in members)
    tables = table[members, :limit]  # [R, limit]
    differs = np.flatnonzero((tables != tables[0]).any(axis=0))
    num_blocks = int(differs[0]) if differs.size else limit
    num_keys = num_blocks * block_size
    if num_keys < CASCADE_MIN_KEYS:
        return None, set()
    contiguous = bool((np.diff(tables[0, :num_blocks].astype(np.int64)) == 1).all())
    token_idx = None
    if name_tokens and len(members) < len(q_lens):  # beside other rows: name the member rows' tokens
        token_idx = torch.from_numpy(np.concatenate([np.arange(int(qsl[i]), int(qsl[i]) + q_lens[i])
                                                     for i in members])).to(positions.device)
    first_slot = int(tables[0, 0]) * block_size if contiguous else None
    return SharedPrefix(num_keys, _row_slots(table, members[0], num_keys, block_size, positions.device), first_slot,
                        token_idx), set(members)


def _long_rows(rows: list[int], qsl: torch.Tensor, q_lens: list[int], seq_lens: list[int], block_table: torch.Tensor,
               table_np: np.ndarray | None, block_size: int, device: torch.device,
               prefix_members: set[int] | frozenset[int] = frozenset()) -> list[LongRow]:
    """Long rows grouped by shared keys: a row joins a group when their block tables agree over the shorter
    one's blocks (the same request's pieces; requests sharing only a cached prefix still diverge later)."""
    if not rows:
        return []
    # off the CPU one host copy of the table per prefill step (the step's inputs were built on the host anyway)
    table = table_np if table_np is not None else block_table.cpu().numpy()
    groups: list[tuple[int, list[LongPiece]]] = []  # (row whose keys reach furthest, pieces)
    for i in rows:
        piece = LongPiece(int(qsl[i]), q_lens[i], seq_lens[i])
        for g, (rep, pieces) in enumerate(groups):
            nb = -(-min(seq_lens[i], seq_lens[rep]) // block_size)
            if np.array_equal(table[i, :nb], table[rep, :nb]):
                pieces.append(piece)
                if seq_lens[i] > seq_lens[rep]:
                    groups[g] = (i, pieces)
                break
        else:
            groups.append((i, [piece]))
    return [LongRow(tuple(pieces), _row_slots(table, rep, seq_lens[rep], block_size, device), rep in prefix_members)
            for rep, pieces in groups]


def _row_slots(table: np.ndarray, row: int, seq_len: int, block_size: int, device: torch.device) -> torch.Tensor:
    """[seq_len] int64 cache slots of positions 0..seq_len-1 of one row (`table`: the host block table)."""
    blocks = table[row, : -(-seq_len // block_size)].astype(np.int64)
    slots = (blocks[:, None] * block_size + np.arange(block_size)).reshape(-1)[:seq_len]
    return torch.from_numpy(slots).to(device)


def _row_keys(token_start: int, num_queries: int, seq_len: int, blocks: np.ndarray, block_size: int,
              key_start: int = 0) -> RowKeys:
    # keys every query sees: positions [key_start, seq_len - num_queries) (key_start: a SharedPrefix's length, a
    # whole number of blocks); the row's own tokens go last, in the tail
    shared = seq_len - num_queries
    first_block = key_start // block_size
    num_blocks = -(-shared // block_size)
    ids = blocks[first_block:num_blocks].astype(np.int64)
    runs: list[tuple[int, int]] = []
    gathered: list[np.ndarray] = []
    if num_blocks > first_block:
        breaks = np.flatnonzero(np.diff(ids) != 1) + 1
        for a, b in zip([0, *breaks.tolist()], [*breaks.tolist(), num_blocks - first_block], strict=True):
            n = min((first_block + b) * block_size, shared) - (first_block + a) * block_size
            first = int(ids[a]) * block_size
            if n >= MIN_RUN_KEYS:
                runs.append((first, n))
            else:
                gathered.append(np.arange(first, first + n))
    own = np.arange(shared, seq_len)
    gathered.append(blocks[own // block_size].astype(np.int64) * block_size + own % block_size)
    return RowKeys(token_start, num_queries, tuple(runs), torch.from_numpy(np.concatenate(gathered)))


def row_groups(meta: AttentionBatch) -> list[PrefixGroup]:
    """Every row padded into groups, long rows whole (one group each), for backends that take a row's new keys
    from the row itself and so need all of its new tokens in one call. Short rows (decodes, and verification
    rows of K + 1 tokens) are batched together, padded to the longest of them, so a decode never pads up to a
    chunk's length. A piece is (row, first query offset in the row, number of queries)."""
    qsl = meta.query_start_loc_cpu
    q_lens = (qsl[1:] - qsl[:-1]).tolist()
    short = [(i, 0, n) for i, n in enumerate(q_lens) if n <= SHORT_ROW_TOKENS]
    args = (meta.positions, qsl, meta.seq_lens_cpu, meta.block_table, meta.block_size)
    groups = [_group(short, *args)] if short else []
    return groups + [_group([(i, 0, n)], *args) for i, n in enumerate(q_lens) if n > SHORT_ROW_TOKENS]


def _group(pieces: list[tuple[int, int, int]], positions: torch.Tensor, qsl: torch.Tensor, seq_lens: torch.Tensor,
           block_table: torch.Tensor, block_size: int, key_bound: int | None = None, key_start: int = 0) -> PrefixGroup:
    """key_start: the group's keys are positions [key_start, visible) (a SharedPrefix holds the ones before)."""
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
    k_pos = torch.arange(key_start, s_max, device=device)  # [S] positions of the gathered keys
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
                       dense=dense, blocked=None if nothing_masked else ~mask, key_offset=key_start)


def gather_rows(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """x[idx] for a 2-D index: index_select copies whole rows, several times faster on CPU than advanced
    indexing, which matters because every layer gathers its keys through the block table."""
    return select_rows(x, idx.flatten()).view(*idx.shape, *x.shape[1:])


def select_rows(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """x.index_select(0, idx) for a 1-D index, through a 2-D view when x is contiguous: on the CPU index_select
    copies a 2-D tensor's rows as whole memcpys but walks a 3-D one ([slots, 1, 576]: MLA's latent cache seen as
    one KV head) element-strided, 2.6x slower (1,004 rows: 57 vs 150 us)."""
    if x.dim() > 2 and x.is_contiguous():
        return x.view(x.shape[0], -1).index_select(0, idx).view(idx.shape[0], *x.shape[1:])
    return x.index_select(0, idx)

"""Attention over owner-sharded KV (`pcp_kv_layout: sharded`): each rank attends every query of the step over
the keys it owns, and the P partial results are merged exactly by their log-sum-exp.

Under the sharded layout a token's K/V (GQA K/V, MLA latent) lives only on the rank that owns its KV block
(tandem/attention/kv_ownership.py). A query needs keys from every rank, so the step's queries are passed instead of the
keys: each rank all-gathers the step's queries (prompt chunks are split over the ranks by DualChunkSwap; decode
and verification rows are already on every rank, and a step of decodes only gathers nothing), attends all of
them over its own keys, and sends each rank the partial outputs, with their LSE, of that rank's own query rows
(one all-to-all; MTP's replicated draft decodes all-gather them); each rank merges the P partials of its rows
(softmax over the union of disjoint key sets is the LSE-weighted mix of the parts' softmaxes,
tandem/attention/causal_rows.py). Every key is read once per layer on one rank, so attention work and KV memory
are split over the ranks; the query tokens' own new K/V still cross ranks once (the owner writes them).

Bytes a rank receives per layer per step (P ranks, T_r local tokens padded to M = max_r T_r, element bytes e):

    replicated  P M (kv width) e                                        new K/V (GQA 2 Hkv D, MLA L + rope)
    sharded     P M (kv width) e + P M Hq Dq e [steps with prompt rows] + P T_r Hq (Dv + 1) 4 [partials, fp32]

where Dq is the query width the backend attends with (GQA D, MLA nope + rope) and Dv its output width (GQA D,
MLA v: partials are merged after W_UV, which is linear). The partials cost more bytes than the keys at short
contexts and far fewer than the keys a query sees at long ones; what the layout buys is memory.

A row's owned keys split at its first query position p: `shared` keys (positions < p) are seen by every query of
the row, unmasked; `diag` keys (positions >= p, the row's own new tokens this rank owns) are masked by position,
query at position q sees key at position k iff k <= q. A query that sees no key on this rank has LSE -inf there.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from tandem.attention.causal_rows import attention_with_lse
from tandem.attention.metadata import SHORT_ROW_TOKENS, select_rows

NEG_INF = float("-inf")
DIAG_CHUNK = 256  # queries of a long row's position-masked diag part per flash call (OwnedRow.diag_chunks)


@dataclass(frozen=True)
class OwnedRow:
    """One global row's keys owned by this rank. Queries are global tokens [token_start, token_start + Q) at
    consecutive positions; `runs` and `gathered` hold the shared keys (read in place as views / gathered), `diag`
    the masked ones."""

    token_start: int
    num_queries: int
    runs: tuple[tuple[int, int], ...]  # (first local slot, number of keys): contiguous shared keys, read in place
    gathered: torch.Tensor  # [n_g] int64 local slots of the other shared keys
    diag_slots: torch.Tensor  # [n_d] int64 local slots of owned keys at positions >= the first query's
    diag_visible: torch.Tensor  # [Q, n_d] bool, query i may see diag key j
    diag_bias: torch.Tensor | None  # [Q, n_d] 0 / -inf, the same mask for the flash kernel (long rows only)
    diag_blind: torch.Tensor | None  # [Q] bool queries that see none of the diag keys, or None when every one does
    # long rows: (first query, end query, diag keys visible to the end's last query) per chunk of DIAG_CHUNK queries.
    # The diag keys lie in position order, so a chunk attends only the first ones: under the position mask the
    # whole [Q, n_d] square cost twice the visible half (2,048 queries over 1,024 owned keys a prompt step)
    diag_chunks: tuple[tuple[int, int, int], ...]

    @property
    def num_shared(self) -> int:
        return sum(n for _, n in self.runs) + self.gathered.shape[0]

    def shared_slots(self) -> torch.Tensor:
        """[n_shared] every shared key's local slot, runs first (one gather for a long row's keys)."""
        parts = [torch.arange(a, a + n, dtype=torch.int64, device=self.gathered.device) for a, n in self.runs]
        return torch.cat([*parts, self.gathered]) if parts else self.gathered


@dataclass(frozen=True)
class OwnedGroup:
    """Short rows (decodes, verification rows) that see few owned keys, padded into one batched call: row g's
    queries are global tokens token_idx[g] (padding repeats a valid one), its keys the local slots kv_slots[g]."""

    token_idx: torch.Tensor  # [G, Q] int64
    token_valid: torch.Tensor  # [G, Q] bool
    kv_slots: torch.Tensor  # [G, S] int64 (padding -> slot 0, never visible)
    visible: torch.Tensor  # [G, Q, S] bool, query q of row g may see key s (by position)


@dataclass
class ShardedAttentionMetadata:
    """The paged backends' metadata of a batch under the sharded KV layout (kv_ownership.owned_metadata): every
    global row, over the keys this rank owns."""

    rows: list[OwnedRow]  # attended one by one (prompt chunks; short rows that read many keys in place)
    write_rows: torch.Tensor  # [num_writes] int64 rows of the (gathered) new K/V this rank writes: the ones it owns
    write_slots: torch.Tensor  # [num_writes] int64 their LOCAL cache slots
    groups: list[OwnedGroup] = field(default_factory=list)  # the other short rows, batched


@dataclass(frozen=True)
class ShardedKVExchange:
    """The collectives of one forward under the sharded KV layout (the PCP hooks', handed to the forward context):
    `gather_queries` takes a layer's local queries [T_r, ...] to the global [T, ...] (graph padding included: its
    partials are empty); `merge` takes the partial (out [T, H, Dv], lse [T, H]) of every rank to this rank's
    [T_r, H, Dv] float32. Any backend whose sharded forward returns LSE is merged the same way."""

    gather_queries: Callable[[torch.Tensor], torch.Tensor]
    merge: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def merge_partials(out: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """out: [N, ..., Dv] partial outputs of the same queries over N disjoint key sets; lse: [N, ...] (-inf: the
    part saw no key) -> [..., Dv] float32, the attention over the union (zero where no part saw a key)."""
    m = lse.max(dim=0).values
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    w = (lse - m).exp()  # [N, ...], exactly 0 for an empty part
    total = w.sum(dim=0)
    return (out.float() * w[..., None]).sum(dim=0) / total.clamp(min=torch.finfo(torch.float32).tiny)[..., None]


def owned_attention(q: torch.Tensor, k_flat: torch.Tensor, v_flat: torch.Tensor | None, row: OwnedRow,
                    scale: float, dv: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One row: q [Q, Hq, Dk] over its owned keys in the cache k_flat [num_slots, Hkv, Dk] (v_flat, or the keys'
    first dv channels when None) -> (out [Q, Hq, dv], lse [Q, Hq] float32)."""
    if row.num_queries > SHORT_ROW_TOKENS:
        shared = row.shared_slots()
        keys = torch.cat((select_rows(k_flat, shared), select_rows(k_flat, row.diag_slots)))
        values = keys[..., :dv] if v_flat is None else torch.cat(
            (select_rows(v_flat, shared), select_rows(v_flat, row.diag_slots)))
        return long_owned_attention(q, keys.to(q.dtype), values.to(q.dtype), shared.shape[0], row, scale)
    return short_owned_attention(q, k_flat, v_flat, row, scale, dv)


def short_owned_attention(q: torch.Tensor, k_flat: torch.Tensor, v_flat: torch.Tensor | None, row: OwnedRow,
                          scale: float, dv: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A decode or verification row by explicit scores, the shared runs read in place (as in_place_row_attention):
    the r = Hq / Hkv query heads of a KV head folded into the query axis."""
    n, hq, _ = q.shape
    hkv = k_flat.shape[1]
    r = hq // hkv
    qf = q.reshape(n, hkv, r, -1).permute(1, 2, 0, 3).reshape(hkv, r * n, -1)  # [Hkv, r n, Dk]
    idx = torch.cat((row.gathered, row.diag_slots))
    keys = [k_flat[a: a + m] for a, m in row.runs] + [select_rows(k_flat, idx)]  # each [s, Hkv, Dk]
    if v_flat is None:
        values = [k[..., :dv] for k in keys]
    else:
        values = [v_flat[a: a + m] for a, m in row.runs] + [select_rows(v_flat, idx)]
    scores = torch.cat([torch.matmul(qf, k.to(q.dtype).permute(1, 2, 0)) for k in keys], dim=-1).float() * scale
    n_d = row.diag_slots.shape[0]
    if n_d:  # the diag keys are the last n_d
        scores.view(hkv, r, n, -1)[..., -n_d:].masked_fill_(~row.diag_visible, NEG_INF)
    lse = torch.logsumexp(scores, dim=-1)  # [Hkv, r n]
    probs = (scores - torch.where(torch.isfinite(lse), lse, 0)[..., None]).exp().to(q.dtype)
    out, start = None, 0
    for v in values:
        s = v.shape[0]
        part = torch.matmul(probs[..., start: start + s], v.to(q.dtype).transpose(0, 1))  # [Hkv, r n, Dv]
        out = part if out is None else out + part
        start += s
    assert out is not None
    out = out.view(hkv, r, n, -1).permute(2, 0, 1, 3).reshape(n, hq, -1)
    return out, lse.view(hkv, r, n).permute(2, 0, 1).reshape(n, hq)


def long_owned_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, num_shared: int,
                         row: OwnedRow, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """A prompt-chunk row: q [Q, Hq, Dk]; keys [S, Hkv, Dk] / values [S, Hkv, Dv] its owned keys, the first
    num_shared unmasked, the rest diag -> (out [Q, Hq, Dv], lse [Q, Hq]). Both parts run on the CPU flash kernel
    (which returns the LSE); the diag part with the position mask as an additive bias."""
    num_q, hq, _ = q.shape
    hkv = keys.shape[1]
    r = hq // hkv
    outs, lses = [], []
    if num_shared:  # unmasked: fold the r heads of a KV head into the query axis, K/V never repeated
        qf = q.reshape(num_q, hkv, r, -1).permute(1, 2, 0, 3).reshape(1, hkv, r * num_q, -1)
        o, lse = attention_with_lse(qf, keys[None, :num_shared].transpose(1, 2),
                                    values[None, :num_shared].transpose(1, 2), scale, causal=False)
        outs.append(o[0].reshape(hq, num_q, -1))
        lses.append(lse[0].reshape(hq, num_q))
    if keys.shape[0] > num_shared:
        kd, vd = keys[num_shared:].transpose(0, 1), values[num_shared:].transpose(0, 1)  # [Hkv, n_d, D*]
        if r > 1:
            kd, vd = kd.repeat_interleave(r, dim=0), vd.repeat_interleave(r, dim=0)
        o, lse = _masked_attention_with_lse(q.transpose(0, 1)[None], kd[None], vd[None], row, scale)
        outs.append(o[0])
        lses.append(lse[0])
    if not outs:  # nothing owned below this row's last position: every query sees nothing here
        return q.new_zeros(num_q, hq, values.shape[-1]), q.new_full((num_q, hq), NEG_INF, dtype=torch.float32)
    out = merge_partials(torch.stack(outs), torch.stack(lses)).to(q.dtype) if len(outs) > 1 else outs[0]
    lse = torch.logsumexp(torch.stack(lses), dim=0) if len(lses) > 1 else lses[0]
    return out.transpose(0, 1), lse.transpose(0, 1)


def _masked_attention_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, row: OwnedRow,
                               scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """q [1, H, Q, D] over the diag keys [1, H, n_d, D*] under the row's position mask; a query that sees no
    diag key gets output 0 and LSE -inf (the flash kernel returns LSE 0 there)."""
    if q.device.type == "cpu" and row.diag_bias is not None:
        dv = v.shape[-1]
        if dv != q.shape[-1]:
            v = torch.nn.functional.pad(v, (0, q.shape[-1] - dv))
        bias = row.diag_bias.to(q.dtype)
        outs, lses = [], []
        for a, b, n in row.diag_chunks:
            if n == 0:  # these queries see no diag key (diag_blind below)
                outs.append(q.new_zeros(*q.shape[:2], b - a, q.shape[-1]))
                lses.append(q.new_full((*q.shape[:2], b - a), NEG_INF, dtype=torch.float32))
                continue
            o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                q[:, :, a:b], k[:, :, :n], v[:, :, :n], attn_mask=bias[None, None, a:b, :n], scale=scale)[:2]
            outs.append(o)
            lses.append(lse.float())
        out, lse = torch.cat(outs, dim=2)[..., :dv], torch.cat(lses, dim=2)
    else:
        scores = torch.matmul(q, k.transpose(-1, -2)).float() * scale
        scores = scores.masked_fill(~row.diag_visible, NEG_INF)
        lse = torch.logsumexp(scores, dim=-1)
        probs = (scores - torch.where(torch.isfinite(lse), lse, 0)[..., None]).exp()
        out = torch.matmul(probs.to(v.dtype), v)
    if row.diag_blind is not None:
        lse = lse.masked_fill(row.diag_blind, NEG_INF)
        out = out.masked_fill(row.diag_blind[:, None], 0)
    return out, lse


def grouped_owned_attention(q: torch.Tensor, k_flat: torch.Tensor, v_flat: torch.Tensor | None, group: OwnedGroup,
                            scale: float, dv: int) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, Hq, Dk] the global queries; one batched call for the group's rows -> (out [G, Q, Hq, dv],
    lse [G, Q, Hq] float32); the r = Hq / Hkv heads of a KV head folded into the query axis."""
    g, num_q = group.token_idx.shape
    hq, hkv = q.shape[1], k_flat.shape[1]
    r = hq // hkv
    qg = select_rows(q, group.token_idx.flatten()).view(g, num_q, hkv, r, -1)
    qf = qg.permute(0, 2, 3, 1, 4).reshape(g, hkv, r * num_q, -1)  # [G, Hkv, r Q, Dk]
    kg = select_rows(k_flat, group.kv_slots.flatten()).view(g, -1, hkv, k_flat.shape[-1]).to(q.dtype)
    vg = kg[..., :dv] if v_flat is None else select_rows(v_flat, group.kv_slots.flatten()).view(
        g, -1, hkv, v_flat.shape[-1]).to(q.dtype)
    scores = torch.matmul(qf, kg.permute(0, 2, 3, 1)).float() * scale  # [G, Hkv, r Q, S]
    scores.view(g, hkv, r, num_q, -1).masked_fill_(~group.visible[:, None, None], NEG_INF)
    lse = torch.logsumexp(scores, dim=-1)  # [G, Hkv, r Q]
    probs = (scores - torch.where(torch.isfinite(lse), lse, 0)[..., None]).exp().to(q.dtype)
    out = torch.matmul(probs, vg.transpose(1, 2))  # [G, Hkv, r Q, Dv]
    out = out.view(g, hkv, r, num_q, -1).permute(0, 3, 1, 2, 4).reshape(g, num_q, hq, -1)
    return out, lse.view(g, hkv, r, num_q).permute(0, 3, 1, 2).reshape(g, num_q, hq)


def sharded_partials(meta: ShardedAttentionMetadata, q: torch.Tensor,
                     row_attention: Callable[[OwnedRow, torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
                     dv: int,
                     group_attention: Callable[[OwnedGroup], tuple[torch.Tensor, torch.Tensor]] | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Run `group_attention(group)` over the batched short rows and `row_attention(row, q_rows)` over every other
    row of the global queries q [num_queries, Hq, ...] -> (out [num_queries, Hq, dv] float32, lse
    [num_queries, Hq]); tokens in no row (padding) see nothing."""
    out = q.new_zeros(q.shape[0], q.shape[1], dv, dtype=torch.float32)
    lse = q.new_full((q.shape[0], q.shape[1]), NEG_INF, dtype=torch.float32)
    for group in meta.groups:
        assert group_attention is not None
        og, lg = group_attention(group)
        rows = group.token_idx[group.token_valid]
        out[rows], lse[rows] = og[group.token_valid].float(), lg[group.token_valid]
    for row in meta.rows:
        rows = slice(row.token_start, row.token_start + row.num_queries)
        out[rows], lse[rows] = row_attention(row, q[rows])
    return out, lse

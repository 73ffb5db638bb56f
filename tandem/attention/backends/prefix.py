"""The shared core of the paged backends: write this step's K/V, then attend over each row's causal prefix
read from the cache.

Short rows (decodes, verification rows) on the CPU read their keys in place: a request's blocks are mostly
allocated back to back, so its keys are a few contiguous slot runs, each a view of the cache that the score and
value matmuls read directly (RowKeys). Copying every row's whole prefix out of the cache per layer per step
(a padded gather, the fallback off the CPU and at short contexts) costs as much as the attention itself at a
few thousand keys and several times more at 32k (`tandem bench decode`). Long rows gather their keys
once per layer and attend them as prefix + causal diagonal (tandem/attention/causal_rows.py).

Cascade attention: when the short rows share their first blocks (a prefix-cache hit, metadata.SharedPrefix), every
short-row query attends those keys in one call (each key read once a layer, not once a row), each row attends only
its own keys after them, and the two parts merge by log-sum-exp. At 32 rows of a 700-token few-shot prefix this is
~10x less attention work a layer than reading the prefix once per row.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from tandem import native
from tandem.attention.backend import AttentionBackend
from tandem.attention.batch import AttentionBatch
from tandem.attention.causal_rows import attention_with_lse, causal_row_attention, merge_attn_states
from tandem.attention.kv_dtype import store_rows
from tandem.attention.kv_ownership import owned_metadata
from tandem.attention.metadata import AttentionMetadata, RowKeys, SharedPrefix, gather_rows, plan_batch, select_rows
from tandem.attention.sharded_kv import ShardedAttentionMetadata


def paged_metadata(backend: type[AttentionBackend],
                   batch: AttentionBatch) -> AttentionMetadata | ShardedAttentionMetadata:
    """The paged backends' own metadata of a batch: its CPU plan, or under sharded KV its rows over the keys this
    rank owns (the layer then calls the sharded forward, which reads only that)."""
    if batch.kv_shard is not None:
        return owned_metadata(batch)
    return plan_batch(batch, backend)


def write_kv(cache_flat: torch.Tensor, new: torch.Tensor, meta: AttentionBatch | ShardedAttentionMetadata) -> None:
    # cache_flat: [num_slots, ...]; new: [num_tokens, ...]. Any metadata with write_rows / write_slots (the Triton
    # backends' TritonMetadata too)
    if not meta.write_rows.numel():
        return
    # a step writes all its rows in order (one rank, no padding): new's leading rows as they lie, not a gathered copy
    leading = write_rows_leading(meta)
    rows = new[:leading] if leading is not None else new[meta.write_rows]
    store_rows(cache_flat, meta.write_slots, rows.to(cache_flat.dtype))


def write_rows_leading(meta: AttentionBatch | ShardedAttentionMetadata) -> int | None:
    """n when meta.write_rows is 0, 1, ..., n - 1 (checked once per metadata, on the CPU only: a device tensor would
    need a sync), else None."""
    cached = meta.__dict__.get("_write_rows_leading", ())
    if cached != () and cached[0] is meta.write_rows:
        return cached[1]
    rows, leading = meta.write_rows, None
    if rows.device.type == "cpu" and rows.numel() and int(rows[0]) == 0 and int(rows[-1]) == rows.numel() - 1 \
            and (rows.numel() < 2 or bool((rows[1:] > rows[:-1]).all())):
        leading = rows.numel()
    meta.__dict__["_write_rows_leading"] = (rows, leading)
    return leading


def prefix_attention(q: torch.Tensor, k_flat: torch.Tensor, v_flat: torch.Tensor | None, meta: AttentionMetadata,
                     scale: float, value_dims: int | None = None, long_rows: bool = True) -> torch.Tensor:
    """q: [T, Hq, Dk]; k_flat: [num_slots, Hkv, Dk]; v_flat: [num_slots, Hkv, Dv] -> [T, Hq, Dv].
    `value_dims` instead of v_flat: the values are the keys' first value_dims channels (MLA's latent cache),
    so a key is read once for both. `long_rows=False`: only the short rows (their output rows; others zero)."""
    dv = value_dims if v_flat is None else v_flat.shape[-1]
    assert dv is not None
    out, lse = own_key_attention(q, k_flat, v_flat, meta, scale, dv, long_rows)
    shared = meta.shared_prefix
    if shared is None:
        return out
    assert lse is not None
    short = shared.token_idx
    if short is None:
        return _merge_shared_prefix(q, out, lse, k_flat, v_flat, shared, scale, dv)
    out[short] = _merge_shared_prefix(q[short], out[short], lse[short], k_flat, v_flat, shared, scale, dv)
    return out


def own_key_attention(q: torch.Tensor, k_flat: torch.Tensor, v_flat: torch.Tensor | None, meta: AttentionMetadata,
                      scale: float, dv: int, long_rows: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """prefix_attention without the shared prefix (meta.shared_prefix): every row over its own keys -> (out
    [T, Hq, Dv]; the short rows' LSE [T, Hq] float32 when the step has a shared prefix to merge, else None).
    The caller merges the prefix's part (MLA may attend it expanded: tandem/attention/expanded_prefix.py)."""
    groups, shared = meta.groups, meta.shared_prefix  # (no groups when the native kernel takes the short rows)
    if len(groups) == 1 and groups[0].covers_all(q.shape[0]):  # one dense group: its output is the whole output
        g = groups[0]
        kg = gather_rows(k_flat, g.kv_slots).to(q.dtype)  # [G, S, Hkv, Dk]
        vg = kg[..., :dv] if v_flat is None else gather_rows(v_flat, g.kv_slots).to(q.dtype)
        qg = q.view(*g.token_idx.shape, *q.shape[1:])
        if shared is None:
            return grouped_sdpa(qg, kg, vg, g.mask, scale, g.blocked).flatten(0, 1), None
        og, lg = grouped_sdpa_lse(qg, kg, vg, scale, g.blocked)
        return og.flatten(0, 1), lg.flatten(0, 1)
    if meta.native_rows is not None:  # the short rows read in place by the native CPU kernel
        out, lse = native_short_rows(q, k_flat, v_flat, meta, meta.native_rows, scale, dv)
    else:
        out = q.new_zeros(q.shape[0], q.shape[1], dv)
        lse = None if shared is None else torch.full(q.shape[:2], float("-inf"), device=q.device)  # [T, Hq]
    for g in groups:
        kg = gather_rows(k_flat, g.kv_slots).to(q.dtype)  # [G, S, Hkv, Dk]
        vg = kg[..., :dv] if v_flat is None else gather_rows(v_flat, g.kv_slots).to(q.dtype)  # [G, S, Hkv, Dv]
        rows = g.token_idx[g.token_valid]
        if lse is None:
            og = grouped_sdpa(gather_rows(q, g.token_idx), kg, vg, g.mask, scale, g.blocked)  # [G, Q, Hq, Dv]
        else:
            og, lg = grouped_sdpa_lse(gather_rows(q, g.token_idx), kg, vg, scale, g.blocked)
            lse[rows] = lg[g.token_valid]
        out[rows] = og[g.token_valid]
    for row in meta.row_keys or ():
        rows = slice(row.token_start, row.token_start + row.num_queries)
        o_row, l_row = in_place_row_attention(q[rows], k_flat, v_flat, row, scale, dv, with_lse=lse is not None)
        out[rows] = o_row
        if lse is not None:
            lse[rows] = l_row
    native_long = long_rows and meta.native_long_rows is not None
    if native_long:  # prompt rows of a GQA model whole through the native kernel, written into `out` in place
        assert meta.native_long_rows is not None
        if out.stride(-1) == 1:
            _native_rows_into(q, k_flat, v_flat, meta, meta.native_long_rows, scale, dv, out)
        else:  # the kernel writes rows with a contiguous last dimension: through a buffer
            o_long = _native_rows_into(q, k_flat, v_flat, meta, meta.native_long_rows, scale, dv,
                                       torch.zeros_like(out, memory_format=torch.contiguous_format))
            long_tokens = torch.cat([torch.arange(t0, t0 + n) for t0, n in meta.native_long_rows[:, 1:3].tolist()])
            out[long_tokens] = o_long[long_tokens]
    for lr in meta.long_rows if long_rows else ():
        if native_long and lr.native:
            continue
        kg = gather_rows(k_flat, lr.kv_slots).to(q.dtype).transpose(0, 1)  # [Hkv, S, Dk], once for all pieces
        vg = kg[..., :dv] if v_flat is None else gather_rows(v_flat, lr.kv_slots).to(q.dtype).transpose(0, 1)
        for p in lr.pieces:
            rows = slice(p.token_start, p.token_start + p.num_queries)
            out[rows] = causal_row_attention(q[rows].transpose(0, 1), kg[:, : p.seq_len], vg[:, : p.seq_len],
                                             scale).transpose(0, 1)
    return out, lse


def native_short_rows(q: torch.Tensor, k_flat: torch.Tensor, v_flat: torch.Tensor | None, meta: AttentionMetadata,
                      rows: torch.Tensor, scale: float, dv: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The short rows through the native kernel -> (out [T, Hq, Dv], zero at other tokens; lse [T, Hq] float32
    when a shared prefix is to be merged, else None). The kernel reads the cache in its own dtype (kv_cache_dtype)
    and computes in float32."""
    out = q.new_zeros(q.shape[0], q.shape[1], dv)
    lse = torch.full(q.shape[:2], float("-inf"), dtype=torch.float32)  # [T, Hq]
    _native_rows_into(q, k_flat, v_flat, meta, rows, scale, dv, out, lse)
    return out, None if meta.shared_prefix is None else lse


def _native_rows_into(q: torch.Tensor, k_flat: torch.Tensor, v_flat: torch.Tensor | None, meta: AttentionMetadata,
                      rows: torch.Tensor, scale: float, dv: int, out: torch.Tensor,
                      lse: torch.Tensor | None = None) -> torch.Tensor:
    """The kernel's rows written into out [T, Hq, Dv] (q's dtype) and lse [T, Hq] at their tokens; the other tokens
    keep their values. -> out"""
    values = k_flat[..., :dv] if v_flat is None else v_flat
    if lse is None:
        lse = torch.empty(q.shape[:2], dtype=torch.float32)  # written at the rows' tokens, unused
    native.paged_attention(q, k_flat, values, meta.block_table, rows, kernel_positions(meta, q.shape[0]),
                           meta.block_size, scale, out, lse)
    return out


def kernel_positions(meta: AttentionMetadata, num_tokens: int) -> torch.Tensor:
    """meta's positions as the native kernel reads them: [num_tokens] int64, contiguous."""
    positions = meta.positions if meta.positions.dtype == torch.int64 else meta.positions.long()
    if positions.shape[0] < num_tokens:  # graph padding after the rows (MTP's padded draft decodes): in no row
        positions = torch.cat((positions, positions.new_zeros(num_tokens - positions.shape[0])))
    return positions.contiguous()


def _merge_shared_prefix(q: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, k_flat: torch.Tensor,
                         v_flat: torch.Tensor | None, shared: SharedPrefix, scale: float, dv: int) -> torch.Tensor:
    """q: [T, Hq, Dk] short-row queries; out, lse: [T, Hq, Dv], [T, Hq] their attention over their own keys ->
    [T, Hq, Dv] over the shared prefix too. The prefix's keys are one view of the cache when its blocks are
    consecutive, else gathered once; the r query heads of a KV head are folded into the query axis, so one flash
    call sees every query of the step (MLA: the values are the keys, whose first dv channels are kv_c)."""
    t = q.shape[0]
    keys = shared.keys(k_flat)  # [P, Hkv, Dk]
    values = keys if v_flat is None else shared.keys(v_flat)
    o_pre, lse_pre = attention_with_lse(fold_heads(q, keys.shape[1])[None], keys.to(q.dtype).transpose(0, 1)[None],
                                        values.to(q.dtype).transpose(0, 1)[None], scale, causal=False)
    o_pre = unfold_heads(o_pre[0, ..., :dv], t)  # [T, Hq, Dv]
    lse_pre = unfold_heads(lse_pre[0, ..., None], t)[..., 0]  # [T, Hq]
    merged, _ = merge_attn_states(out, lse, o_pre, lse_pre)
    return merged


def in_place_row_attention(q: torch.Tensor, k_flat: torch.Tensor, v_flat: torch.Tensor | None, row: RowKeys,
                           scale: float, dv: int, with_lse: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One short row: q [n, Hq, Dk] over its RowKeys -> ([n, Hq, Dv], with_lse: its LSE [n, Hq] float32, else
    None). The r query heads of a KV head are folded into the query axis, as grouped_sdpa does; the run keys are
    matmul operands as they lie in the cache."""
    n, hq, _ = q.shape
    hkv = k_flat.shape[1]
    r = hq // hkv
    qf = fold_heads(q, hkv)  # [Hkv, r * n, Dk]
    tail_k = select_rows(k_flat, row.tail_slots)
    keys = [k_flat[a: a + m] for a, m in row.runs] + [tail_k]  # each [s, Hkv, Dk]
    if v_flat is None:
        values = [k[..., :dv] for k in keys]
    else:
        values = [v_flat[a: a + m] for a, m in row.runs] + [select_rows(v_flat, row.tail_slots)]
    scores = torch.cat([small_matmul(qf, k.to(q.dtype).permute(1, 2, 0)) for k in keys], dim=-1).mul_(scale)
    if n > 1:  # the row's own n tokens are the last n keys: query i sees the first i + 1 of them
        blocked = torch.ones(n, n, dtype=torch.bool, device=q.device).triu_(1)
        scores.view(hkv, r, n, -1)[..., -n:].masked_fill_(blocked, float("-inf"))
    lse = None
    if with_lse:
        lse = scores.float().logsumexp(-1)  # [Hkv, r * n]
        probs = (scores.float() - lse[..., None]).exp().to(q.dtype)
    else:
        probs = scores.softmax(-1)  # [Hkv, r * n, S]
    out, off = None, 0
    for v in values:
        part = probs[..., off: off + v.shape[0]]
        vt = v.to(q.dtype).transpose(0, 1)  # [Hkv, s, Dv]: the run's values
        if out is None:
            out = small_matmul(part, vt)
        elif out.dtype == torch.float32:
            out.baddbmm_(part, vt)
        else:
            out.add_(small_matmul(part, vt))
        off += v.shape[0]
    assert out is not None
    return unfold_heads(out, n), None if lse is None else unfold_heads(lse[..., None], n)[..., 0]


def grouped_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
                 blocked: torch.Tensor | None) -> torch.Tensor:
    """q: [G, Q, Hq, Dk]; k: [G, S, Hkv, Dk]; v: [G, S, Hkv, Dv]; mask: [G, 1, Q, S] -> [G, Q, Hq, Dv].
    `blocked`: ~mask, as the metadata precomputed it once a step (None: nothing is masked).

    The r = Hq / Hkv query heads that share a KV head are folded into the query axis ([G, Hkv, r * Q, Dk], the
    mask tiled r times): SDPA's own enable_gqa path on CPU is ~20x slower for decodes, and MLA's absorbed
    decode is MQA with r = every head."""
    G, Q, hq, _ = q.shape
    hkv = k.shape[2]
    r = hq // hkv
    qf = fold_heads(q, hkv)  # [G, Hkv, r * Q, Dk]
    k, v = k.transpose(1, 2), v.transpose(1, 2)  # [G, Hkv, S, D*]: views of the row-major gathered keys
    head_major = (G >= HEAD_MAJOR_MIN_ROWS and q.dtype in HEAD_MAJOR_DTYPES and q.device.type == "cpu")
    if r * Q <= SMALL_QUERY_ROWS and (hkv == 1 or head_major):
        # Two batched matmuls beat CPU SDPA's flash kernel at a few query rows (every query row sees at least one
        # key, so no row is all -inf): MQA decodes and verification rows (MLA's absorbed path, ~5x); and several KV
        # heads in bf16/fp16 over many rows, where the kernel converts every block to float32 and pays its tiling,
        # after one head-major copy of K and V (SmolLM2 bf16, 32 decode rows x 130 keys x 3 KV heads, avx512_bf16:
        # 0.84 -> 0.67 ms a layer, copies in). In float32, and over few rows (1 row: 207 vs 102 us), that copy costs
        # more than SDPA, which reads the strided views as they are (float32, 32 rows: 1.93 -> 0.92 ms a layer).
        if hkv > 1:
            k, v = k.contiguous(), v.contiguous()  # [G, Hkv, S, D*]
        scores = small_matmul(qf, k.transpose(-1, -2)).mul_(scale)  # [G, Hkv, r * Q, S]
        if blocked is not None:  # the r heads of a KV head share the mask: broadcast it, no tiling
            scores.view(G, hkv, r, Q, -1).masked_fill_(blocked.unsqueeze(2), float("-inf"))
        out = small_matmul(scores.float().softmax(-1).to(v.dtype), v)  # softmax in float32 (a no-op there)
    else:
        mask = mask.repeat(1, 1, r, 1) if r > 1 else mask  # folded query j * Q + i has row i's mask
        out = F.scaled_dot_product_attention(qf, k, v, attn_mask=mask, scale=scale)
    return unfold_heads(out, Q)


def grouped_sdpa_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                     blocked: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """grouped_sdpa by explicit scores, with the LSE a cascade merge needs: -> (out [G, Q, Hq, Dv], lse [G, Q, Hq]
    float32). Only the keys after a shared prefix come here, so the scores stay small."""
    G, Q, hq, _ = q.shape
    hkv = k.shape[2]
    r = hq // hkv
    qf = fold_heads(q, hkv)  # [G, Hkv, r * Q, Dk]
    scores = torch.matmul(qf, k.permute(0, 2, 3, 1)).float().mul_(scale)  # [G, Hkv, r * Q, S]
    if blocked is not None:
        scores.view(G, hkv, r, Q, -1).masked_fill_(blocked.unsqueeze(2), float("-inf"))
    lse = scores.logsumexp(-1)  # [G, Hkv, r * Q]
    out = torch.matmul((scores - lse[..., None]).exp().to(v.dtype), v.transpose(1, 2))
    return unfold_heads(out, Q), unfold_heads(lse[..., None], Q)[..., 0]


def small_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """torch.matmul(a, b) for a [..., M, K] and b [..., K, N]. A batch of one in bf16/fp16 on the CPU runs as one
    2-D mm: the batched bf16 kernel copies a strided operand (the cache's keys, read transposed) on every call, the
    2-D one reads it in place (MLA at batch 1, 1 x [4, 576] x [576, 1000]: 363 -> 92 us). float32 keeps matmul."""
    if a.dtype == torch.float32 or a.device.type != "cpu" or a.dim() < 3 or math.prod(a.shape[:-2]) != 1 \
            or math.prod(b.shape[:-2]) != 1:
        return torch.matmul(a, b)
    batch = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    return torch.mm(a.reshape(a.shape[-2:]), b.reshape(b.shape[-2:])).view(*batch, a.shape[-2], b.shape[-1])


def fold_heads(q: torch.Tensor, hkv: int) -> torch.Tensor:
    """[..., n, Hq, D] -> [..., Hkv, r * n, D]: the r = Hq / Hkv query heads of a KV head (head h = kv * r + j)
    folded into the query axis, so one matmul per KV head serves them all."""
    return q.unflatten(-2, (hkv, -1)).movedim(-4, -2).flatten(-3, -2)


def unfold_heads(x: torch.Tensor, n: int) -> torch.Tensor:
    """fold_heads's inverse on outputs: [..., Hkv, r * n, D] -> [..., n, Hq, D]."""
    return x.unflatten(-2, (-1, n)).movedim(-2, -4).flatten(-3, -2)


SMALL_QUERY_ROWS = 64
# dtypes whose few-query-row GQA attention runs as matmuls over a head-major copy of K and V (grouped_sdpa)
HEAD_MAJOR_DTYPES: tuple[torch.dtype, ...] = (torch.bfloat16, torch.float16)
HEAD_MAJOR_MIN_ROWS = 24  # ... and from this many rows a group on (micro, 120 keys: 16 rows 0.98x, 24 1.12x, 32 2x)



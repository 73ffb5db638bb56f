"""MLA cascade attention over a shared prefix in the expanded form, the expansion kept across steps.

Cascade attention (metadata.SharedPrefix) attends the keys that several short rows share once for all of their
queries. Absorbed, each score over a latent key costs 2 L + rope multiply-adds (1,088 at the bundled model's
L = 512, rope 64); expanded into per-head keys [k_nope | k_pe] and values it costs nope + rope + v (160), but the
expansion itself costs L (nope + v) H per key. A few-shot prefix stays the same for every decode step of a batch,
so it is expanded once per layer and the per-head keys and values are kept beside the cache: at 32 rows x 4 queries
(MTP K = 3 verification) x 4 heads over a 912-key prefix the prefix's attention falls from ~7.4 to ~1.8 ms a layer
(one CPU thread pair, float32, the expansion ~2.8 ms once).

The kept expansion lives with its layer (`KeptExpansion`, held by MLAAttention and handed to the backend as
MLAUpProjection.kept; a layer given a new cache starts it afresh), never in a module-global table. It is valid while
the prefix's cache slots hold what they held when it was built. Every write into a paged MLA cache goes through the
backend, which reports the slots it wrote (`note_writes`): a write into a kept
prefix's slots (its blocks freed, evicted and reused by another request) drops it. A prefix is expanded on its
second sighting in a row, so a prefix seen for one step only (rows that happen to meet once) is not expanded for
nothing; a prefix that grows (more whole blocks shared) expands only its new keys, one that shrinks is a view. A
prompt chunk whose keys start with a kept prefix (a new request hitting the cached few-shot prompt) reuses it too.
Bounded: at most MAX_BYTES a layer (DeepSeek-V3's 128 heads x (192 + 128) channels would be 160 KiB a key).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from tandem.attention.causal_rows import attention_with_lse, merge_attn_states
from tandem.attention.metadata import SharedPrefix
from tandem.attention.mla import MLAUpProjection, expand_latents

MAX_BYTES = 64 << 20  # per layer, keys and (padded) values together


@dataclass
class ExpandedPrefix:
    slots: torch.Tensor  # [P] int64 the cache slots of the prefix's keys, in position order
    keys: torch.Tensor  # [H, P, nope + rope]
    values: torch.Tensor  # [H, P, nope + rope]: v, zero-padded to the key width (the CPU flash kernel's need)
    v_dim: int
    weight: tuple[int, int]  # (data_ptr, version) of the kv_b weight it was expanded with

    @property
    def num_keys(self) -> int:
        return self.slots.shape[0]

    @functools.cached_property
    def slot_range(self) -> tuple[int, int]:
        """(lowest, highest) slot: note_writes's first test, computed once, not at every layer's write."""
        return int(self.slots.min()), int(self.slots.max())

    def reusable_by(self, row_slots: torch.Tensor) -> int:
        """The number of a long row's first keys this expansion holds (its slots start with ours), else 0."""
        n = self.num_keys
        if row_slots.shape[0] < n or not torch.equal(row_slots[:n], self.slots):
            return 0
        return n

    def as_shared(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(keys [P, H, nope + rope], values [P, H, v]): views in mla.long_row_attention's `shared` layout."""
        return self.keys.transpose(0, 1), self.values[..., : self.v_dim].transpose(0, 1)


@dataclass
class KeptExpansion:
    """One MLA layer's kept expansion, and a prefix it saw once and has not expanded yet."""

    prefix: ExpandedPrefix | None = None
    seen: torch.Tensor | None = None  # [P] slots of a prefix seen once, not yet expanded


def note_writes(up: MLAUpProjection, write_slots: torch.Tensor) -> None:
    """The backend wrote `write_slots` [W] int64 of up's layer's cache: a kept expansion over any of them is dropped."""
    entry = up.kept
    if entry is None or entry.prefix is None or not write_slots.numel():
        return
    lo, hi = entry.prefix.slot_range  # one range test first: a step's writes are rarely near the prefix
    inside = write_slots[(write_slots >= lo) & (write_slots <= hi)]
    if inside.numel() and bool(torch.isin(inside, entry.prefix.slots).any()):
        entry.prefix = None


def peek(up: MLAUpProjection, dtype: torch.dtype) -> ExpandedPrefix | None:
    """The layer's kept expansion as it stands (no sighting counted, nothing built), when it still matches the kv_b
    weights and dtype: for prompt chunks whose keys start with it."""
    kept = None if up.kept is None else up.kept.prefix
    if kept is None or kept.keys.dtype != dtype or kept.weight != (up.kv_b().data_ptr(), up.kv_b()._version):
        return None
    return kept


def lookup(cache_flat: torch.Tensor, shared: SharedPrefix, up: MLAUpProjection,
           dtype: torch.dtype) -> ExpandedPrefix | None:
    """The expansion of `shared`'s keys for up's layer, built or extended when it pays; None: attend them absorbed
    (also when the caller keeps no expansion: up.kept None). cache_flat: [num_slots, L + rope] the layer's latent
    cache (flattened)."""
    entry = up.kept
    if entry is None:
        return None
    heads, nope, lora = up.w_uk.shape
    rope = cache_flat.shape[-1] - lora
    width = nope + rope
    if shared.num_keys * heads * 2 * width * torch.finfo(dtype).bits // 8 > MAX_BYTES:
        return None
    weight = (up.kv_b().data_ptr(), up.kv_b()._version)
    kept = entry.prefix
    if kept is not None and (kept.weight != weight or kept.keys.dtype != dtype):
        kept = entry.prefix = None
    n = shared.num_keys
    if kept is not None and n <= kept.num_keys and torch.equal(kept.slots[:n], shared.slots):
        if n == kept.num_keys:
            return kept
        return ExpandedPrefix(shared.slots, kept.keys[:, :n], kept.values[:, :n], kept.v_dim, weight)
    grows = kept is not None and n > kept.num_keys and torch.equal(shared.slots[: kept.num_keys], kept.slots)
    if not grows:
        seen = entry.seen
        if seen is None or seen.shape != shared.slots.shape or not torch.equal(seen, shared.slots):
            entry.seen = shared.slots  # first sighting: attended absorbed this time
            return None
    start = kept.num_keys if grows and kept is not None else 0
    latent = shared.keys(cache_flat)[start:].to(dtype)  # [P - start, L + rope]
    v_dim = up.w_uv.shape[1]
    k, v = expand_latents(latent, up)  # [P', H, nope + rope], [P', H, v]
    keys = k.transpose(0, 1)
    values = torch.nn.functional.pad(v, (0, width - v_dim)).transpose(0, 1)  # [H, P', width]
    if grows and kept is not None:
        keys, values = torch.cat((kept.keys, keys), dim=1), torch.cat((kept.values, values), dim=1)
    entry.prefix = ExpandedPrefix(shared.slots, keys.contiguous(), values.contiguous(), v_dim, weight)
    entry.seen = None
    return entry.prefix


def merge_expanded_prefix(q_nope: torch.Tensor, q_pe: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                          shared: SharedPrefix, prefix: ExpandedPrefix, scale: float) -> torch.Tensor:
    """q_nope [T, H, nope], q_pe [T, H, rope] the step's queries; out [T, H, v], lse [T, H] their attention over
    their own keys (value space) -> out with the prefix's keys merged in at the member rows' tokens (in place there
    when the members are a subset)."""
    tokens = shared.token_idx
    if tokens is not None:
        q_nope, q_pe = q_nope[tokens], q_pe[tokens]
    q = torch.cat((q_nope, q_pe), dim=-1).transpose(0, 1)[None]  # [1, H, T', nope + rope]
    o_pre, lse_pre = attention_with_lse(q, prefix.keys[None], prefix.values[None], scale, causal=False)
    o_pre = o_pre[0, ..., : prefix.v_dim].transpose(0, 1)  # [T', H, v]
    lse_pre = lse_pre[0].transpose(0, 1)  # [T', H]
    if tokens is None:
        return merge_attn_states(out, lse, o_pre, lse_pre)[0]
    out[tokens] = merge_attn_states(out[tokens], lse[tokens], o_pre, lse_pre)[0]
    return out

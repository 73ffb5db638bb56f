"""MLA math shared by the MLA backends: the two ways to attend over a latent cache.

absorbed  (decodes): q_latent = q_nope W_UK; MQA of [q_latent | q_pe] over keys [kv_c | k_pe], values kv_c;
          out = o_latent W_UV^T. Per score: 2 L + rope multiply-adds, no per-key work.
expanded  (prompt chunks): k_nope = kv_c W_UK^T, v = kv_c W_UV^T per head, then plain MHA of
          [q_nope | q_pe] over [k_nope | k_pe]. Per score: nope + rope + v; per key: L (nope + v) H once.
Both give the same result up to float rounding; expanded is cheaper once a group has many queries.

A long row (Q queries at the end of S = p + Q keys, tandem/attention/causal_rows.py) is attended whichever
way costs fewer multiply-adds per layer (`prefers_expanded`), counting the scores a causal row computes,
Q p + Q^2 / 2 per head (the CPU flash kernel pads values to the key width, so both value widths below are
the key width):

    expanded  S H L (nope + v)       [expand every visible key once]  + scores H 2 (nope + rope)
    absorbed  Q H L (nope + v)       [absorb queries, up-project out] + scores H 2 (L + rope)

At DeepSeek-V3's head shapes (nope 128, rope 64, v 128, L 512) expanded wins from Q of about 170 up.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from tandem.attention.causal_rows import causal_row_attention
from tandem.attention.metadata import LongPiece

if TYPE_CHECKING:
    from tandem.attention.expanded_prefix import KeptExpansion


@dataclass(frozen=True)
class MLAUpProjection:
    w_uk: torch.Tensor  # [H, nope, L]
    w_uv: torch.Tensor  # [H, v, L]
    w_kv_b: torch.Tensor | None = None  # [H * (nope + v), L] kv_b_proj's weight, whose halves w_uk and w_uv are
    # the layer's kept expansion of a shared prefix (expanded_prefix.py), which lives as long as the layer's cache;
    # None: nothing is kept
    kept: KeptExpansion | None = None

    def kv_b(self) -> torch.Tensor:
        if self.w_kv_b is not None:
            return self.w_kv_b
        return torch.cat((self.w_uk, self.w_uv), dim=1).flatten(0, 1)


def absorb(q_nope: torch.Tensor, q_pe: torch.Tensor, up: MLAUpProjection) -> torch.Tensor:
    # [T, H, nope], [T, H, rope] -> absorbed queries [T, H, L + rope]; one batched matmul over heads (einsum's
    # planning costs more than the product itself at decode sizes)
    q_latent = torch.matmul(q_nope.transpose(0, 1), up.w_uk).transpose(0, 1)  # [T, H, L]
    return torch.cat((q_latent, q_pe), dim=-1)


def up_project(o_latent: torch.Tensor, up: MLAUpProjection) -> torch.Tensor:
    # [T, H, L] -> [T, H, v]
    return torch.matmul(o_latent.transpose(0, 1), up.w_uv.transpose(1, 2)).transpose(0, 1)


def prefers_expanded(num_queries: int, seq_len: int, up: MLAUpProjection, rope: int, num_shared: int = 0,
                     num_sharing: int = 1) -> bool:
    """The cost formula of the module docstring: True when expanding the row's keys costs fewer multiply-adds.
    `num_shared`: its first keys are a prefix that `num_sharing` rows share and expand once for all (a row is
    charged its share of that expansion)."""
    heads, nope, lora = up.w_uk.shape
    v = up.w_uv.shape[1]
    scores = heads * (num_queries * (seq_len - num_queries) + num_queries * num_queries / 2)
    expanded_keys = seq_len - num_shared + num_shared / max(num_sharing, 1)
    expanded = expanded_keys * heads * lora * (nope + v) + scores * 2 * (nope + rope)
    absorbed = num_queries * heads * lora * (nope + v) + scores * 2 * (lora + rope)
    return expanded < absorbed


def expand_latents(latent: torch.Tensor, up: MLAUpProjection) -> tuple[torch.Tensor, torch.Tensor]:
    """latent [S, L + rope] -> per-head keys [S, H, nope + rope] and values [S, H, v] (one GEMM)."""
    heads, nope, lora = up.w_uk.shape
    kv = torch.matmul(latent[:, :lora], up.kv_b().t()).view(-1, heads, nope + up.w_uv.shape[1])
    k_pe = latent[:, None, lora:].expand(-1, heads, -1)
    return torch.cat((kv[..., :nope], k_pe), dim=-1), kv[..., nope:]


def long_row_attention(q_nope: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor, pieces: Sequence[LongPiece],
                       scale: float, up: MLAUpProjection, expanded: bool, out: torch.Tensor,
                       shared: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    """One request's long pieces: q_nope [T, H, nope], q_pe [T, H, rope] (the step's tokens), latent [S, L + rope]
    its keys; writes out[piece's tokens] = [Q, H, v]. Each key is read (and, expanded, up-projected) once per
    layer, however many pieces see it. `shared` (expanded only): the expanded keys and values of the first P keys,
    which other requests' rows share (metadata.long_prefix) and which were expanded once for all of them; latent
    then holds keys P.. only."""
    heads, nope, lora = up.w_uk.shape
    if expanded:
        k, v = expand_latents(latent, up)  # [S', H, nope + rope], [S', H, v]
        if shared is not None:
            k, v = torch.cat((shared[0], k)), torch.cat((shared[1], v))
        k, v = k.transpose(0, 1), v.transpose(0, 1)  # [H, S, nope + rope], [H, S, v]
        for p in pieces:
            rows = slice(p.token_start, p.token_start + p.num_queries)
            q = torch.cat((q_nope[rows], q_pe[rows]), dim=-1).transpose(0, 1)  # [H, Q, nope + rope]
            out[rows] = causal_row_attention(q, k[:, : p.seq_len], v[:, : p.seq_len], scale).transpose(0, 1)
        return
    lat = latent[None]  # [1, S, L + rope]: MQA; the values are the keys (their first L channels are kv_c)
    for p in pieces:
        rows = slice(p.token_start, p.token_start + p.num_queries)
        q = absorb(q_nope[rows], q_pe[rows], up).transpose(0, 1).contiguous()  # [H, Q, L + rope]
        keys = lat[:, : p.seq_len]
        o_latent = causal_row_attention(q, keys, keys, scale)[..., :lora]  # [H, Q, L]
        out[rows] = up_project(o_latent.transpose(0, 1), up)


def expanded_attention(q_nope: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor, mask: torch.Tensor,
                       scale: float, up: MLAUpProjection) -> torch.Tensor:
    """q_nope: [G, Q, H, nope]; q_pe: [G, Q, H, rope]; latent: [G, S, L + rope]; mask: [G, 1, Q, S] -> [G, Q, H, v]."""
    lora = up.w_uk.shape[-1]
    kv_c, k_pe = latent[..., :lora], latent[..., lora:]
    k_nope = torch.einsum("gsl,hdl->ghsd", kv_c, up.w_uk)  # [G, H, S, nope]
    v = torch.einsum("gsl,hvl->ghsv", kv_c, up.w_uv)  # [G, H, S, v]
    k = torch.cat((k_nope, k_pe[:, None].expand(-1, k_nope.shape[1], -1, -1)), dim=-1)  # [G, H, S, nope + rope]
    q = torch.cat((q_nope, q_pe), dim=-1).transpose(1, 2)  # [G, H, Q, nope + rope]
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)  # [G, H, Q, v]
    return out.transpose(1, 2)

"""MLA math shared by the MLA backends: the two ways to attend over a latent cache.

absorbed  (decodes): q_latent = q_nope W_UK; MQA of [q_latent | q_pe] over keys [kv_c | k_pe], values kv_c;
          out = o_latent W_UV^T. Per score: 2 L + rope multiply-adds, no per-key work.
expanded  (prompt chunks): k_nope = kv_c W_UK^T, v = kv_c W_UV^T per head, then plain MHA of
          [q_nope | q_pe] over [k_nope | k_pe]. Per score: nope + rope + v; per key: L (nope + v) H once.
Both give the same result up to float rounding; expanded is cheaper once a group has many queries.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tandem.attention.metadata import PrefixGroup, gather_rows


@dataclass(frozen=True)
class MLAUpProjection:
    w_uk: torch.Tensor  # [H, nope, L]
    w_uv: torch.Tensor  # [H, v, L]


def absorb(q_nope: torch.Tensor, q_pe: torch.Tensor, up: MLAUpProjection) -> torch.Tensor:
    # [T, H, nope], [T, H, rope] -> absorbed queries [T, H, L + rope]; one batched matmul over heads (einsum's
    # planning costs more than the product itself at decode sizes)
    q_latent = torch.matmul(q_nope.transpose(0, 1), up.w_uk).transpose(0, 1)  # [T, H, L]
    return torch.cat((q_latent, q_pe), dim=-1)


def up_project(o_latent: torch.Tensor, up: MLAUpProjection) -> torch.Tensor:
    # [T, H, L] -> [T, H, v]
    return torch.matmul(o_latent.transpose(0, 1), up.w_uv.transpose(1, 2)).transpose(0, 1)


def expanded_group_attention(q_nope: torch.Tensor, q_pe: torch.Tensor, entries: torch.Tensor, g: PrefixGroup,
                             scale: float, up: MLAUpProjection) -> torch.Tensor:
    """One prefix group in expanded form. entries: [num_slots, L + rope] latent cache -> [G, Q, H, v]."""
    latent = gather_rows(entries, g.kv_slots).to(q_nope.dtype)  # [G, S, L + rope]
    return expanded_attention(gather_rows(q_nope, g.token_idx), gather_rows(q_pe, g.token_idx), latent, g.mask,
                              scale, up)


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

"""Sampling one draft token per row, shared by the model drafters (MTP, DSpark).

Greedy drafts take the argmax; probabilistic ones sample the request's processed distribution with keyed
noise of their own stream (DRAFT_STREAM, so a draft never reuses the randomness of its own verification)
and keep that distribution as q for the rejection sampler.
"""

from __future__ import annotations

import torch

from tandem import native
from tandem.layers.sampler import SamplingMetadata, keyed_uniform, processed_probs
from tandem.spec_decode.rejection_sampler import DRAFT_STREAM


def sample_draft(logits: torch.Tensor, meta: SamplingMetadata | None, positions: torch.Tensor,
                 probabilistic: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """logits: [S, V]; positions: [S] of the drafts -> (drafts [S], the distribution q [S, V] they were drawn from).

    Greedy drafts take the argmax; probabilistic ones sample the request's processed distribution with keyed
    noise of their own stream (DRAFT_STREAM) and keep it as q for verification (same rule as MTPProposer)."""
    if not probabilistic or meta is None:
        return native.greedy_tokens(logits), None
    probs = processed_probs(logits, meta)  # [S, V]
    greedy = meta.temperature == 0
    probs = torch.where(greedy[:, None], torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float(),
                        probs)
    noise = -torch.log(keyed_uniform(meta.seeds, positions, logits.shape[-1], stream=DRAFT_STREAM))
    return (probs.double() / noise).argmax(dim=-1), probs


def pack_drafts(drafts: list[torch.Tensor], probs: list[torch.Tensor | None], probabilistic: bool
                ) -> tuple[list[list[int]], list[torch.Tensor] | None]:
    """K steps of [S] drafts (and [S, V] distributions) -> per row its K drafts, and its [K, V] distributions."""
    per_row = torch.stack(drafts, dim=1).tolist()  # [S, K]
    if not probabilistic:
        return per_row, None
    return per_row, list(torch.stack(probs, dim=1).unbind(0))  # type: ignore[arg-type]  # S x [K, V]

"""Sampling from logits with temperature, top-k, top-p and min-p; greedy rows take the argmax.

All randomness is keyed by (request seed, position of the sampled token): each row draws
exponential noise E[v] from a counter-based hash of (seed, position, v) and takes
argmax(p[v] / E[v]) (the exponential race, an exact sample from p). Any rank, any batch
composition and any replay after preemption reproduces the same token without communication.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem import native

_MASK64 = (1 << 64) - 1


def _i64(x: int) -> int:
    x &= _MASK64
    return x - (1 << 64) if x >= 1 << 63 else x


_C1, _C2, _GOLDEN = _i64(0xBF58476D1CE4E5B9), _i64(0x94D049BB133111EB), _i64(0x9E3779B97F4A7C15)


def _srl(x: torch.Tensor, k: int) -> torch.Tensor:
    # logical right shift of int64 (torch's >> is arithmetic)
    return (x >> k) & ((1 << (64 - k)) - 1)


def _mix(x: torch.Tensor) -> torch.Tensor:
    # splitmix64 finaliser, with int64 wrap-around multiplication
    x = (x ^ _srl(x, 30)) * _C1
    x = (x ^ _srl(x, 27)) * _C2
    return x ^ _srl(x, 31)


def keyed_uniform(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int, stream: int = 0) -> torch.Tensor:
    """[S] seeds, [S] positions -> [S, V] float64 uniforms in (0, 1), a pure function of its inputs.

    `stream` selects an independent sequence for the same (seed, position): 0 is token sampling,
    1 speculative-decoding acceptance; stream 0 keeps the original key so existing draws never change.
    """
    row = _mix(_mix(seeds.long() * _GOLDEN + 0x632BE5AB) ^ positions.long())  # [S]
    if stream:
        row = _mix(row ^ _i64(stream * _GOLDEN))
    cols = torch.arange(vocab_size, dtype=torch.int64, device=seeds.device) * _GOLDEN
    bits = _srl(_mix(row[:, None] + cols[None, :]), 11)  # [S, V], 53 random bits
    return (bits.double() + 0.5) * (1.0 / (1 << 53))


@dataclass
class SamplingMetadata:
    temperature: torch.Tensor  # [S] float32, 0 = greedy
    top_k: torch.Tensor  # [S] int64, 0 = off
    top_p: torch.Tensor  # [S] float32, 1 = off
    min_p: torch.Tensor  # [S] float32, 0 = off
    seeds: torch.Tensor  # [S] int64
    positions: torch.Tensor  # [S] int64, position of the token being sampled
    max_num_logprobs: int | None
    all_greedy: bool


def processed_probs(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """The distribution a non-greedy row samples from: [S, V] float32 logits -> [S, V] probs."""
    temp = torch.where(meta.temperature > 0, meta.temperature, 1.0)
    logits = logits / temp[:, None]
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab, device=logits.device)[None, :]
    k = torch.where(meta.top_k > 0, meta.top_k.clamp(max=vocab), vocab)
    remove = ranks >= k[:, None]
    sorted_probs = sorted_logits.masked_fill(remove, float("-inf")).softmax(dim=-1)
    # top-p keeps the smallest prefix whose mass reaches p (the first token always stays)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    # ranks > 0: a top_p that underflows to 0 in float32 (1e-46) must still keep the top token
    remove |= (mass_before >= meta.top_p[:, None]) & (ranks > 0)
    sorted_probs = sorted_logits.masked_fill(remove, float("-inf")).softmax(dim=-1)
    remove |= sorted_probs < meta.min_p[:, None] * sorted_probs[:, :1]
    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    filtered = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    return filtered.softmax(dim=-1)


def sample(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """[S, V] float32 logits -> [S] int64 token ids."""
    greedy = native.greedy_tokens(logits)
    if meta.all_greedy:
        return greedy
    probs = processed_probs(logits, meta).double()
    noise = -torch.log(keyed_uniform(meta.seeds, meta.positions, logits.shape[-1]))  # Exp(1)
    sampled = (probs / noise).argmax(dim=-1)
    return torch.where(meta.temperature > 0, sampled, greedy)


def top_logprobs(logits: torch.Tensor, tokens: torch.Tensor, num: int) -> list[dict[int, float]]:
    """Raw-model logprobs: the top-`num` entries plus the sampled token, per row."""
    logprobs = logits.log_softmax(dim=-1)
    top_vals, top_ids = logprobs.topk(num, dim=-1) if num else (logprobs[:, :0], tokens[:, None][:, :0])
    chosen = logprobs.gather(-1, tokens[:, None]).squeeze(-1)
    rows = []
    for i in range(logits.shape[0]):
        entry = dict(zip(top_ids[i].tolist(), top_vals[i].tolist(), strict=True))
        entry[int(tokens[i])] = float(chosen[i])
        rows.append(entry)
    return rows

"""The EAGLE-3 draft head as trained: one Llama decoder layer over cat(embed, hidden), the training-time-test
(TTT) unroll, and the step-0 logits the inference side must reproduce.
Scope: the module and its forward views; data, loss and the checkpoint format live in sibling files.

TTT worked example (one sequence, D = 3 steps, index t):
    step 0: position t,   id x[t+1], hidden fc(aux[t])        keys: step-0 K at indices <= t
    step 1: position t+1, id x[t+2], hidden prenorm_0[t]      keys: step-0 K <= t, step-1 K at t
    step 2: position t+2, id x[t+3], hidden prenorm_1[t]      keys: step-0 K <= t, step-1 K at t, step-2 K at t
Step j is what inference's draft decode j computes after the drafts 1..j were accepted (they equal x[t+2..t+1+j]);
its keys at t for steps >= 1 are the "diagonal" caches: the draft decodes' own keys at positions t+1..t+j.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class HeadShape:
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    num_aux_layers: int
    draft_vocab_size: int


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # in float32 as Llama does, whatever the activation dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class SelfAttention(nn.Module):
    def __init__(self, s: HeadShape):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = s.num_attention_heads, s.num_key_value_heads, s.head_dim
        self.q_proj = nn.Linear(2 * s.hidden_size, s.num_attention_heads * s.head_dim, bias=False)
        self.k_proj = nn.Linear(2 * s.hidden_size, s.num_key_value_heads * s.head_dim, bias=False)
        self.v_proj = nn.Linear(2 * s.hidden_size, s.num_key_value_heads * s.head_dim, bias=False)
        self.o_proj = nn.Linear(s.num_attention_heads * s.head_dim, s.hidden_size, bias=False)


class MLP(nn.Module):
    def __init__(self, s: HeadShape):
        super().__init__()
        self.gate_proj = nn.Linear(s.hidden_size, s.intermediate_size, bias=False)
        self.up_proj = nn.Linear(s.hidden_size, s.intermediate_size, bias=False)
        self.down_proj = nn.Linear(s.intermediate_size, s.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MidLayer(nn.Module):
    def __init__(self, s: HeadShape):
        super().__init__()
        self.self_attn = SelfAttention(s)
        self.mlp = MLP(s)
        self.input_layernorm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.hidden_norm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(s.hidden_size, s.rms_norm_eps)


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """x: [B, T, heads, D]; positions: [B, T] -> x rotated (Llama's rotate_half layout)."""
    d = x.shape[-1]
    inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))  # [D/2]
    angles = positions.float()[..., None] * inv_freq  # [B, T, D/2]
    cos = torch.cat((angles.cos(), angles.cos()), -1)[:, :, None, :]  # [B, T, 1, D]
    sin = torch.cat((angles.sin(), angles.sin()), -1)[:, :, None, :]
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    rotated = torch.cat((-x2, x1), dim=-1)
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)


class DraftHead(nn.Module):
    """Parameter names match the checkpoint (`midlayer.*`, `fc`, `norm`, `lm_head`); the target's embedding is
    passed in, frozen, never owned."""

    def __init__(self, s: HeadShape):
        super().__init__()
        self.shape = s
        self.fc = nn.Linear(s.num_aux_layers * s.hidden_size, s.hidden_size, bias=False)
        self.midlayer = MidLayer(s)
        self.norm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.lm_head = nn.Linear(s.hidden_size, s.draft_vocab_size, bias=False)

    def _qkv(self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        # embeds, hidden: [B, T, H]; positions: [B, T] -> q [B, heads, T, D], k/v [B, heads, T, D] (GQA expanded)
        layer, attn = self.midlayer, self.midlayer.self_attn
        a = torch.cat((layer.input_layernorm(embeds), layer.hidden_norm(hidden)), dim=-1)  # [B, T, 2H]
        b, t, _ = a.shape
        q = rope(attn.q_proj(a).view(b, t, attn.num_heads, attn.head_dim), positions, self.shape.rope_theta)
        k = rope(attn.k_proj(a).view(b, t, attn.num_kv_heads, attn.head_dim), positions, self.shape.rope_theta)
        v = attn.v_proj(a).view(b, t, attn.num_kv_heads, attn.head_dim)
        group = attn.num_heads // attn.num_kv_heads
        k, v = (x.repeat_interleave(group, dim=2).transpose(1, 2) for x in (k, v))
        return q.transpose(1, 2), k, v

    def _finish(self, attn_out: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        # attn_out: [B, heads, T, D]; residual: [B, T, H] -> prenorm [B, T, H] (the next step's hidden)
        b, _, t, _ = attn_out.shape
        r2 = self.midlayer.self_attn.o_proj(attn_out.transpose(1, 2).reshape(b, t, -1)) + residual
        return self.midlayer.mlp(self.midlayer.post_attention_layernorm(r2)) + r2

    def ttt(self, embed: torch.Tensor, aux: torch.Tensor, input_ids: torch.Tensor, num_steps: int,
            ) -> list[torch.Tensor]:
        """The unrolled training-time test over right-padded rows.

        embed: [V, H] the target's embedding; aux: [B, T, A*H]; input_ids: [B, T + num_steps - 1] where
        input_ids[:, t + j] is step j's id at index t (x[t+1+j]; anything past a row's end is never used by a
        valid label). Returns per step logits [B, T, draft_vocab]."""
        return [self.lm_head(self.norm(h)) for h in self.ttt_hidden(embed, aux, input_ids, num_steps)]

    def ttt_hidden(self, embed: torch.Tensor, aux: torch.Tensor, input_ids: torch.Tensor, num_steps: int,
                   ) -> list[torch.Tensor]:
        """As ttt, but per step the pre-norm hidden state [B, T, H]: the objective applies norm and LM head only
        where a label is valid (a third of the positions are prompt or padding, and the LM head is most of a step)."""
        b, t, _ = aux.shape
        scale = self.shape.head_dim ** -0.5
        index = torch.arange(t)
        causal = index[None, :] <= index[:, None]  # [T, T]: right padding sits after every valid query
        hidden = self.fc(aux)  # [B, T, H]
        k0 = v0 = None
        diag_k: list[torch.Tensor] = []  # step i >= 1 keys at each index: [B, heads, T, D]
        diag_v: list[torch.Tensor] = []
        out_hidden = []
        for j in range(num_steps):
            positions = (index + j).expand(b, t)
            q, k, v = self._qkv(F.embedding(input_ids[:, j:j + t], embed), hidden, positions)
            if j == 0:
                k0, v0 = k, v
            else:
                diag_k.append(k)
                diag_v.append(v)
            scores = (q @ k0.transpose(-1, -2)).float() * scale  # [B, heads, T, T]
            scores = scores.masked_fill(~causal, float("-inf"))
            diag = [(q * dk).sum(-1, keepdim=True).float() * scale for dk in diag_k]  # j x [B, heads, T, 1]
            probs = torch.softmax(torch.cat([scores, *diag], dim=-1), dim=-1).to(q.dtype)
            out = probs[..., :t] @ v0
            for i, dv in enumerate(diag_v):
                out = out + probs[..., t + i:t + i + 1] * dv
            hidden = self._finish(out, hidden)
            out_hidden.append(hidden)
        return out_hidden


def step0_logits(head: DraftHead, embed: torch.Tensor, aux: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """Draft step 0 over one sequence, as inference's step 0 runs over the target tokens of a prompt.

    embed: [V, H] target embedding; aux: [T, A*H] residual streams entering the aux layers at positions 0..T-1;
    input_ids: [T] the shifted ids (x[1..T]). Returns [T, draft_vocab] logits over the draft vocabulary."""
    with torch.no_grad():
        return head.ttt(embed, aux[None], input_ids[None], num_steps=1)[0][0]

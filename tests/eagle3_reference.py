"""A plain EAGLE-3 drafter to test tandem's against: Hugging Face's target states, the head's math written out in
float32 torch with no cache, no batching and no paging (STYLE: a plain reference beside the batched version).

For a context c[0..n-1] (c[n-1] just emitted, not yet run by the target):
    step 0   queries t = 0..n-2, id c[t+1], hidden fc(aux_t), position t; causal over themselves
    step j   one query at position n-2+j, id = draft j, hidden = step j-1's pre-norm output; its keys are step 0's
             (positions 0..n-2) and the earlier decodes' (n-1..n-2+j)
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from hf_oracle import load_hf_model
from safetensors.torch import load_file


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    # x: [T, heads, D], Llama's rotate-half convention
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = positions.double()[:, None] * inv[None]  # [T, D/2]
    cos = torch.cat((ang.cos(), ang.cos()), -1)[:, None].float()  # [T, 1, D]
    sin = torch.cat((ang.sin(), ang.sin()), -1)[:, None].float()
    half = torch.cat((-x[..., d // 2:], x[..., : d // 2]), -1)
    return x * cos + half * sin


class PlainEagle3:
    def __init__(self, target: Path, head: Path):
        self.target = load_hf_model(target)
        self.cfg = json.loads((head / "config.json").read_text())
        tcfg = json.loads((target / "config.json").read_text())
        n = tcfg["num_hidden_layers"]
        self.layer_ids = self.cfg.get("eagle_aux_hidden_state_layer_ids") or [2, n // 2, n - 3]
        self.w = {k: v.float() for k, v in load_file(str(head / "model.safetensors")).items()}
        d2t = self.w.get("d2t")
        self.to_target = None if d2t is None else torch.arange(d2t.shape[0]) + d2t.long()

    @torch.inference_mode()
    def aux(self, ids: list[int]) -> torch.Tensor:
        """[T, n_aux * H] the residual streams entering the aux layers (id L: the last layer's output, pre-norm)."""
        pre_norm: list[torch.Tensor] = []
        hook = self.target.model.norm.register_forward_pre_hook(lambda _m, args: pre_norm.append(args[0]))
        try:
            out = self.target(torch.tensor([ids]), output_hidden_states=True)
        finally:
            hook.remove()
        states = [*out.hidden_states[:-1], pre_norm[0]]  # [L + 1] x [1, T, H]
        return torch.cat([states[i][0] for i in self.layer_ids], dim=-1)

    def _layer(self, ids: torch.Tensor, positions: torch.Tensor, g: torch.Tensor,
               keys: list[torch.Tensor], values: list[torch.Tensor], causal: bool) -> torch.Tensor:
        """One pass of the head's layer; appends this pass's K/V to keys/values and attends over all of them."""
        c, w, eps = self.cfg, self.w, self.cfg["rms_norm_eps"]
        p = "midlayer."
        embeds = self.target.model.embed_tokens(ids).float()
        normed = _rms(g, w[p + "hidden_norm.weight"], eps)
        residual = normed if c.get("norm_before_residual") else g
        a = torch.cat((_rms(embeds, w[p + "input_layernorm.weight"], eps), normed), -1)
        heads, kv_heads, d = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
        q = _rope((a @ w[p + "self_attn.q_proj.weight"].T).view(-1, heads, d), positions, c["rope_theta"])
        keys.append(_rope((a @ w[p + "self_attn.k_proj.weight"].T).view(-1, kv_heads, d), positions, c["rope_theta"]))
        values.append((a @ w[p + "self_attn.v_proj.weight"].T).view(-1, kv_heads, d))
        k = torch.cat(keys).repeat_interleave(heads // kv_heads, dim=1)  # [S, heads, D]
        v = torch.cat(values).repeat_interleave(heads // kv_heads, dim=1)
        scores = torch.einsum("thd,shd->hts", q, k) * d**-0.5
        if causal:
            scores = scores.masked_fill(torch.ones_like(scores[0], dtype=torch.bool).triu(1), float("-inf"))
        o = torch.einsum("hts,shd->thd", scores.softmax(-1), v).reshape(q.shape[0], -1)
        r = o @ w[p + "self_attn.o_proj.weight"].T + residual
        x = _rms(r, w[p + "post_attention_layernorm.weight"], eps)
        mlp = (torch.nn.functional.silu(x @ w[p + "mlp.gate_proj.weight"].T) * (x @ w[p + "mlp.up_proj.weight"].T)) \
            @ w[p + "mlp.down_proj.weight"].T
        return mlp + r

    def _draft(self, prenorm: torch.Tensor) -> int:
        logits = _rms(prenorm, self.w["norm.weight"], self.cfg["rms_norm_eps"]) @ self.w["lm_head.weight"].T
        d = int(logits.argmax())
        return d if self.to_target is None else int(self.to_target[d])

    @torch.inference_mode()
    def drafts(self, context: list[int], k: int) -> list[int]:
        """K greedy drafts after `context` (its last token emitted by the target, not yet run by it)."""
        n = len(context)
        aux = self.aux(context[:-1])  # [n - 1, 3 H]
        g = aux @ self.w["fc.weight"].T
        keys: list[torch.Tensor] = []
        values: list[torch.Tensor] = []
        prenorm = self._layer(torch.tensor(context[1:]), torch.arange(n - 1), g, keys, values, causal=True)[-1:]
        drafts = [self._draft(prenorm[0])]
        for j in range(1, k):
            prenorm = self._layer(torch.tensor(drafts[-1:]), torch.tensor([n - 2 + j]), prenorm, keys, values,
                                  causal=False)
            drafts.append(self._draft(prenorm[0]))
        return drafts

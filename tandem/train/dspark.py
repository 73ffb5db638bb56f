"""DSpark drafter training by distillation on the bundled target's own greedy outputs (docs/dspark.md).
Scope: distillation data from tandem itself, a training forward over tandem's own DSparkDrafter modules (so
the trained weights mean exactly what inference computes), and the checkpoint folder.

Training view of one proposal (anchor at position a = P + 1, block size B): context K/V from the target's
features at positions 0 .. a - 1; block [t_a, noise x (B - 1)] at positions a .. a + B - 1, non-causal inside;
slot j is trained to predict t_{a+1+j} with the Markov head fed the true previous token (teacher forcing).
Anchors are drawn only inside the target's own greedy continuation, where the next tokens ARE the target's
greedy choices, so the drafter learns to predict what verification will accept. M anchors per sequence share
one attention call through a [M * B, T + M * B] mask.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from tandem.data.gsm8k import STOP_STRINGS, Problem, few_shot_prompt
from tandem.models.dspark import ARCHITECTURE, MODEL_TYPE, DSparkConfig, DSparkDrafter
from tandem.train.tokenizer import PAD_ID

DEFAULT_DSPARK_STEPS = 300
DEFAULT_DISTILL_PROMPTS = 512
ANCHORS_PER_SEQUENCE = 24
SLOT_DECAY = 0.8  # later slots matter only when the earlier ones were accepted
CONFIDENCE_LOSS_WEIGHT = 0.1


def dspark_config(target: dict[str, Any]) -> dict[str, Any]:
    return {
        "architectures": [ARCHITECTURE], "model_type": MODEL_TYPE,
        "hidden_size": target["hidden_size"], "num_hidden_layers": 1,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "intermediate_size": 512,
        "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "vocab_size": target["vocab_size"],
        "target_hidden_size": target["hidden_size"],
        "target_layer_ids": [1, target["num_hidden_layers"] - 1],
        "block_size": 4, "markov_rank": 32, "noise_token_id": PAD_ID,
        "torch_dtype": "float32",  # stored bfloat16, computed in the target's dtype
    }


def distill_sequences(target_dir: Path, gsm8k: list[Problem], num_prompts: int, seed: int,
                      max_tokens: int = 200) -> list[tuple[list[int], int]]:
    """(token ids, start of the target's own continuation) for 2-shot prompts over GSM8K train questions."""
    from tandem import LLM, SamplingParams

    rng = random.Random(seed)
    prompts = []
    for _ in range(num_prompts):
        shots_and_question = rng.sample(gsm8k, 3)
        # the tokenizer prepends <|bos|>
        prompts.append(few_shot_prompt(shots_and_question[:2], shots_and_question[2].question))
    llm = LLM(model=str(target_dir), dtype="float32", max_num_seqs=64, max_num_batched_tokens=4096)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens, stop=STOP_STRINGS),
                        use_tqdm=True)
    return [(list(o.prompt_token_ids) + list(o.outputs[0].token_ids), len(o.prompt_token_ids)) for o in outs]


class TargetFeatures:
    """The frozen target (transformers' implementation) exposing the outputs of `layer_ids`, its embedding and
    its LM head."""

    def __init__(self, target_dir: Path, layer_ids: list[int]):
        import transformers

        transformers.logging.set_verbosity_error()  # the MTP layer's tensors are "unexpected" to HF, by design
        self.model = transformers.AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32).eval()
        self.model.requires_grad_(False)
        self.layer_ids, self._kept = layer_ids, {}
        for i in layer_ids:
            self.model.model.layers[i].register_forward_hook(self._keep(i))

    def _keep(self, i: int) -> Any:
        def hook(_module: Any, _inputs: Any, output: Any) -> None:
            self._kept[i] = output[0] if isinstance(output, tuple) else output
        return hook

    @torch.no_grad()
    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        # ids: [B, T] -> concatenated layer outputs [B, T, len(layer_ids) * H]
        self.model.model(input_ids=ids)
        return torch.cat([self._kept[i] for i in self.layer_ids], dim=-1)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model.model.embed_tokens(ids)

    def lm_head(self, h: torch.Tensor) -> torch.Tensor:
        return self.model.lm_head(h)


def _block_mask(anchors: torch.Tensor, seq_len: int, block: int) -> torch.Tensor:
    # anchors: [M] -> [M * B, T + M * B] bool: context positions < anchor, then the query's own block
    m = anchors.shape[0]
    ctx = torch.arange(seq_len)[None, :] < anchors[:, None]  # [M, T]
    own = torch.eye(m, dtype=torch.bool).repeat_interleave(block, dim=1)  # [M, M * B]
    return torch.cat((ctx, own), dim=1).repeat_interleave(block, dim=0)


def drafter_loss(drafter: DSparkDrafter, target: TargetFeatures, ids: torch.Tensor, anchors: torch.Tensor,
                 ) -> tuple[torch.Tensor, dict[str, float]]:
    """ids: [1, T] one sequence; anchors: [M] positions a with a + B < T."""
    cfg = drafter.config
    B, T, M = cfg.block_size, ids.shape[1], anchors.shape[0]
    features = drafter.hidden_norm(drafter.fc(target(ids)[0]))  # [T, H]
    ctx_pos = torch.arange(T)
    offsets = torch.arange(B)
    block_pos = (anchors[:, None] + offsets[None, :]).flatten()  # [M * B]
    block_ids = torch.full((M, B), cfg.noise_token_id)
    block_ids[:, 0] = ids[0, anchors]
    labels = ids[0, anchors[:, None] + 1 + offsets[None, :]]  # [M, B]
    prev = torch.cat((ids[0, anchors][:, None], labels[:, :-1]), dim=1)  # [M, B] teacher-forced Markov input
    mask = _block_mask(anchors, T, B)[None]  # [1, M * B, T + M * B]

    x = target.embed(block_ids.flatten())  # [M * B, H]
    for layer in drafter.layers:
        attn = layer.self_attn
        hq, hk, d = attn.num_heads, attn.num_kv_heads, attn.head_dim
        ck, cv = attn._kv(features, ctx_pos)  # [T, Hkv, D] each
        xn = layer.input_layernorm(x)
        (q,) = attn.rotary_emb(block_pos, attn.q_proj(xn).view(-1, hq, d))
        bk, bv = attn._kv(xn, block_pos)
        keys, values = torch.cat((ck, bk)), torch.cat((cv, bv))  # [T + M * B, Hkv, D]
        out = F.scaled_dot_product_attention(q.transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1),
                                             attn_mask=mask, scale=d**-0.5, enable_gqa=hq != hk)
        x = x + attn.o_proj(out.transpose(0, 1).reshape(x.shape[0], -1))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    h = drafter.norm(x)  # [M * B, H]
    logits = target.lm_head(h).float() + drafter.markov_head(prev.flatten())  # [M * B, V]
    ce = F.cross_entropy(logits, labels.flatten(), reduction="none").view(M, B)
    weights = SLOT_DECAY ** offsets.float()
    draft_loss = (ce * weights).sum(1).mean() / weights.sum()
    hit = (logits.argmax(-1) == labels.flatten()).float()  # [M * B]
    conf_logit = drafter.confidence_head(h).squeeze(-1).float()
    conf_loss = F.binary_cross_entropy_with_logits(conf_logit, hit)
    acc = hit.view(M, B).mean(0)
    stats = {"ce": draft_loss.item(), "conf": conf_loss.item(), **{f"acc{j}": acc[j].item() for j in range(B)}}
    return draft_loss + CONFIDENCE_LOSS_WEIGHT * conf_loss, stats


def _init_drafter(drafter: DSparkDrafter, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if name.endswith("bias"):
                p.zero_()
            elif p.dim() == 1:
                p.fill_(1.0)
            elif "markov_w2" in name:
                p.zero_()  # the Markov correction starts neutral
            else:
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)
    drafter.requires_grad_(True)


def train_dspark(target_dir: Path, out: Path, gsm8k: list[Problem], steps: int, num_prompts: int, seed: int,
                 log: Any = print, batch_sequences: int = 4, peak_lr: float = 2e-3) -> Path:
    torch.manual_seed(seed)
    target_raw = json.loads((target_dir / "config.json").read_text())
    raw = dspark_config(target_raw)
    cfg = DSparkConfig(**{k: tuple(v) if k == "target_layer_ids" else v for k, v in raw.items()
                          if k not in ("architectures", "model_type", "torch_dtype")})
    sequences = [s for s in distill_sequences(target_dir, gsm8k, num_prompts, seed)
                 if len(s[0]) - s[1] > cfg.block_size + 1]
    log(json.dumps({"stage": "dspark", "distill_sequences": len(sequences),
                    "continuation_tokens": sum(len(ids) - start for ids, start in sequences)}))
    target = TargetFeatures(target_dir, list(cfg.target_layer_ids))
    drafter = DSparkDrafter(cfg, max_position=target_raw["max_position_embeddings"] + cfg.block_size)
    _init_drafter(drafter, seed)
    opt = torch.optim.AdamW([p for p in drafter.parameters() if p.requires_grad], lr=peak_lr, betas=(0.9, 0.95),
                            weight_decay=0.0)
    rng = random.Random(seed)
    for step in range(steps):
        lr = peak_lr * min(1.0, (step + 1) / 20) * (0.1 + 0.9 * (1 - step / steps))
        for group in opt.param_groups:
            group["lr"] = lr
        totals: dict[str, float] = {}
        for _ in range(batch_sequences):
            ids, start = rng.choice(sequences)
            # anchors a in [start, len - B - 1]: a's block labels reach a + B, inside the continuation
            candidates = list(range(start, len(ids) - cfg.block_size - 1))
            anchors = torch.tensor(sorted(rng.sample(candidates, min(ANCHORS_PER_SEQUENCE, len(candidates)))))
            loss, stats = drafter_loss(drafter, target, torch.tensor([ids]), anchors)
            (loss / batch_sequences).backward()
            for k, v in stats.items():
                totals[k] = totals.get(k, 0.0) + v / batch_sequences
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step % 10 == 0 or step == steps - 1:
            log(json.dumps({"stage": "dspark", "step": step, **{k: round(v, 4) for k, v in totals.items()}}))
    return save_dspark(drafter, raw, out)


def save_dspark(drafter: DSparkDrafter, raw: dict[str, Any], out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    for name, value in drafter.state_dict().items():
        if name.endswith(("cos_cache", "sin_cache")):
            continue
        if ".gate_up_proj." in name:  # tandem fuses them; the checkpoint keeps gate_proj and up_proj apart
            gate, up = value.chunk(2, dim=0)
            tensors[name.replace("gate_up_proj", "gate_proj")] = gate
            tensors[name.replace("gate_up_proj", "up_proj")] = up
        else:
            tensors[name] = value
    tensors = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in tensors.items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    return out

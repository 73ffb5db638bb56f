"""EAGLE-3 draft heads in the format vLLM, SGLang, TensorRT-LLM and llama.cpp load: config, checks against the
target, weights and the math of one draft pass. Scope: the head itself; proposing lives in spec_decode.

One pass over tokens whose target residual streams entering layers `aux_layer_ids` are `aux` (DESIGN §4):
    step 0     g = fc(cat[aux_l for l in aux_layer_ids])            [T, 3 H_t] -> [T, H]
    step k>0   g = the previous pass's pre-norm output              [T, H]
    layer      a = cat[input_layernorm(embed(x)), hidden_norm(g)]   [T, 2 H] -> qkv (2 H wide), causal GQA
               r = o_proj(attn) + g;  prenorm = mlp(post_attention_layernorm(r)) + r
    logits     lm_head(norm(prenorm)) over the draft vocabulary, scattered to target ids t = d + d2t[d]
With `norm_before_residual` the residual is hidden_norm(g) instead of g. The head borrows the target's embedding
unless the checkpoint carries its own; its weights are replicated on every TP and PCP rank.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from tandem import native
from tandem.config import ConfigError, ModelConfig
from tandem.distributed.groups import SINGLE
from tandem.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from tandem.layers.linear import ReplicatedLinear
from tandem.layers.norm import RMSNorm
from tandem.models import fused_decoder_layer
from tandem.models.checkpoint_reader import WeightLoadError, read_checkpoint
from tandem.models.llama import GatedMLP, GQAAttention
from tandem.models.loader import load_weights, packed_weight_target

ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")
TARGET_ARCHITECTURES = ("LlamaForCausalLM", "Qwen3ForCausalLM")
# Variants of the format that change the math; tandem refuses them by name rather than drafting wrong tokens.
_UNSUPPORTED_FLAGS = ("norm_before_fc", "fc_norm", "norm_output")


def default_aux_layer_ids(num_layers: int) -> tuple[int, ...]:
    """vLLM's default for Llama-family targets: early, middle and late residual streams."""
    return (2, num_layers // 2, num_layers - 3)


@dataclass(frozen=True)
class Eagle3Config:
    folder: str
    raw: dict[str, Any]  # config.json as read
    hidden_size: int
    vocab_size: int
    draft_vocab_size: int
    target_hidden_size: int
    aux_layer_ids: tuple[int, ...] | None  # None: the target's default, fixed by check_target
    norm_before_residual: bool

    @property
    def where(self) -> str:
        return f"EAGLE-3 head {self.folder!r} config.json"

    @staticmethod
    def from_folder(folder: str) -> Eagle3Config:
        path = Path(folder) / "config.json"
        if not path.is_file():
            raise ConfigError(f"speculative_config.model={folder!r}: no config.json found in the EAGLE-3 head folder")
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ConfigError(f"EAGLE-3 head {folder!r} config.json is not valid JSON: {e}") from e
        where = f"EAGLE-3 head {folder!r} config.json"
        if raw.get("architectures") not in ([a] for a in ARCHITECTURES):
            raise ConfigError(f"{where}: architectures={raw.get('architectures')!r} is not allowed: "
                              f"[{ARCHITECTURES[0]!r}] (or [{ARCHITECTURES[1]!r}])")
        for name in ("hidden_size", "num_attention_heads", "intermediate_size", "vocab_size"):
            if not isinstance(raw.get(name), int) or raw[name] < 1:
                raise ConfigError(f"{where}: {name}={raw.get(name)!r} is not allowed: a positive integer")
        kv_heads = raw.get("num_key_value_heads", raw["num_attention_heads"])
        if not isinstance(kv_heads, int) or kv_heads < 1 or raw["num_attention_heads"] % kv_heads:
            raise ConfigError(f"{where}: num_key_value_heads={kv_heads!r} is not allowed: a positive divisor of "
                              f"num_attention_heads ({raw['num_attention_heads']})")
        if raw.get("num_hidden_layers", 1) != 1:
            raise ConfigError(f"{where}: num_hidden_layers={raw.get('num_hidden_layers')!r} is not allowed: 1 "
                              "(tandem runs single-layer EAGLE-3 heads)")
        eagle = raw.get("eagle_config") or {}
        if not isinstance(eagle, dict):
            raise ConfigError(f"{where}: eagle_config={eagle!r} is not allowed: an object")
        if eagle.get("use_aux_hidden_state", True) is not True:
            raise ConfigError(f"{where}: eagle_config.use_aux_hidden_state={eagle['use_aux_hidden_state']!r} is not "
                              "allowed: true (heads fed by one hidden state are EAGLE-1/2, not EAGLE-3)")
        for flag in _UNSUPPORTED_FLAGS:
            if raw.get(flag) or eagle.get(flag):
                raise ConfigError(f"{where}: {flag}=true is not supported: tandem reads the plain EAGLE-3 layer")
        ids = raw.get("eagle_aux_hidden_state_layer_ids") or eagle.get("eagle_aux_hidden_state_layer_ids")
        if ids is not None and (not isinstance(ids, list) or not ids or not all(isinstance(i, int) for i in ids)):
            raise ConfigError(f"{where}: eagle_aux_hidden_state_layer_ids={ids!r} is not allowed: a non-empty list "
                              "of target layer indices")
        draft_vocab = raw.get("draft_vocab_size") or raw["vocab_size"]
        if not isinstance(draft_vocab, int) or not 1 <= draft_vocab <= raw["vocab_size"]:
            raise ConfigError(f"{where}: draft_vocab_size={draft_vocab!r} is not allowed: an integer in "
                              f"[1, vocab_size={raw['vocab_size']}]")
        target_hidden = raw.get("target_hidden_size") or raw["hidden_size"]
        return Eagle3Config(folder, raw, raw["hidden_size"], raw["vocab_size"], draft_vocab, target_hidden,
                            tuple(ids) if ids is not None else None, bool(raw.get("norm_before_residual", False)))

    def check_target(self, target: ModelConfig) -> Eagle3Config:
        """The head must read the target's layers and vocabulary -> the config with its aux layer ids fixed."""
        if target.architecture not in TARGET_ARCHITECTURES:
            raise ConfigError(f"speculative_config.method='eagle3' is not supported for {target.architecture}: "
                              f"targets allowed are {', '.join(TARGET_ARCHITECTURES)}")
        if self.vocab_size != target.get("vocab_size"):
            raise ConfigError(f"{self.where}: vocab_size={self.vocab_size} does not match the target's vocab_size "
                              f"({target.get('vocab_size')})")
        if self.target_hidden_size != target.get("hidden_size"):
            raise ConfigError(f"{self.where}: target_hidden_size={self.target_hidden_size} does not match the "
                              f"target's hidden_size ({target.get('hidden_size')})")
        num_layers = int(target.get("num_hidden_layers"))
        ids = self.aux_layer_ids or default_aux_layer_ids(num_layers)
        # id l is the residual stream entering layer l (Hugging Face's hidden_states[l]); l = L is the last layer's
        # output before the final norm
        if any(not 0 <= i <= num_layers for i in ids):
            raise ConfigError(f"{self.where}: eagle_aux_hidden_state_layer_ids={list(ids)} is not allowed: layer "
                              f"indices of the target, in [0, {num_layers}]")
        return Eagle3Config(self.folder, self.raw, self.hidden_size, self.vocab_size, self.draft_vocab_size,
                            self.target_hidden_size, tuple(ids), self.norm_before_residual)

    def model_config(self, target: ModelConfig, max_model_len: int, dtype: torch.dtype | None = None) -> ModelConfig:
        """The head's layer as a ModelConfig (GQAAttention and GatedMLP read their sizes from one), computing in
        `dtype` (default: the target's)."""
        hf = SimpleNamespace(**{"rms_norm_eps": target.get("rms_norm_eps", 1e-6),
                                "num_key_value_heads": self.raw["num_attention_heads"]} | self.raw)
        return ModelConfig(self.folder, hf, self.raw["architectures"][0], dtype or target.dtype, max_model_len)


class Eagle3DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, norm_before_residual: bool):
        super().__init__()
        hf = config.hf
        self.norm_before_residual = norm_before_residual
        self.self_attn = GQAAttention(config, SINGLE, bias=getattr(hf, "attention_bias", False),
                                      input_size=2 * hf.hidden_size)
        self.mlp = GatedMLP(hf.hidden_size, hf.intermediate_size, SINGLE, bias=getattr(hf, "mlp_bias", False))
        self.input_layernorm = RMSNorm(hf.hidden_size, hf.rms_norm_eps)
        self.hidden_norm = RMSNorm(hf.hidden_size, hf.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(hf.hidden_size, hf.rms_norm_eps)

    def forward(self, positions: torch.Tensor, embeds: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        # embeds, hidden: [T, H] -> the pre-norm output [T, H]
        fused = fused_decoder_layer.layer_step((self,), embeds, positions)  # one native call, or None
        normed = self.hidden_norm(hidden)
        residual = normed if self.norm_before_residual else hidden
        attn_input = torch.cat((self.input_layernorm(embeds), normed), dim=-1)  # [T, 2H]
        if fused is not None:
            return fused(self, residual, attn_input, hooks=False)  # (this forward's __call__ runs them)
        attn = self.self_attn(positions, attn_input)
        normed, residual = self.post_attention_layernorm.add_residual(attn, residual)
        return self.mlp(normed) + residual


class Eagle3Head(nn.Module):
    """The drafter MTPProposer drives (same call shape as DeepSeekMTP): forward(ids, positions, hidden, step)
    -> (hidden for logits, feedback hidden); compute_logits -> [N, target vocab] float32, -inf off the draft
    vocabulary, so a probabilistic draft's q is zero there and verification stays exact."""

    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, cfg: Eagle3Config, config: ModelConfig, target_embed: VocabParallelEmbedding,
                 own_embedding: bool):
        super().__init__()
        assert cfg.aux_layer_ids is not None, "check_target fixes the aux layer ids"
        self.cfg = cfg
        hf = config.hf
        self.midlayer = Eagle3DecoderLayer(config, cfg.norm_before_residual)
        self.fc = ReplicatedLinear(len(cfg.aux_layer_ids) * cfg.target_hidden_size, hf.hidden_size)
        self.norm = RMSNorm(hf.hidden_size, hf.rms_norm_eps)
        self.lm_head = ParallelLMHead(cfg.draft_vocab_size, hf.hidden_size, SINGLE)
        if own_embedding:
            self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, hf.hidden_size, SINGLE)
        else:  # the target's, kept out of the head's parameters (loading must not ask the checkpoint for it)
            object.__setattr__(self, "embed_tokens", target_embed)
        # [draft_vocab] target id of each draft id; None when the draft vocabulary is the target's
        self.draft_to_target: torch.Tensor | None = None

    def map_weight_name(self, name: str) -> tuple[str, Any] | None:
        """Checkpoint name -> (parameter, shard): `layers.0.*` is the same layer as `midlayer.*`."""
        name = name.removeprefix("model.")
        if name.startswith("layers.0."):
            name = "midlayer." + name.removeprefix("layers.0.")
        return packed_weight_target(self, name)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor,
                spec_step_idx: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """input_ids, positions: [T]; hidden: [T, n_aux * H_t] the target's aux states at step 0, else [T, H] the
        previous pass's feedback -> (hidden for logits [T, H] after norm, feedback [T, H] before it)."""
        dtype = self.fc.weight.dtype  # the head's own, which may be narrower than the target's (draft_dtype)
        g = self.fc(hidden.to(dtype)) if spec_step_idx == 0 else hidden  # [T, H]
        prenorm = self.midlayer(positions, self.embed_tokens(input_ids).to(dtype), g)
        return self.norm(prenorm), prenorm

    def compute_logits(self, hidden: torch.Tensor, spec_step_idx: int = 0) -> torch.Tensor:
        # hidden: [N, H] after norm -> float32 logits over the target vocabulary [N, V]
        draft = self.lm_head.compute_logits(hidden)  # [N, draft_vocab]
        if self.draft_to_target is None:
            return draft
        logits = draft.new_full((draft.shape[0], self.cfg.vocab_size), float("-inf"))
        logits[:, self.draft_to_target] = draft
        return logits


    def greedy_draft(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [N, H] after norm -> [N] target ids of the draft vocabulary's argmax (compute_logits' argmax)."""
        best = native.greedy_tokens(self.lm_head.compute_logits(hidden))  # [N] draft ids
        return best if self.draft_to_target is None else self.draft_to_target[best]


def draft_to_target_ids(d2t: torch.Tensor, cfg: Eagle3Config) -> torch.Tensor:
    """The checkpoint's `d2t` offsets [draft_vocab] -> target ids, each checked to be a distinct target token."""
    where = f"EAGLE-3 head {cfg.folder!r}"
    if d2t.dim() != 1 or d2t.shape[0] != cfg.draft_vocab_size or d2t.dtype.is_floating_point:
        raise WeightLoadError(f"{where}: d2t has shape {tuple(d2t.shape)} and dtype {d2t.dtype}; expected integer "
                              f"offsets of shape ({cfg.draft_vocab_size},) (draft_vocab_size)")
    ids = torch.arange(cfg.draft_vocab_size) + d2t.long()
    bad = ((ids < 0) | (ids >= cfg.vocab_size)).nonzero().flatten()
    if bad.numel():
        d = int(bad[0])
        raise WeightLoadError(f"{where}: d2t maps draft id {d} to target id {int(ids[d])}, outside the target "
                              f"vocabulary [0, {cfg.vocab_size}) ({bad.numel()} such entries)")
    if torch.unique(ids).numel() != ids.numel():
        raise WeightLoadError(f"{where}: d2t maps several draft ids to the same target id")
    return ids


def load_eagle3_head(folder: str, target: ModelConfig, target_embed: VocabParallelEmbedding,
                     device: str, dtype: torch.dtype | None = None) -> Eagle3Head:
    """The head in `folder`, checked against its target and loaded strictly, computed in `dtype` (default: the
    target's; speculative_config.draft_dtype)."""
    dtype = dtype or target.dtype
    cfg = Eagle3Config.from_folder(folder).check_target(target)
    own_embedding = any(n.removeprefix("model.") == "embed_tokens.weight" for n, _ in read_checkpoint(folder))
    if not own_embedding and cfg.hidden_size != target.get("hidden_size"):
        raise ConfigError(f"{cfg.where}: hidden_size={cfg.hidden_size} needs the head's own embed_tokens (the "
                          f"target's embedding is {target.get('hidden_size')} wide)")
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            # draft decodes run up to K positions past the last target position, itself < max_model_len
            head = Eagle3Head(cfg, cfg.model_config(target, target.max_model_len + 16, dtype), target_embed,
                              own_embedding)
    finally:
        torch.set_default_dtype(previous)
    vocab_map: dict[str, torch.Tensor] = {}  # d2t (t2d, its inverse as a mask, is not needed)

    def layer_tensors() -> Iterator[tuple[str, Any]]:
        for name, tensor in read_checkpoint(folder):
            if name in ("d2t", "t2d"):
                vocab_map[name] = tensor.materialize()
            else:
                yield name, tensor

    try:
        load_weights(head, layer_tensors())
        if "d2t" not in vocab_map and cfg.draft_vocab_size != cfg.vocab_size:
            raise WeightLoadError(f"d2t is missing: draft_vocab_size={cfg.draft_vocab_size} is smaller than the "
                                  f"target vocabulary ({cfg.vocab_size}), so draft ids need their target ids")
    except WeightLoadError as e:
        raise WeightLoadError(f"EAGLE-3 head {folder!r}: {e}", e.missing) from e
    if "d2t" in vocab_map:
        ids = draft_to_target_ids(vocab_map["d2t"], cfg)
        if not torch.equal(ids, torch.arange(cfg.vocab_size)):
            head.draft_to_target = ids.to(device)
    return head.eval()

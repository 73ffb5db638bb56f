"""Random checkpoints at real models' shapes, for benchmarks whose cost depends on the shapes, not the weights.
`dsv3`: DeepSeek-V3's attention and MLP widths in 2 dense layers (hidden 1024), built with Hugging Face's classes and
the bundled model's tokenizer. `llama1b`: Llama-3.2-1B's config whole. `dsv3-layers`: a few DeepSeek-V3 layers at the
real dims (MLA, the dense first layer, then 256-expert MoE layers). The last two are written tensor by tensor in
bf16 shards, seeded per tensor name, on any device, and build at test dims with `tiny=True`."""

from __future__ import annotations

import json
import shutil
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from tandem.assets import DEFAULT_MODEL

RANDOM_MODELS = ("dsv3", "llama1b", "dsv3-layers")
DSV3_SHAPE = {"hidden_size": 1024, "num_attention_heads": 16, "num_key_value_heads": 16, "kv_lora_rank": 512,
              "q_lora_rank": 768, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
              "num_hidden_layers": 2, "first_k_dense_replace": 2, "intermediate_size": 2816,
              "max_position_embeddings": 65536}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")

# meta-llama/Llama-3.2-1B's config.json, as released
LLAMA_1B: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256, "hidden_size": 2048,
    "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8,
    "head_dim": 64, "hidden_act": "silu", "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0, "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                                             "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "tie_word_embeddings": True, "attention_bias": False, "mlp_bias": False, "bos_token_id": 128000,
    "eos_token_id": 128001, "torch_dtype": "bfloat16"}
# deepseek-ai/DeepSeek-V3's config.json, as released, but for the layer count (first_k_dense_replace 1: layer 0 is
# dense, the rest MoE) and no MTP layer. 2 layers are 14 B parameters (28 GB in bf16, 11.3 B of them one layer's
# experts); each more layer adds 11.5 B.
DSV3_LAYERS: dict[str, Any] = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "vocab_size": 129280,
    "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 2,
    "num_nextn_predict_layers": 0, "num_attention_heads": 128, "num_key_value_heads": 128, "n_shared_experts": 1,
    "n_routed_experts": 256, "num_experts_per_tok": 8, "routed_scaling_factor": 2.5, "n_group": 8, "topk_group": 4,
    "topk_method": "noaux_tc", "scoring_func": "sigmoid", "norm_topk_prob": True, "first_k_dense_replace": 1,
    "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
    "hidden_act": "silu", "max_position_embeddings": 163840, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "attention_bias": False, "tie_word_embeddings": False, "bos_token_id": 0, "eos_token_id": 1,
    "torch_dtype": "bfloat16"}
# the same architectures at test dims: every config key above kept, only the sizes cut
TINY: dict[str, dict[str, Any]] = {
    "llama1b": {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "bos_token_id": 0,
                "eos_token_id": 1},
    "dsv3-layers": {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32,
                    "num_attention_heads": 4, "num_key_value_heads": 4, "n_routed_experts": 16,
                    "num_experts_per_tok": 4, "q_lora_rank": 32, "kv_lora_rank": 32, "qk_nope_head_dim": 16,
                    "qk_rope_head_dim": 8, "v_head_dim": 16}}
SHAPES = {"llama1b": LLAMA_1B, "dsv3-layers": DSV3_LAYERS}
LOGIT_STD = 4.0  # the logits' spread: greedy outputs vary with the prompt (9-22 distinct tokens of 32 at llama1b)
SHARD_BYTES = 2 << 30


def random_model_folder(name: str, cache_dir: Path) -> Path:
    """The folder of random model `name` (at its real size) under `cache_dir`, built there on first use."""
    if name not in RANDOM_MODELS:
        raise ValueError(f"--random-model {name!r} is not allowed: one of {', '.join(RANDOM_MODELS)}")
    folder = cache_dir / f"bench-{name}-shaped"
    if (folder / "config.json").is_file():
        return folder
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    if name == "dsv3":
        _build_dsv3(tmp)
    else:
        build_random_model(name, tmp)
    tmp.rename(folder)  # a build cut short leaves only .tmp, never a folder that looks complete
    return folder


def _build_dsv3(folder: Path) -> None:
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    vocab_size = json.loads((DEFAULT_MODEL / "config.json").read_text())["vocab_size"]
    config = DeepseekV3Config(**DSV3_SHAPE, vocab_size=vocab_size, tie_word_embeddings=False)
    with torch.random.fork_rng(devices=[]):  # the caller's random state must not depend on whether this ran
        torch.manual_seed(0)
        model = DeepseekV3ForCausalLM(config).eval()
    model.save_pretrained(folder, safe_serialization=True)
    for name in TOKENIZER_FILES:
        if (DEFAULT_MODEL / name).is_file():
            shutil.copy(DEFAULT_MODEL / name, folder / name)


def random_config(name: str, *, tiny: bool = False, num_layers: int | None = None) -> dict[str, Any]:
    """config.json of `llama1b` or `dsv3-layers`, at test dims with `tiny`, with `num_layers` layers if given."""
    if name not in SHAPES:
        raise ValueError(f"random model {name!r} is not allowed here: one of {', '.join(SHAPES)}")
    if num_layers is not None and num_layers < 1:
        raise ValueError(f"num_layers={num_layers} is not allowed: at least 1")
    config = {**SHAPES[name], **(TINY[name] if tiny else {})}
    return config | ({"num_hidden_layers": num_layers} if num_layers else {})


def build_random_model(name: str, folder: Path, *, tiny: bool = False, num_layers: int | None = None,
                       device: str = "cpu", seed: int = 0) -> Path:
    """Write random model `name` into `folder`: config.json, bf16 safetensors shards with their index, and a
    word-level tokenizer that names every id (prompts are token ids; any output id must detokenize)."""
    config = random_config(name, tiny=tiny, num_layers=num_layers)
    folder.mkdir(parents=True, exist_ok=True)
    shards = _plan_shards(list(_tensor_shapes(config)))
    weight_map = {}
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = {n: _init(n, s, config, seed, device) for n, s in shard}
        save_file(tensors, str(folder / file), metadata={"format": "pt"})
        weight_map |= {n: file for n, _ in shard}
    total = sum(_nbytes(n, s) for shard in shards for n, s in shard)
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    ids = {k: config[k] for k in ("bos_token_id", "eos_token_id")}
    (folder / "generation_config.json").write_text(json.dumps(ids, indent=2) + "\n")
    _write_tokenizer(folder, config["vocab_size"])
    return folder


def _tensor_shapes(c: dict[str, Any]) -> Iterator[tuple[str, tuple[int, ...]]]:
    """Every tensor's name and shape, in the released checkpoints' layout (tests/checkpoints.py's docstring):
    per-expert MoE tensors, never fused ones."""
    h, v = c["hidden_size"], c["vocab_size"]
    yield "model.embed_tokens.weight", (v, h)
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        yield p + "input_layernorm.weight", (h,)
        yield p + "post_attention_layernorm.weight", (h,)
        yield from ((p + n, s) for n, s in (_mla(c) if "kv_lora_rank" in c else _gqa(c)))
        if "n_routed_experts" in c and i >= c["first_k_dense_replace"]:
            yield p + "mlp.gate.weight", (c["n_routed_experts"], h)
            yield p + "mlp.gate.e_score_correction_bias", (c["n_routed_experts"],)
            shared = c["moe_intermediate_size"] * c["n_shared_experts"]
            yield from ((p + "mlp.shared_experts." + n, s) for n, s in _mlp(h, shared))
            for e in range(c["n_routed_experts"]):
                yield from ((p + f"mlp.experts.{e}." + n, s) for n, s in _mlp(h, c["moe_intermediate_size"]))
        else:
            yield from ((p + "mlp." + n, s) for n, s in _mlp(h, c["intermediate_size"]))
    yield "model.norm.weight", (h,)
    if not c["tie_word_embeddings"]:
        yield "lm_head.weight", (v, h)


def _gqa(c: dict[str, Any]) -> list[tuple[str, tuple[int, ...]]]:
    h, d = c["hidden_size"], c["head_dim"]
    q, kv = c["num_attention_heads"] * d, c["num_key_value_heads"] * d
    return [("self_attn.q_proj.weight", (q, h)), ("self_attn.k_proj.weight", (kv, h)),
            ("self_attn.v_proj.weight", (kv, h)), ("self_attn.o_proj.weight", (h, q))]


def _mla(c: dict[str, Any]) -> list[tuple[str, tuple[int, ...]]]:
    h, heads, q_lora, kv_lora = c["hidden_size"], c["num_attention_heads"], c["q_lora_rank"], c["kv_lora_rank"]
    nope, rope, v = c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"]
    return [("self_attn.q_a_proj.weight", (q_lora, h)), ("self_attn.q_a_layernorm.weight", (q_lora,)),
            ("self_attn.q_b_proj.weight", (heads * (nope + rope), q_lora)),
            ("self_attn.kv_a_proj_with_mqa.weight", (kv_lora + rope, h)),
            ("self_attn.kv_a_layernorm.weight", (kv_lora,)),
            ("self_attn.kv_b_proj.weight", (heads * (nope + v), kv_lora)),
            ("self_attn.o_proj.weight", (h, heads * v))]


def _mlp(h: int, inter: int) -> list[tuple[str, tuple[int, ...]]]:
    return [("gate_proj.weight", (inter, h)), ("up_proj.weight", (inter, h)), ("down_proj.weight", (h, inter))]


def _nbytes(name: str, shape: tuple[int, ...]) -> int:
    return torch.Size(shape).numel() * (4 if name.endswith("e_score_correction_bias") else 2)


def _plan_shards(tensors: list[tuple[str, tuple[int, ...]]]) -> list[list[tuple[str, tuple[int, ...]]]]:
    """Consecutive tensors in shards of at most SHARD_BYTES (one tensor alone may be more): a shard is all that is
    ever held in host memory at once."""
    shards: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    size = 0
    for name, shape in tensors:
        if shards[-1] and size + _nbytes(name, shape) > SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append((name, shape))
        size += _nbytes(name, shape)
    return shards


def _init(name: str, shape: tuple[int, ...], c: dict[str, Any], seed: int, device: str) -> torch.Tensor:
    """A seeded random value: fan-in scaled linears (unit-scale activations through every block, std 0.022 at
    hidden 2048, 0.012 at 7168), RMSNorm scales 1, head and embeddings scaled so logits spread by LOGIT_STD."""
    g = torch.Generator(device=device)
    g.manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63))

    def randn() -> torch.Tensor:
        return torch.randn(shape, generator=g, device=device, dtype=torch.float32)

    h = c["hidden_size"]
    if name.endswith("e_score_correction_bias"):
        # float32 as released; small enough that the router decides, big enough to change some choices
        return (0.05 * randn()).cpu()
    if name == "model.norm.weight" and c["tie_word_embeddings"]:
        # With tied embeddings the residual still carries the input token's embedding e_t, so logit(t) ~ |e_t|^2
        # and greedy repeats its input; random signs on the final norm make that self-term average to zero.
        value = torch.where(torch.rand(shape, generator=g, device=device) < 0.5, -1.0, 1.0)
    elif len(shape) == 1:
        value = torch.ones(shape, device=device)
    elif name.endswith("mlp.gate.weight"):
        value = 2.0 * randn() / h**0.5  # router scores spread wide: top-k not decided by rounding
    elif name == "lm_head.weight" or (name == "model.embed_tokens.weight" and c["tie_word_embeddings"]):
        value = LOGIT_STD * randn() / h**0.5
    elif name == "model.embed_tokens.weight":
        value = randn()  # the same scale as a block's output, so the token still shows in the residual
    else:
        value = randn() / shape[-1] ** 0.5
    return value.to(torch.bfloat16).cpu()


def _write_tokenizer(folder: Path, vocab_size: int) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"<{i}>": i for i in range(vocab_size)}, unk_token="<0>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(folder / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 1 << 20}
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")

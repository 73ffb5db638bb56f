"""Self-checks for the test fixtures: tokenizer, tiny per-arch checkpoints, MTP layers, HF oracle, SmolLM2.
Scope: proves the fixtures are sound (HF reloads them bit-exactly, outputs non-degenerate), not the engine.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

import hf_oracle
import pytest
import torch
from checkpoints import (
    ARCHS,
    BOS_ID,
    EOS_ID,
    MLA_ARCHS,
    MOE_ARCHS,
    PAD_ID,
    TINY_VOCAB_SIZE,
    checkpoint_keys,
    train_bpe_tokenizer,
)
from safetensors import safe_open
from safetensors.torch import load_file

PROMPTS = ["Hello world! How are you", "12+7=", "Once upon a time there was"]
YARN = {
    "type": "yarn",
    "factor": 4.0,
    "original_max_position_embeddings": 64,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
}


def _encode(path: Path, texts: list[str]) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    return [tok(t, add_special_tokens=True)["input_ids"] for t in texts]


def _config(path: Path) -> dict:
    return json.loads((path / "config.json").read_text())


def _layer_index(key: str) -> int:
    """Layer number of a ``model.layers.{i}.`` key; -1 for embeddings, final norm and head."""
    m = re.match(r"model\.layers\.(\d+)\.", key)
    return int(m[1]) if m else -1


def _expected_param(name: str, tensors: dict[str, torch.Tensor], used: set[str]) -> torch.Tensor:
    """The checkpoint tensor(s) an HF parameter should hold, fusing per-expert tensors like HF's loader."""
    fused = re.fullmatch(r"(.*\.experts\.)(gate_up_proj|down_proj)", name)
    if fused:
        base, kind = fused.groups()
        num_experts = sum(1 for k in tensors if re.fullmatch(re.escape(base) + r"\d+\.down_proj\.weight", k))
        parts = []
        for e in range(num_experts):
            leaves = ["gate_proj", "up_proj"] if kind == "gate_up_proj" else ["down_proj"]
            keys = [f"{base}{e}.{leaf}.weight" for leaf in leaves]
            used.update(keys)
            parts.append(torch.cat([tensors[k] for k in keys], dim=0))
        return torch.stack(parts)
    if name == "lm_head.weight" and name not in tensors:  # tied embeddings
        name = "model.embed_tokens.weight"
    used.add(name)
    return tensors[name]


def _assert_state_matches(
    state: dict[str, torch.Tensor], tensors: dict[str, torch.Tensor], rename: Callable[[str], str]
) -> set[str]:
    """Assert each HF state entry equals its (renamed) checkpoint tensor; return the checkpoint keys used."""
    used: set[str] = set()
    for name, value in state.items():
        expected = _expected_param(rename(name), tensors, used)
        assert value.shape == expected.shape, name
        assert torch.equal(value, expected.to(value.dtype)), name
    return used


def _assert_hf_loads_identically(path: Path) -> None:
    """Every HF parameter equals its checkpoint tensor and every trunk tensor is consumed by HF."""
    model = hf_oracle.load_hf_model(path)
    tensors = load_file(str(path / "model.safetensors"))
    used = _assert_state_matches(model.state_dict(), tensors, lambda n: n)
    num_layers = model.config.num_hidden_layers
    assert used == {k for k in tensors if _layer_index(k) < num_layers}


def test_tokenizer_is_deterministic_and_loads_offline(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    train_bpe_tokenizer(tmp_path / "a")
    train_bpe_tokenizer(tmp_path / "b")
    assert (tmp_path / "a/tokenizer.json").read_bytes() == (tmp_path / "b/tokenizer.json").read_bytes()
    tok = AutoTokenizer.from_pretrained(tmp_path / "a")
    assert len(tok) == TINY_VOCAB_SIZE
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (BOS_ID, EOS_ID, PAD_ID)
    text = "Hello world! 12+7=19 ünïcödé"
    ids = tok(text)["input_ids"]
    assert BOS_ID not in ids and EOS_ID not in ids  # no automatic specials
    assert tok.decode(ids) == text  # byte-level: lossless even outside the corpus alphabet
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    assert chat == "<|bos|>user\nhi<|eos|>\n<|bos|>assistant\n"


@pytest.mark.parametrize("arch", ARCHS)
def test_tiny_checkpoint_roundtrip_and_generation(tiny_checkpoints, arch: str) -> None:
    path = tiny_checkpoints(arch)
    cfg = _config(path)
    assert cfg["architectures"] == [hf_oracle.load_hf_model(path).__class__.__name__]
    assert (cfg["vocab_size"], cfg["bos_token_id"], cfg["eos_token_id"], cfg["pad_token_id"]) == (
        TINY_VOCAB_SIZE,
        BOS_ID,
        EOS_ID,
        PAD_ID,
    )
    assert "rope_parameters" not in cfg and cfg["rope_theta"] == 10000.0  # released-style config
    _assert_hf_loads_identically(path)

    prompts = _encode(path, PROMPTS)
    outs = hf_oracle.hf_greedy(path, prompts, max_new_tokens=12)
    assert all(len(o) == 12 for o in outs)
    assert len({tuple(o) for o in outs}) == len(outs), outs  # different prompts -> different continuations
    # Random models can fall into short loops, but never a single repeated token, and mostly varied output.
    assert all(len(set(o)) >= 2 for o in outs), outs
    assert sum(len(set(o)) for o in outs) >= 4 * len(outs), outs

    # The cached generate() path must agree with uncached full recomputation (guards the oracle itself).
    ids = list(prompts[0])
    for _ in range(6):
        ids.append(int(hf_oracle.hf_last_logits(path, ids).argmax()))
    assert ids[len(prompts[0]) :] == outs[0][:6]
    logits = hf_oracle.hf_all_logits(path, prompts[0])
    assert torch.equal(logits[-1], hf_oracle.hf_last_logits(path, prompts[0]))


@pytest.mark.parametrize("arch", sorted(MOE_ARCHS))
def test_moe_checkpoints_use_per_expert_tensors(tiny_checkpoints, arch: str) -> None:
    path = tiny_checkpoints(arch)
    cfg = _config(path)
    keys = set(checkpoint_keys(path))
    assert not any("gate_up_proj" in k or k.endswith("experts.down_proj") for k in keys)
    assert cfg["num_nextn_predict_layers"] == 0
    assert {"model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.down_proj.weight"} <= keys  # dense
    for layer in range(cfg["first_k_dense_replace"], cfg["num_hidden_layers"]):
        p = f"model.layers.{layer}.mlp."
        assert {
            p + "gate.weight",
            p + "gate.e_score_correction_bias",
            p + "shared_experts.up_proj.weight",
        } <= keys
        for e in range(cfg["n_routed_experts"]):
            assert {f"{p}experts.{e}.{w}_proj.weight" for w in ("gate", "up", "down")} <= keys
    if arch in MLA_ARCHS:
        assert "model.layers.0.self_attn.kv_a_proj_with_mqa.weight" in keys
        assert "model.layers.0.self_attn.q_a_proj.weight" in keys
    else:
        assert (
            "model.layers.0.self_attn.q_proj.bias" in keys
            and "model.layers.0.self_attn.k_norm.weight" in keys
        )


@pytest.mark.parametrize("arch", sorted(MOE_ARCHS))
def test_mtp_layers(tiny_checkpoints, arch: str) -> None:
    path = tiny_checkpoints(arch, num_mtp_layers=2)
    base = tiny_checkpoints(arch)
    cfg = _config(path)
    assert cfg["num_nextn_predict_layers"] == 2
    num_layers, hidden = cfg["num_hidden_layers"], cfg["hidden_size"]
    tensors = load_file(str(path / "model.safetensors"))
    base_tensors = load_file(str(base / "model.safetensors"))
    # The trunk is bit-identical to the checkpoint built without MTP layers.
    assert base_tensors.keys() <= tensors.keys()
    assert all(torch.equal(tensors[k], v) for k, v in base_tensors.items())
    for m in range(num_layers, num_layers + 2):
        p = f"model.layers.{m}."
        assert tensors[p + "eh_proj.weight"].shape == (hidden, 2 * hidden)
        for leaf in ("enorm.weight", "hnorm.weight", "shared_head.norm.weight"):
            assert tensors[p + leaf].shape == (hidden,)
        assert torch.equal(tensors[p + "shared_head.head.weight"], tensors["lm_head.weight"])
        assert torch.equal(tensors[p + "embed_tokens.weight"], tensors["model.embed_tokens.weight"])
        assert p + "mlp.experts.7.down_proj.weight" in tensors and p + "mlp.gate.weight" in tensors
        assert p + "input_layernorm.weight" in tensors and p + "self_attn.o_proj.weight" in tensors

    # HF ignores the MTP layers when loading the main model: same weights, same logits as without them.
    _assert_hf_loads_identically(path)
    ids = _encode(path, PROMPTS[:1])[0]
    assert torch.equal(hf_oracle.hf_last_logits(path, ids), hf_oracle.hf_last_logits(base, ids))

    # HF's MtpModel (the MTP oracle) consumes exactly the MTP tensors written here.
    next_token, drafts, draft_logits = hf_oracle.hf_mtp_draft(path, ids)
    assert next_token == int(hf_oracle.hf_last_logits(path, ids).argmax())
    assert len(drafts) == 2 and draft_logits.shape == (2, TINY_VOCAB_SIZE)
    assert drafts == draft_logits.argmax(-1).tolist()

    def rename(name: str) -> str:
        if name == "embed_tokens.weight":
            return "model.embed_tokens.weight"
        if name == "shared_head.weight":
            return "lm_head.weight"
        k, rest = re.fullmatch(r"layers\.(\d+)\.(.*)", name).groups()
        rest = rest.removeprefix("mtp_block.").replace("post_norm.", "shared_head.norm.")
        return f"model.layers.{num_layers + int(k)}.{rest}"

    mtp = hf_oracle._load_mtp_model(str(path.resolve()))
    used = _assert_state_matches(mtp.state_dict(), tensors, rename)
    mtp_keys = {k for k in tensors if _layer_index(k) >= num_layers}
    assert used - mtp_keys == {"model.embed_tokens.weight", "lm_head.weight"}
    # The MTP copies of embedding/head are shared with the trunk in HF, so they are the only ones not read.
    assert mtp_keys - used == {
        f"model.layers.{m}.{leaf}"
        for m in (num_layers, num_layers + 1)
        for leaf in ("embed_tokens.weight", "shared_head.head.weight")
    }


@pytest.mark.parametrize(
    ("arch", "overrides"),
    [("deepseek_v3", {"rope_scaling": YARN}), ("glm4_moe", {"partial_rotary_factor": 0.25}), ("llama", {})],
)
def test_released_and_hf5_config_styles_are_equivalent(tiny_checkpoints, arch: str, overrides: dict) -> None:
    released = tiny_checkpoints(arch, overrides=overrides)
    hf5 = tiny_checkpoints(arch, overrides=overrides, config_style="hf5")
    cfg, cfg5 = _config(released), _config(hf5)
    assert "rope_parameters" in cfg5 and "rope_parameters" not in cfg
    if arch == "deepseek_v3":
        assert cfg["rope_scaling"]["type"] == "yarn" and cfg["rope_scaling"]["factor"] == 4.0
        assert "head_dim" not in cfg and cfg5["head_dim"] == cfg["qk_rope_head_dim"]  # HF's derived alias
        assert cfg["rope_interleave"] is True
    if arch == "glm4_moe":
        assert cfg["partial_rotary_factor"] == 0.25
    ids = _encode(released, PROMPTS[:1])[0] * 8  # > original_max_position_embeddings, so YaRN matters
    assert torch.equal(hf_oracle.hf_all_logits(released, ids), hf_oracle.hf_all_logits(hf5, ids))


def test_overrides_and_bf16(tiny_checkpoints) -> None:
    no_q_lora = tiny_checkpoints("deepseek_v3", overrides={"q_lora_rank": None})
    keys = set(checkpoint_keys(no_q_lora))
    assert "model.layers.0.self_attn.q_proj.weight" in keys
    assert not any("q_a_proj" in k or "q_b_proj" in k for k in keys)
    _assert_hf_loads_identically(no_q_lora)

    bf16 = tiny_checkpoints("glm4_moe_lite", dtype=torch.bfloat16, num_mtp_layers=1)
    with safe_open(str(bf16 / "model.safetensors"), framework="pt") as f:
        dtypes = {k: f.get_slice(k).get_dtype() for k in f.keys()}
    assert {d for k, d in dtypes.items() if k.endswith("e_score_correction_bias")} == {"F32"}
    assert {d for k, d in dtypes.items() if not k.endswith("e_score_correction_bias")} == {"BF16"}
    assert _config(bf16)["torch_dtype"] == "bfloat16"
    _assert_hf_loads_identically(bf16)
    fp32 = tiny_checkpoints("glm4_moe_lite")
    # Same seed, same weights up to rounding: bf16 must be the rounded float32 checkpoint.
    a, b = load_file(str(fp32 / "model.safetensors")), load_file(str(bf16 / "model.safetensors"))
    assert torch.equal(a["model.norm.weight"].to(torch.bfloat16), b["model.norm.weight"])


def test_seeds_give_different_models(tiny_checkpoints) -> None:
    a = load_file(str(tiny_checkpoints("llama", seed=0) / "model.safetensors"))
    b = load_file(str(tiny_checkpoints("llama", seed=1) / "model.safetensors"))
    assert not torch.equal(
        a["model.layers.0.self_attn.q_proj.weight"], b["model.layers.0.self_attn.q_proj.weight"]
    )


@pytest.mark.slow
def test_smollm2_conversion(smollm2: Path) -> None:
    from transformers import AutoTokenizer

    assert (smollm2 / "model.safetensors").is_file() and (smollm2 / "tokenizer.json").is_file()
    cfg = _config(smollm2)
    assert cfg["model_type"] == "llama" and cfg["tie_word_embeddings"] is True
    tok = AutoTokenizer.from_pretrained(smollm2)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    prompt = list(prompt["input_ids"] if isinstance(prompt, dict) or hasattr(prompt, "keys") else prompt)
    out = hf_oracle.hf_greedy(smollm2, [prompt], max_new_tokens=8)[0]
    # A wrong Q/K un-permutation or dequantization would not produce a factual answer.
    assert "Paris" in tok.decode(out), tok.decode(out)

"""Block-FP8 checkpoints (DeepSeek-V3's release format) load dequantized into the compute dtype: greedy tokens
equal Hugging Face's `FineGrainedFP8Config(dequantize=True)` for every architecture, MTP and TP-sliced
parameters equal the dequantized weights exactly, and a bad scale layout is named."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from engine_utils import random_prompts
from fp8_checkpoint import write_fp8_checkpoint
from hf_oracle import hf_greedy
from safetensors.torch import load_file, save_file

from tandem import LLM, SamplingParams
from tandem.config import ModelConfig
from tandem.distributed.groups import SINGLE_RANK, Group, ParallelGroups
from tandem.models.loader import WeightLoadError, build_model

ARCHS = ["llama", "qwen3", "glm4_moe", "deepseek_v3", "glm4_moe_lite"]
PROMPT_LENGTHS = [3, 7, 12, 17, 24, 33, 41, 50]
MAX_TOKENS = 16
# 32 x 32 blocks as in a scaled-down release (128 x 128); MLA's kv_a_proj_with_mqa has 40 rows (32 + rope 8),
# and HF derives the block size from the scale grid (40 // 2 = 20 rows a block), so MLA models use 8-row
# blocks, for which every dim is a whole number of blocks. Partial blocks are pinned below against our own
# dequantization instead.
BLOCKS = {"deepseek_v3": (8, 32), "glm4_moe_lite": (8, 32)}


def _fp8_copy(tiny_checkpoints, tmp_path_factory, arch: str, block: tuple[int, int] | None = None,
              **kwargs) -> tuple[Path, dict[str, torch.Tensor]]:
    src = tiny_checkpoints(arch, **kwargs)
    block = block or BLOCKS.get(arch, (32, 32))
    dst = tmp_path_factory.mktemp(f"{arch}-fp8")
    return dst, write_fp8_checkpoint(src, dst, block)


@pytest.mark.parametrize("arch", ARCHS)
def test_fp8_greedy_tokens_match_hf_dequantized(arch, tiny_checkpoints, tmp_path_factory):
    path, _ = _fp8_copy(tiny_checkpoints, tmp_path_factory, arch)
    prompts = random_prompts(PROMPT_LENGTHS, vocab_size=500, seed=len(arch))
    expected = hf_greedy(path, prompts, MAX_TOKENS)
    llm = LLM(str(path), dtype="float32")
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True), use_tqdm=False)
    for i, (out, ref) in enumerate(zip(outs, expected, strict=True)):
        got = out.outputs[0].token_ids
        assert got == ref, f"{arch} FP8 prompt {i} (len {len(prompts[i])}): tandem {got} != HF {ref}"


def _params(path: Path, groups: ParallelGroups = SINGLE_RANK, with_mtp: bool = False) -> dict:
    model = build_model(ModelConfig.from_path(str(path), dtype="float32"), groups, with_mtp=with_mtp)
    return dict(model.named_parameters())


def test_fp8_mtp_layers_dequantize_exactly(tiny_checkpoints, tmp_path_factory):
    # 24 x 16 blocks: 40-row kv_a_proj_with_mqa and 96-row q_b_proj end in partial row blocks.
    path, expected = _fp8_copy(tiny_checkpoints, tmp_path_factory, "deepseek_v3", (24, 16), num_mtp_layers=1)
    params = _params(path, with_mtp=True)
    layer = "model.layers.3."
    checks = {"mtp.layers.0.eh_proj.weight": layer + "eh_proj.weight",
              "mtp.layers.0.mtp_block.self_attn.kv_a_proj_with_mqa.weight":
                  layer + "self_attn.kv_a_proj_with_mqa.weight",
              "mtp.layers.0.mtp_block.self_attn.q_b_proj.weight": layer + "self_attn.q_b_proj.weight"}
    for param, tensor in checks.items():
        assert torch.equal(params[param], expected[tensor]), f"{param} != dequantized {tensor}"
    w13 = params["mtp.layers.0.mtp_block.mlp.experts.w13_weight"][5]  # [2 * inter, H]
    ref = torch.cat([expected[layer + f"mlp.experts.5.{k}_proj.weight"] for k in ("gate", "up")])
    assert torch.equal(w13, ref), "MTP routed expert 5 gate/up != dequantized checkpoint"


def test_fp8_tp_slices_cut_blocks_and_match_dequantized_full_weights(tiny_checkpoints, tmp_path_factory):
    # 32-col / 24-row blocks: TP=2 halves q_b_proj's 96 rows (48 = 2 blocks) and o_proj's 64 input columns at
    # 32, and kv_b_proj's 128 rows at 64, inside row block 2 (48..72): each rank reads a cut block.
    path, expected = _fp8_copy(tiny_checkpoints, tmp_path_factory, "deepseek_v3", (24, 32))
    for rank in range(2):
        params = _params(path, ParallelGroups(tp=Group(rank, 2)))
        attn = "model.layers.0.self_attn."
        for name, dim in (("q_b_proj", 0), ("kv_b_proj", 0), ("o_proj", 1)):
            full = expected[attn + name + ".weight"]
            size = full.shape[dim] // 2
            got = params[attn + name + ".weight"]
            assert torch.equal(got, full.narrow(dim, rank * size, size)), f"rank {rank}: {name} slice differs"
        down = params["model.layers.1.mlp.experts.w2_weight"][3]  # [H, inter / 2]
        full = expected["model.layers.1.mlp.experts.3.down_proj.weight"]
        assert torch.equal(down, full.narrow(1, rank * 16, 16)), f"rank {rank}: expert 3 down_proj slice differs"


def test_fp8_scale_of_wrong_shape_is_named(tiny_checkpoints, tmp_path_factory):
    path, _ = _fp8_copy(tiny_checkpoints, tmp_path_factory, "llama")
    tensors = load_file(path / "model.safetensors")
    name = "model.layers.1.mlp.down_proj.weight_scale_inv"
    tensors[name] = tensors[name][:, :1].contiguous()
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(WeightLoadError, match=r"'model\.layers\.1\.mlp\.down_proj\.weight_scale_inv' has shape "
                                              r"\(2, 1\), .* weight_block_size \[32, 32\] needs \(2, 4\)"):
        _params(path)
    del tensors[name]
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(WeightLoadError, match=r"float8 tensor 'model\.layers\.1\.mlp\.down_proj\.weight' has no"):
        _params(path)


@pytest.mark.parametrize(("quant", "message"), [
    ({"quant_method": "awq"}, r"quant_method='awq' is not supported"),
    ({"quant_method": "fp8", "weight_block_size": None}, r"weight_block_size=None is not supported"),
    ({"quant_method": "fp8", "activation_scheme": "static", "weight_block_size": [32, 32]},
     r"activation_scheme='static' is not supported"),
])
def test_unsupported_quantization_config_is_named(quant, message, tiny_checkpoints, tmp_path_factory):
    path, _ = _fp8_copy(tiny_checkpoints, tmp_path_factory, "llama")
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "quantization_config": quant}))
    with pytest.raises(WeightLoadError, match=message):
        _params(path)

"""Bad input gets a clear error naming the problem, and nothing already accepted is lost."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from engine_utils import random_prompts
from safetensors.torch import load_file, save_file

from tandem import LLM, SamplingParams
from tandem.config import ConfigError
from tandem.entrypoints.cli import main as cli_main
from tandem.models.loader import WeightLoadError


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _edit_weights(folder: Path, edit) -> None:
    (file,) = folder.glob("*.safetensors")
    tensors = load_file(str(file))
    edit(tensors)
    save_file(tensors, str(file), metadata={"format": "pt"})


def test_unknown_architecture_lists_supported(tiny_checkpoints, tmp_path):
    folder = _copy(tiny_checkpoints("llama"), tmp_path / "m")
    cfg = json.loads((folder / "config.json").read_text())
    cfg["architectures"] = ["FooForCausalLM"]
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"FooForCausalLM.*DeepseekV3ForCausalLM.*LlamaForCausalLM"):
        LLM(str(folder))


def test_missing_weight_is_named(tiny_checkpoints, tmp_path):
    folder = _copy(tiny_checkpoints("llama"), tmp_path / "m")
    _edit_weights(folder, lambda t: t.pop("model.layers.1.mlp.down_proj.weight"))
    with pytest.raises(WeightLoadError, match=r"missing.*model\.layers\.1\.mlp\.down_proj\.weight"):
        LLM(str(folder))


def test_missing_half_of_a_fused_weight_is_named(tiny_checkpoints, tmp_path):
    folder = _copy(tiny_checkpoints("qwen3"), tmp_path / "m")
    _edit_weights(folder, lambda t: t.pop("model.layers.0.self_attn.k_proj.weight"))
    with pytest.raises(WeightLoadError, match=r"missing.*model\.layers\.0\.self_attn\.qkv_proj\.weight"):
        LLM(str(folder))


def test_extra_weight_is_named(tiny_checkpoints, tmp_path):
    folder = _copy(tiny_checkpoints("llama"), tmp_path / "m")
    _edit_weights(folder, lambda t: t.update({"model.layers.0.mlp.surprise.weight": t["model.norm.weight"].clone()}))
    with pytest.raises(WeightLoadError, match=r"unexpected.*model\.layers\.0\.mlp\.surprise\.weight"):
        LLM(str(folder))


def test_malformed_config_and_missing_folder(tmp_path):
    with pytest.raises(ConfigError, match="no config.json"):
        LLM(str(tmp_path / "nowhere"))
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        LLM(str(tmp_path))



def test_missing_bundled_model_is_named(monkeypatch, tmp_path):
    # LLM() with no model uses tandem/assets; should that folder be gone, the error says where it looked
    monkeypatch.setattr("tandem.assets.DEFAULT_MODEL", tmp_path / "gone")
    with pytest.raises(ConfigError, match=r"model=None: the bundled default model is missing from .*gone; pass MODEL"):
        LLM()


@pytest.mark.parametrize("kwargs,field", [
    ({"block_size": 3}, "block_size"), ({"max_num_seqs": 0}, "max_num_seqs"), ({"dtype": "int4"}, "dtype"),
    ({"max_model_len": 100000}, "max_model_len"), ({"speculative_config": {"method": "eagle9"}}, "method"),
    ({"attention_config": {"colour": "blue"}}, "attention_config"),
])
def test_invalid_engine_argument_names_the_field(tiny_checkpoints, kwargs, field):
    with pytest.raises(ConfigError, match=field):
        LLM(str(tiny_checkpoints("llama")), **kwargs)


def test_too_long_prompt_fails_alone_and_others_finish(tiny_checkpoints):
    llm = LLM(str(tiny_checkpoints("llama")), dtype="float32", max_model_len=64)
    short1, too_long, short2 = random_prompts([10, 64, 20], vocab_size=500, seed=1)
    outs = llm.generate([{"prompt_token_ids": p} for p in (short1, too_long, short2)],
                        SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert outs[1].error is not None and "64 tokens" in outs[1].error and "max_model_len" in outs[1].error
    assert outs[1].outputs[0].finish_reason == "error"
    for ok in (outs[0], outs[2]):
        assert ok.error is None and len(ok.outputs[0].token_ids) == 8 and ok.outputs[0].finish_reason == "length"


@pytest.mark.parametrize("kwargs,field", [
    ({"temperature": -0.5}, "temperature"), ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p"),
    ({"top_k": -3}, "top_k"), ({"min_p": 2.0}, "min_p"), ({"max_tokens": 0}, "max_tokens"),
    ({"logprobs": -1}, "logprobs"), ({"stop": [""]}, "stop"), ({"n": 0}, "n"),
    ({"min_tokens": 9, "max_tokens": 4}, "min_tokens"),
])
def test_invalid_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=rf"SamplingParams\.{field}="):
        SamplingParams(**kwargs)


def test_cli_reports_bad_model_folder_cleanly(tmp_path, capsys):
    assert cli_main(["generate", str(tmp_path), "-p", "hi"]) == 2
    assert "no config.json" in capsys.readouterr().err


@pytest.mark.parametrize("kwargs,message", [
    ({"speculative_config": {"method": "ngram", "num_speculative_tokens": 2, "adaptive_verification": True}},
     "adaptive_verification"),
    ({"prefill_context_parallel_size": 2, "compilation_config": {"cudagraph_mode": "FULL"}}, "FULL.*PIECEWISE"),
])
def test_unsupported_combinations_are_rejected_at_start_up(tiny_checkpoints, kwargs, message):
    with pytest.raises(ConfigError, match=message):
        LLM(str(tiny_checkpoints("llama")), **kwargs)


def test_sparse_mla_and_dcp_are_rejected(tiny_checkpoints, tmp_path):
    from tandem.config import EngineConfig, ModelConfig, ParallelConfig

    folder = _copy(tiny_checkpoints("deepseek_v3"), tmp_path / "m")
    cfg = json.loads((folder / "config.json").read_text())
    cfg["index_topk"] = 2048
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="sparse MLA"):
        LLM(str(folder))
    model = ModelConfig.from_path(str(tiny_checkpoints("deepseek_v3")))
    with pytest.raises(ConfigError, match="decode_context_parallel_size"):
        EngineConfig(model, parallel_config=ParallelConfig(decode_context_parallel_size=2)).validate()

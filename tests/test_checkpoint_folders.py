"""Checkpoint folders as the ecosystem writes them: transformers' save_pretrained (sharded, with an index, MTP
declared but not saved) loads and matches HF; MTP tensors are read only when MTP drafts; the index is the
checkpoint (a missing shard or tensor is named, a stray file is not read)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from engine_utils import random_prompts
from hf_oracle import hf_greedy
from hf_saved import save_pretrained_copy
from safetensors.torch import load_file, save_file

from tandem import LLM, SamplingParams
from tandem.config import ModelConfig
from tandem.distributed.groups import SINGLE_RANK
from tandem.models import checkpoint_reader
from tandem.models.loader import WeightLoadError, build_model

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
MTP = {"method": "mtp", "num_speculative_tokens": 1}


@pytest.fixture(scope="module")
def hf_saved(tiny_checkpoints, tmp_path_factory) -> Path:
    src = tiny_checkpoints("deepseek_v3", num_mtp_layers=1)
    return save_pretrained_copy(src, tmp_path_factory.mktemp("hf-saved"))


def _copy(folder: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(folder, tmp_path / "copy"))


def _build(folder: Path, with_mtp: bool = False):
    return build_model(ModelConfig.from_path(str(folder), dtype="float32"), SINGLE_RANK, with_mtp=with_mtp)


def test_save_pretrained_sharded_folder_matches_hf(hf_saved):
    index = json.loads((hf_saved / "model.safetensors.index.json").read_text())["weight_map"]
    config = json.loads((hf_saved / "config.json").read_text())
    assert len(set(index.values())) > 1, "the fixture should be sharded"
    assert config["num_nextn_predict_layers"] == 1 and not any(k.startswith("model.layers.3.") for k in index)
    prompts = random_prompts([3, 9, 16, 25, 31, 40, 47, 60], vocab_size=500, seed=13)
    expected = hf_greedy(hf_saved, prompts, GREEDY.max_tokens)
    outs = LLM(str(hf_saved), dtype="float32").generate([{"prompt_token_ids": p} for p in prompts], GREEDY,
                                                        use_tqdm=False)
    for i, (out, ref) in enumerate(zip(outs, expected, strict=True)):
        assert out.outputs[0].token_ids == ref, f"prompt {i}: tandem {out.outputs[0].token_ids} != HF {ref}"


def test_mtp_asked_of_a_folder_without_mtp_tensors_names_them(hf_saved):
    with pytest.raises(WeightLoadError, match=r"MTP drafting needs the checkpoint's MTP layers "
                                              r"\(num_nextn_predict_layers=1\).*model\.layers\.3\.eh_proj\.weight"):
        LLM(str(hf_saved), dtype="float32", speculative_config=MTP)


def test_mtp_tensors_are_read_only_when_mtp_drafts(tiny_checkpoints, monkeypatch):
    folder = tiny_checkpoints("deepseek_v3", num_mtp_layers=1)
    read: list[str] = []
    original = checkpoint_reader.CheckpointTensor.materialize

    def recording(self):
        read.append(self.name)
        return original(self)

    monkeypatch.setattr(checkpoint_reader.CheckpointTensor, "materialize", recording)
    model = _build(folder)
    assert model.mtp is None and not any(n.startswith("mtp.") for n, _ in model.named_parameters())
    assert read and not [n for n in read if n.startswith("model.layers.3.")], "MTP tensors read without MTP"
    read.clear()
    model = _build(folder, with_mtp=True)
    assert "model.layers.3.eh_proj.weight" in read
    ref = load_file(folder / "model.safetensors")["model.layers.3.eh_proj.weight"]
    assert torch.equal(model.mtp.layers[0].eh_proj.weight, ref)


def test_missing_shard_is_named(hf_saved, tmp_path):
    folder = _copy(hf_saved, tmp_path)
    (folder / "model-00002-of-00006.safetensors").unlink()
    with pytest.raises(WeightLoadError, match=r"shard 'model-00002-of-00006\.safetensors' named in "
                                              r"model\.safetensors\.index\.json is missing"):
        _build(folder)


def test_index_is_the_checkpoint(hf_saved, tmp_path):
    folder = _copy(hf_saved, tmp_path)
    # a stray file beside the shards (e.g. a consolidated copy) is not read: it would be unexpected
    save_file({"model.layers.0.mlp.surprise.weight": torch.zeros(2)}, str(folder / "consolidated.safetensors"))
    _build(folder)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    shard = index["weight_map"]["model.norm.weight"]
    tensors = load_file(folder / shard)
    del tensors["model.norm.weight"]
    save_file(tensors, str(folder / shard))
    with pytest.raises(WeightLoadError, match=rf"tensor 'model\.norm\.weight' is not in shard '{shard}'"):
        _build(folder)

"""The training command's pieces reproduce learning from scratch: a few target steps (trunk + MTP depths) and a
few DSpark steps on a shrunk config make their losses fall; the saved folders load in tandem and transformers."""

from __future__ import annotations

import json

import torch

from tandem.data.gsm8k import synthetic_split
from tandem.train.dspark import TargetFeatures, _init_drafter, drafter_loss, dspark_config, save_dspark
from tandem.train.loop import Phase, save_target, train_target
from tandem.train.target import TARGET_CONFIG
from tandem.train.tokenizer import train_tokenizer

TINY = {**TARGET_CONFIG, "vocab_size": 320, "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32,
        "num_hidden_layers": 2, "q_lora_rank": 32, "kv_lora_rank": 64, "qk_rope_head_dim": 16,
        "qk_nope_head_dim": 16, "v_head_dim": 16}


def _tokenizer(tmp_path):
    from tokenizers import Tokenizer

    train_tokenizer(tmp_path / "tok", synthetic_split("train", 400), vocab_size=TINY["vocab_size"])
    return Tokenizer.from_file(str(tmp_path / "tok" / "tokenizer.json"))


def test_target_training_loss_falls_and_checkpoint_loads(tmp_path):
    torch.manual_seed(0)
    tok = _tokenizer(tmp_path)
    encode = lambda s: tok.encode(s, add_special_tokens=False).ids  # noqa: E731
    model, history = train_target([], encode, (Phase(24, 4, 128),), seed=0, peak_lr=3e-3,
                                  log=lambda _: None, config=TINY)
    first, last = history[0], history[-1]
    assert last["loss"] < first["loss"] - 1.0, (first, last)
    assert last["mtp1"] < first["mtp1"] - 1.0, (first, last)
    out = save_target(model, tmp_path / "tok", tmp_path / "target", config=TINY)
    raw = json.loads((out / "config.json").read_text())
    assert raw["num_nextn_predict_layers"] == 1 and raw["architectures"] == ["DeepseekV3ForCausalLM"]

    # tandem (with its MTP layer) and transformers read the folder and agree on greedy tokens
    import transformers

    from tandem import LLM, SamplingParams

    ids = tok.encode("Question: Ava has 3 apples.").ids
    assert ids[0] == 0, "the tokenizer prepends <|bos|>"
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    expect = hf.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False, min_new_tokens=8)[0, len(ids):]
    # --resume-from reads the folder back into the training module exactly as transformers reads it
    from tandem.train.loop import load_for_training

    with torch.no_grad():
        resumed = load_for_training(out, TINY).eval()(torch.tensor([ids]))[0]
        assert torch.equal(resumed, hf(torch.tensor([ids])).logits)
    llm = LLM(str(out), dtype="float32", speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    got = llm.generate([{"prompt_token_ids": ids}], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0].token_ids
    assert list(got) == expect.tolist()

    # DSpark: a few steps on the target's features lower the drafter's loss
    raw_d = dspark_config(TINY)
    from tandem.models.dspark import DSparkConfig, DSparkDrafter

    cfg = DSparkConfig(**{k: tuple(v) if k == "target_layer_ids" else v for k, v in raw_d.items()
                          if k not in ("architectures", "model_type", "torch_dtype")})
    target = TargetFeatures(out, list(cfg.target_layer_ids))
    drafter = DSparkDrafter(cfg, max_position=512)
    _init_drafter(drafter, 0)
    opt = torch.optim.AdamW([p for p in drafter.parameters() if p.requires_grad], lr=3e-3)
    seq = torch.tensor([tok.encode("".join(f"Question: {p.question}\nAnswer: {p.answer}\n\n"
                                           for p in synthetic_split("train", 3))).ids[:160]], dtype=torch.long)
    anchors = torch.arange(20, 150, 6)
    losses = []
    for _ in range(15):
        loss, _ = drafter_loss(drafter, target, seq, anchors)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 1.0, losses
    saved = save_dspark(drafter, raw_d, tmp_path / "dspark")
    llm = LLM(str(out), dtype="float32",
              speculative_config={"method": "dspark", "model": str(saved), "num_speculative_tokens": 3})
    got = llm.generate([{"prompt_token_ids": ids}], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0].token_ids
    assert list(got) == expect.tolist()

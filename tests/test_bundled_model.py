"""The bundled default model (tandem/assets): what ships, that transformers reads it and agrees with tandem
token for token, that `LLM()` / `tandem generate` / `tandem eval gsm8k` use it with no model argument."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from tandem import LLM, SamplingParams
from tandem.assets import DEFAULT_DSPARK, DEFAULT_MODEL
from tandem.entrypoints import cli

PROMPTS = [
    "Question: Mia has 23 stickers. Ben gives Mia 18 more stickers. How many stickers does Mia have now?\nAnswer:",
    "Question: A baker makes 4 trays of 12 rolls. How many rolls does the baker make?\nAnswer:",
    "Question: Sam had 50 marbles and gave 17 of them to Kai. How many marbles does Sam have left?\nAnswer:",
    "Question: Weng earns $12 an hour for babysitting. Yesterday she babysat for 5 hours. How much did she earn?"
    "\nAnswer:",
]


def test_bundle_is_small_bf16_and_complete():
    total = sum(f.stat().st_size for d in (DEFAULT_MODEL, DEFAULT_DSPARK) for f in d.iterdir())
    assert total <= 20 * 1000 * 1000, f"bundle is {total / 1e6:.1f} MB, over 20 MB"
    for folder in (DEFAULT_MODEL, DEFAULT_DSPARK):
        with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
            dtypes = {k: f.get_slice(k).get_dtype() for k in f.keys()}
        assert {d for k, d in dtypes.items() if not k.endswith("e_score_correction_bias")} == {"BF16"}
    config = json.loads((DEFAULT_MODEL / "config.json").read_text())
    # what vLLM's MLA kernels and transformers expect of a DeepSeek-V3 checkpoint
    assert (config["kv_lora_rank"], config["qk_rope_head_dim"], config["topk_method"], config["scoring_func"]) == (
        512, 64, "noaux_tc", "sigmoid")
    assert config["num_nextn_predict_layers"] == 1


def test_transformers_greedy_equals_tandem_on_the_bundled_model():
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(str(DEFAULT_MODEL), dtype=torch.float32)
    tok = transformers.AutoTokenizer.from_pretrained(str(DEFAULT_MODEL))
    llm = LLM(dtype="float32")  # no model: the bundled one
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs, strict=True):
        ids = tok(prompt, return_tensors="pt").input_ids
        assert ids[0, 0].item() == tok.bos_token_id and list(out.prompt_token_ids) == ids[0].tolist()
        expect = hf.generate(ids, max_new_tokens=24, min_new_tokens=24, do_sample=False)[0, ids.shape[1]:]
        assert list(out.outputs[0].token_ids) == expect.tolist(), prompt


def test_generate_with_no_model_answers_with_pcp2_and_mtp(capsys):
    code = cli.main(["generate", "-pcp", "2", "--speculative-config", '{"method": "mtp", "num_speculative_tokens": 3}',
                     "--max-tokens", "96", "--stop", "\\n\\n", "-p", PROMPTS[0].replace("\n", "\\n")])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "####" in out, out
    assert "speculative decoding: acceptance rate" in out and "mean acceptance length" in out


def test_eval_gsm8k_runs_on_the_synthetic_split_with_mtp(capsys, tmp_path):
    code = cli.main(["eval", "gsm8k", "--num-questions", "12", "--num-shots", "2", "--max-tokens", "96",
                     "--speculative-config", '{"method": "mtp", "num_speculative_tokens": 3}',
                     "--output-json", str(tmp_path / "r.json")])
    assert code == 0
    table = capsys.readouterr().out
    assert "| Configuration | Correct | Accuracy | Invalid | Acceptance rate | Acceptance length" in table
    (row,) = json.loads((tmp_path / "r.json").read_text())
    assert row["total"] == 12 and row["correct"] >= 3, row  # the trained model answers easy problems
    assert row["acceptance_length"] > 1.5, row


@pytest.mark.parametrize("method", ["dspark"])
def test_dspark_defaults_to_the_bundled_drafter(method):
    llm = LLM(dtype="float32", speculative_config={"method": method, "num_speculative_tokens": 3})
    assert llm.engine.config.speculative_config.model == str(DEFAULT_DSPARK)
    out = llm.generate(PROMPTS[:2], SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)
    metrics = {m.name: getattr(m, "value", None) for m in llm.get_metrics()}
    assert metrics["tandem:spec_decode_mean_acceptance_length"] > 1.0 and out[0].outputs[0].token_ids


def test_acceptance_aligns_across_pcp_draft_modes_and_padding():
    """Issue 5, must-show 4, on the trained MTP head: the same prompts and seeds give the same acceptance rate
    and mean acceptance length (|delta| <= 0.001 / 0.003) at PCP=1, PCP=2 sharded, PCP=2 replicated and PCP=2
    padded (PIECEWISE). On CPU in float32 every layout computes the same tokens, so the deltas are in fact 0."""
    from tandem.eval.gsm8k import build_prompts, load_eval_data

    questions, shots, _ = load_eval_data("synthetic", None, 8, 2, seed=42)
    prompts = build_prompts(questions, shots)
    mtp = {"method": "mtp", "num_speculative_tokens": 3}
    layouts = {
        "PCP1": {},
        "PCP2 sharded": {"prefill_context_parallel_size": 2},
        "PCP2 replicated": {"prefill_context_parallel_size": 2,
                            "speculative_config": {**mtp, "attention_backend": "CONTIGUOUS_MLA"}},
        "PCP2 padded": {"prefill_context_parallel_size": 2,
                        "compilation_config": {"cudagraph_mode": "PIECEWISE", "cudagraph_capture_sizes": [1, 2, 4, 8]}},
    }
    figures = {}
    for name, extra in layouts.items():
        llm = LLM(dtype="float32", max_num_batched_tokens=256, **{"speculative_config": mtp, **extra})
        try:
            assert llm.draft_mode == ("replicated" if "replicated" in name else "sharded" if "PCP2" in name else
                                      llm.draft_mode)
            llm.generate(prompts, SamplingParams(temperature=0, max_tokens=64, stop=["\n\n"]), use_tqdm=False)
            m = {x.name: getattr(x, "value", None) for x in llm.get_metrics()}
        finally:
            llm.shutdown()
        figures[name] = (m["tandem:spec_decode_acceptance_rate"], m["tandem:spec_decode_mean_acceptance_length"])
    rate0, length0 = figures["PCP1"]
    assert length0 > 1.5, figures  # a trained head: drafts are accepted
    for name, (rate, length) in figures.items():
        assert abs(rate - rate0) <= 0.001 and abs(length - length0) <= 0.003, (name, figures)


def test_chat_template_renders_the_trained_layout():
    import jinja2

    from tandem.data.gsm8k import Problem, few_shot_prompt

    template = json.loads((DEFAULT_MODEL / "tokenizer_config.json").read_text())["chat_template"]
    shot = Problem("1+1?", "1+1 = <<1+1=2>>2\n#### 2")
    messages = [{"role": "user", "content": shot.question}, {"role": "assistant", "content": shot.answer},
                {"role": "user", "content": "2+2?"}]
    rendered = jinja2.Template(template).render(messages=messages, add_generation_prompt=True)
    assert rendered == few_shot_prompt([shot], "2+2?")

"""Stop rules: EOS (unless ignore_eos), stop token ids, stop strings, max_tokens, min_tokens; and the CLI."""

from __future__ import annotations

import pytest
from engine_utils import random_prompts

from tandem import LLM, SamplingParams
from tandem.entrypoints.cli import main as cli_main


@pytest.fixture(scope="module")
def llm_and_run(tiny_checkpoints):
    llm = LLM(str(tiny_checkpoints("llama")), dtype="float32")
    (prompt,) = random_prompts([12], vocab_size=500, seed=11)
    free = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0]
    return llm, prompt, free


def test_stop_token_id_ends_generation(llm_and_run):
    llm, prompt, free = llm_and_run
    stop_at = free.token_ids[5]
    first = free.token_ids.index(stop_at)
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True,
                       stop_token_ids=[stop_at]), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == free.token_ids[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_at


def test_eos_stops_unless_ignored_and_min_tokens_defers_it(llm_and_run):
    llm, prompt, free = llm_and_run
    eos = free.token_ids[3]
    llm.engine.tokenizer.eos_token_ids = {eos}
    try:
        params = SamplingParams(temperature=0, max_tokens=24)
        out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0]
        assert out.token_ids == free.token_ids[: free.token_ids.index(eos) + 1] and out.finish_reason == "stop"
        later = SamplingParams(temperature=0, max_tokens=24, min_tokens=free.token_ids.index(eos) + 2)
        out = llm.generate([{"prompt_token_ids": prompt}], later, use_tqdm=False)[0].outputs[0]
        assert len(out.token_ids) > free.token_ids.index(eos) + 1
    finally:
        llm.engine.tokenizer.eos_token_ids = set()


def test_stop_string_truncates_text(llm_and_run):
    llm, prompt, free = llm_and_run
    full = llm.engine.tokenizer.decode(free.token_ids)
    stop = full[len(full) // 2: len(full) // 2 + 3]
    assert stop.strip(), "need a visible stop string"
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True,
                       stop=[stop]), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == full[: full.index(stop)]
    assert len(out.token_ids) < len(free.token_ids)


def test_max_tokens_gives_length(llm_and_run):
    llm, prompt, free = llm_and_run
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    assert out.token_ids == free.token_ids[:5] and out.finish_reason == "length"


def test_cli_generate_prints_text_and_summary(tiny_checkpoints, capsys):
    rc = cli_main(["generate", str(tiny_checkpoints("llama")), "-p", "12+7=", "-p", "The cat",
                   "--max-tokens", "6", "--ignore-eos", "--dtype", "float32"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "--- prompt: '12+7='" in out and "=== 2 prompts, 12 generated tokens" in out

"""`tandem eval gsm8k --matrix` with a drafter of the user's choice (an EAGLE-3 head on a GQA target): the rows
draft with it, their replicated rows name the GQA non-PCP backend, and acceptance equals across layouts; `--chat`
renders the questions through the model's chat template."""

from __future__ import annotations

import pytest
from eagle3_checkpoint import build_eagle3_head

from tandem.data.gsm8k import synthetic_split
from tandem.eval import gsm8k as ev


def test_matrix_rows_draft_with_the_given_head():
    drafter = {"method": "eagle3", "model": "/heads/h"}
    rows = dict(ev.matrix_configs(3, drafter, "full_attention", tp=3, pcp_sizes=(2, 3)))
    assert "TP3 + greedy fixed K" in rows and rows["TP3 + greedy fixed K"]["tensor_parallel_size"] == 3
    for p in (2, 3):
        replicated = rows[f"PCP{p} + greedy fixed K, replicated draft"]
        assert replicated["prefill_context_parallel_size"] == p
        assert replicated["speculative_config"]["attention_backend"] == "CONTIGUOUS_SDPA"
        assert rows[f"PCP{p} sharded KV + greedy fixed K"]["pcp_kv_layout"] == "sharded"
    assert all(cfg["speculative_config"]["method"] == "eagle3" and cfg["speculative_config"]["model"] == "/heads/h"
               and cfg["speculative_config"]["num_speculative_tokens"] == 3 for cfg in rows.values())
    assert not any("DSpark" in name for name in rows)
    default = dict(ev.matrix_configs(3))  # the bundled model's table: MTP rows, a DSpark row, MLA's backend
    assert "PCP2 + DSpark greedy fixed K" in default
    assert default["PCP2 + greedy fixed K, replicated draft"]["speculative_config"]["attention_backend"] \
        == "CONTIGUOUS_MLA"


def test_eagle3_matrix_rows_have_equal_acceptance(tiny_checkpoints, tmp_path):
    target = tiny_checkpoints("llama")
    head = build_eagle3_head(target, tmp_path / "head", aux_layer_ids=[0, 1, 2])
    base = {"model": str(target), "dtype": "float32", "max_num_batched_tokens": 64,
            "speculative_config": {"method": "eagle3", "model": str(head), "num_speculative_tokens": 2}}
    questions, shots = synthetic_split("test", 4), synthetic_split("shots", 2)
    rows = ["TP2 + greedy fixed K", "PCP2 + greedy fixed K", "PCP2 sharded KV + greedy fixed K, replicated draft"]
    results = ev.run_matrix(base, questions, shots, 16, 0.0, 42, 2, rows)
    assert [r.name for r in results] == rows and not any(r.note for r in results)
    lengths = {r.acceptance_length for r in results}
    assert len(lengths) == 1 and None not in lengths, f"acceptance lengths differ across layouts: {lengths}"
    assert "| TP2 + greedy fixed K |" in ev.format_table(results)


@pytest.mark.slow
def test_chat_prompts_render_shots_as_turns(smollm2):
    questions, shots = synthetic_split("test", 2), synthetic_split("shots", 2)
    prompts = ev.build_prompts(questions, shots, str(smollm2))
    assert len(prompts) == 2
    for q, text in zip(questions, prompts, strict=True):
        assert text.count("<|im_start|>user") == 3 and text.count("<|im_start|>assistant") == 3
        assert text.rstrip().endswith("<|im_start|>assistant") and q.question in text
        assert shots[0].answer in text
    assert ev.stop_strings(chat=True) is None and ev.stop_strings(chat=False) == ev.STOP_STRINGS


def test_a_row_whose_rank_dies_is_noted_and_the_rest_still_run(tiny_checkpoints, monkeypatch, capsys):
    from tandem.executor.multiproc import EngineDeadError

    def fake_run(name, engine, *args):
        if name == "PCP2 + greedy fixed K":
            raise EngineDeadError("engine stopped: rank 0 died (exit code -9)")
        return ev.EvalResult(name, correct=1, total=2, acceptance_rate=0.5, acceptance_length=2.0)

    monkeypatch.setattr(ev, "run_in_process", fake_run)
    rows = ["TP2 + greedy fixed K", "PCP2 + greedy fixed K", "PCP2 + greedy fixed K + PIECEWISE"]
    results = ev.run_matrix({"model": str(tiny_checkpoints("llama"))}, [], [], 16, 0.0, 42, 2, rows)
    assert [r.name for r in results] == rows
    assert results[1].note.startswith("failed: engine stopped: rank 0 died") and not results[2].note
    printed = capsys.readouterr().err
    assert printed.count("| TP2 + greedy fixed K |") == 3, "the table so far is printed after every row"

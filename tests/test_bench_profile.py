"""`tandem bench profile` end to end on a tiny random Llama: per batch size, the parts of a step and "other" add
up to the step time, the forward is a real share of it and the step time fits in the generate's wall; the wrappers
come off afterwards; bad flags exit 2 naming the flag."""

from __future__ import annotations

import json

import pytest

import tandem.runner.model_runner as model_runner
from tandem import LLM
from tandem.bench.profile import PARTS, StepTimer
from tandem.entrypoints import cli


def test_parts_add_up_to_the_step_time(tiny_checkpoints, tmp_path, capsys):
    out = tmp_path / "profile.json"
    rc = cli.main(["bench", "profile", str(tiny_checkpoints("llama")), "--dtype", "float32", "--batch-sizes", "2", "1",
                   "--max-tokens", "6", "--kv-cache-memory-bytes", str(16 << 20), "--output-json", str(out)])
    printed = capsys.readouterr().out
    assert rc == 0, printed
    rows = json.loads(out.read_text())["results"]
    assert [r["batch_size"] for r in rows] == [1, 2], rows
    for r in rows:
        seconds = r["seconds"]
        assert set(seconds) == {*PARTS, "other"}, seconds
        assert sum(seconds.values()) == pytest.approx(r["step_s"]), (seconds, r["step_s"])
        assert all(seconds[p] >= 0 for p in PARTS) and seconds["other"] >= -0.01 * r["step_s"], seconds
        assert r["share"]["forward"] > 0.05 and 0 < r["step_s"] <= r["wall_s"], r
    assert "| 2 |" in printed and "forward" in printed, printed


def test_wrappers_come_off_after_the_timed_run(tiny_checkpoints):
    llm = LLM(str(tiny_checkpoints("llama")), dtype="float32")
    try:
        prepare = model_runner.prepare_inputs
        with StepTimer().installed(llm) as timer:
            assert "step" in vars(llm.engine) and model_runner.prepare_inputs is not prepare
            llm.generate(["Hi"], use_tqdm=False)
        assert timer.totals["step"] > 0 and timer.totals["forward"] > 0, dict(timer.totals)
        assert "step" not in vars(llm.engine) and model_runner.prepare_inputs is prepare
        assert "forward" not in vars(llm.engine.executor.runner.model)
    finally:
        llm.shutdown()


@pytest.mark.parametrize("extra, flag", [
    (["--batch-sizes", "0"], "--batch-sizes"),
    (["--max-tokens", "0"], "--max-tokens"),
    (["-pcp", "2"], "-pcp"),
])
def test_bad_flag_exits_2_naming_it(tiny_checkpoints, extra, flag, capsys):
    assert cli.main(["bench", "profile", str(tiny_checkpoints("llama")), *extra]) == 2
    err = capsys.readouterr().err
    assert flag in err, err

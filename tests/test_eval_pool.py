"""`tandem eval gsm8k` names its few-shot pool and never pairs real questions with synthetic shots unasked;
`python -m tandem` is the CLI."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tandem.entrypoints.cli import main
from tandem.eval import gsm8k as ev

QUESTION = {"question": "Tom has 3 apples and buys 5 more. How many apples does he have?", "answer": "3+5=8\n#### 8"}


@pytest.fixture
def real_questions(tmp_path, monkeypatch) -> str:
    path = tmp_path / "test.jsonl"
    path.write_text("\n".join(json.dumps(QUESTION) for _ in range(3)) + "\n")
    monkeypatch.setattr(ev, "SHARED_GSM8K", tmp_path / "no-shared")  # a checkout without ../shared
    return str(path)


def test_real_questions_without_a_pool_are_refused_unless_asked(real_questions, tmp_path, capsys):
    with pytest.raises(ValueError, match=r"few-shot pool .*no-shared/train\.jsonl is missing: give --shots-data "
                                         r"FILE .*or --allow-synthetic-shots"):
        ev.load_eval_data(real_questions, None, None, 2, seed=0)
    assert main(["eval", "gsm8k", "--data", real_questions]) == 2
    assert "--allow-synthetic-shots" in capsys.readouterr().err
    _, shots, pool = ev.load_eval_data(real_questions, None, None, 2, seed=0, allow_synthetic_shots=True)
    assert len(shots) == 2 and pool.startswith("synthetic") and "--allow-synthetic-shots" in pool


def test_the_pool_is_named(real_questions, tmp_path):
    pool_file = tmp_path / "train.jsonl"
    pool_file.write_text(json.dumps(QUESTION) + "\n" + json.dumps({**QUESTION, "question": "Two?"}) + "\n")
    questions, shots, pool = ev.load_eval_data(real_questions, str(pool_file), None, 2, seed=0)
    assert pool == str(pool_file) and len(questions) == 3 and len(shots) == 2
    assert ev.load_eval_data("synthetic", None, 4, 2, seed=0)[2] == ev.SYNTHETIC_POOL
    (tmp_path / "no-shared").mkdir()
    (tmp_path / "no-shared" / "train.jsonl").write_text(pool_file.read_text())
    assert ev.load_eval_data(real_questions, None, None, 2, seed=0)[2] == str(tmp_path / "no-shared" / "train.jsonl")


def test_python_m_tandem_runs_the_cli():
    out = subprocess.run([sys.executable, "-m", "tandem", "--help"], capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).resolve().parent.parent)
    assert out.returncode == 0 and "serve" in out.stdout and "eval" in out.stdout, out.stderr

"""`tandem eval gsm8k`: answer extraction, scoring, the table layout, and the --url path against a stand-in
OpenAI-compatible server (canned completions, Prometheus counters)."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from tandem.data.gsm8k import Problem, extract_answer, few_shot_prompt, synthetic_split
from tandem.eval import gsm8k as ev


@pytest.mark.parametrize("text,expected", [
    ("She has 3+4 = <<3+4=7>>7 apples.\n#### 7", "7"),
    ("#### 1,234", "1234"),
    ("#### -5", "-5"),
    ("#### 12.50", "12.5"),
    ("so the answer is 18.", "18"),  # no ####: the last number
    ("no digits here", None),
    ("#### 3.0", "3"),
])
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


def test_synthetic_split_is_deterministic_and_well_formed():
    import random

    from tandem.data.gsm8k import arithmetic_drill

    a, b = synthetic_split("test", 50), synthetic_split("test", 50)
    assert a == b and synthetic_split("shots", 50) != a
    rng = random.Random(0)
    for p in a + [arithmetic_drill(rng) for _ in range(50)]:
        assert p.answer.count("####") == 1 and "<<" in p.answer
        # the calculator annotations are right
        for expr in [seg.split(">>")[0] for seg in p.answer.split("<<")[1:]]:
            lhs, rhs = expr.split("=")
            assert eval(lhs) == float(rhs), expr  # noqa: S307 (our own generated arithmetic)


def test_prompt_layout_and_scoring():
    shots = [Problem("1+1?", "1+1 = <<1+1=2>>2\n#### 2")]
    prompt = few_shot_prompt(shots, "2+2?")
    assert prompt == "Question: 1+1?\nAnswer: 1+1 = <<1+1=2>>2\n#### 2\n\nQuestion: 2+2?\nAnswer:"
    qs = [Problem("a", "#### 4"), Problem("b", "#### 5"), Problem("c", "#### 6")]
    r = ev.score(ev.EvalResult("x"), qs, [" 2+2 = 4\n#### 4", " #### 7", " I do not know"])
    assert (r.correct, r.invalid, r.total) == (1, 1, 3) and r.accuracy == pytest.approx(1 / 3)


def test_table_has_the_seed_columns_and_deltas_against_tp():
    rows = [ev.EvalResult("TP2 + greedy fixed K", correct=3, total=4, acceptance_rate=0.5, acceptance_length=2.5),
            ev.EvalResult("PCP2 + greedy fixed K", correct=3, total=4, acceptance_rate=0.5004,
                          acceptance_length=2.501),
            ev.EvalResult("PCP2 + greedy fixed K + PIECEWISE", note="not run: no graphs")]
    table = ev.format_table(rows).splitlines()
    assert table[0].startswith("| Configuration | Correct | Accuracy | Invalid | Acceptance rate | Acceptance length")
    assert "| 3/4 | 75.0000% | 0 | 0.500400 | 2.501000 | 0.000400 | 0.001000 |" in table[3]
    assert "not run: no graphs" in table[4]


class _FakeServer(BaseHTTPRequestHandler):
    drafts = 0

    def do_POST(self):  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        assert body["stop"] == ["\n\n", "Question:"] and body["temperature"] == 0.0
        question = body["prompt"].rsplit("Question: ", 1)[1]
        answer = question.split()[2]  # "<name> has <a> ..." -> echo a number, right only sometimes
        type(self).drafts += 10
        self._send(json.dumps({"choices": [{"text": f" ...\n#### {answer}"}]}), "application/json")

    def do_GET(self):  # noqa: N802
        d = type(self).drafts
        text = (f"# TYPE tandem:spec_decode_num_drafts counter\ntandem:spec_decode_num_drafts_total {d}\n"
                f"tandem:spec_decode_num_draft_tokens_total {3 * d}\n"
                f"tandem:spec_decode_num_accepted_tokens_total {2 * d}\n"
                f'tandem:spec_decode_num_accepted_tokens_per_pos_total{{position="0"}} {d}\n')
        self._send(text, "text/plain")

    def _send(self, text, kind):
        data = text.encode()
        self.send_response(200)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


def test_url_mode_scores_completions_and_reads_acceptance_from_metrics():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _FakeServer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        questions, shots, _ = ev.load_eval_data("synthetic", None, 12, 2, seed=42)
        url = f"http://127.0.0.1:{server.server_address[1]}"
        r = ev.run_against_url("server", url, None, questions, shots, 64, 0.0, 42, concurrency=4)
    finally:
        server.shutdown()
    expected = sum(q.question.split()[2] == q.target for q in questions)
    assert r.total == 12 and r.correct == expected and r.invalid == 0
    assert r.acceptance_rate == pytest.approx(2 / 3) and r.acceptance_length == pytest.approx(3.0)

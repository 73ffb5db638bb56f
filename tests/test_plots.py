"""Benchmark plots: rows grouped into lines, a valid PNG written from synthetic rows, the missing-matplotlib error
(before any load runs), and `tandem bench serve --concurrency 1,2 --plot` end to end on a tiny Llama server."""

from __future__ import annotations

import json
import struct
import sys

import pytest
from server_utils import server_in_thread

from tandem.bench import plot
from tandem.entrypoints import cli
from tandem.entrypoints.engine_args import EngineArgs

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def png_size(path) -> tuple[int, int]:
    """(width, height) from the IHDR chunk, after checking the signature; fails on anything that is not a PNG."""
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE, f"{path} is not a PNG: starts {data[:8]!r}"
    assert data[12:16] == b"IHDR" and data.endswith(b"IEND\xaeB`\x82"), f"{path}: no IHDR/IEND chunk"
    return struct.unpack(">II", data[16:24])


ROWS = [{"pcp_size": p, "prompt_len": n, "wall_s": n / 1000 / p, "speedup": None if p == 1 else 1.9}
        for n in (4096, 1024, 2048) for p in (1, 2)]


def test_lines_by_groups_rows_sorted_by_x_and_skips_missing_y():
    lines = plot.lines_by(ROWS, "prompt_len", "wall_s", lambda r: f"PCP={r['pcp_size']}")
    assert list(lines) == ["PCP=1", "PCP=2"], lines
    assert lines["PCP=1"] == [(1024, 1.024), (2048, 2.048), (4096, 4.096)], lines
    speedup = plot.lines_by(ROWS, "prompt_len", lambda r: r["speedup"], lambda r: f"PCP={r['pcp_size']}")
    assert list(speedup) == ["PCP=2"] and [y for _, y in speedup["PCP=2"]] == [1.9] * 3, speedup


def test_plot_lines_writes_a_png_from_synthetic_rows(tmp_path):
    pytest.importorskip("matplotlib")
    label = lambda r: f"PCP={r['pcp_size']}"  # noqa: E731
    panels = [plot.Panel("TTFT s", plot.lines_by(ROWS, "prompt_len", "wall_s", label)),
              plot.Panel("speedup", plot.lines_by(ROWS, "prompt_len", "speedup", label), references={"ideal": 2.0},
                         y_min=0)]
    info = {"cpu": "Test CPU", "num_cores": 2, "torch": "2.x", "date": "2026-12-01 12:00 UTC"}
    out = plot.plot_lines(tmp_path / "p.png", panels, title="prefill", x_label="prompt tokens",
                          subtitle=plot.machine_caption(info, "tiny"), log2_x=True)
    width, height = png_size(out)
    assert width > height > 100 and out.stat().st_size > 5000, (width, height, out.stat().st_size)


def test_missing_matplotlib_names_the_extra(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` now raises ImportError
    with pytest.raises(plot.PlotUnavailable) as err:
        plot.plot_lines(tmp_path / "p.png", [plot.Panel("y", {"a": [(1, 1)]})], title="t", x_label="x")
    assert str(err.value) == "--plot needs matplotlib: pip install 'tandem[plot]'"
    assert not (tmp_path / "p.png").exists()


def test_bench_serve_plot_without_matplotlib_exits_2_before_any_request(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    # port 9 (discard): nothing listens, so reaching the load would exit 1 naming the URL instead
    assert cli.main(["bench", "serve", "--url", "http://127.0.0.1:9", "--plot", str(tmp_path / "s.png")]) == 2
    err = capsys.readouterr().err
    assert "pip install 'tandem[plot]'" in err and "127.0.0.1:9" not in err, err


@pytest.mark.parametrize("levels", ["0", "1,x", "2,,4", "4,-1"])
def test_bad_concurrency_list_exits_2_naming_it(levels, capsys):
    assert cli.main(["bench", "serve", "--url", "http://127.0.0.1:9", "--concurrency", levels]) == 2
    err = capsys.readouterr().err
    assert "--concurrency" in err and repr(levels) in err, err


def test_bench_serve_sweeps_concurrency_and_plots_it(tiny_checkpoints, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    out, png = tmp_path / "serve.json", tmp_path / "serve.png"
    with server_in_thread(EngineArgs(model=str(tiny_checkpoints("llama")), dtype="float32"), "tiny") as (url, _):
        rc = cli.main(["bench", "serve", "--url", url, "--vs", url, "--label", "a", "--vs-label", "b",
                       "--concurrency", "1,2", "--num-prompts", "2", "--max-tokens", "3",
                       "--output-json", str(out), "--plot", str(png)])
    printed = capsys.readouterr().out
    assert rc == 0, printed
    bench = json.loads(out.read_text())
    runs = [(r["name"], r["concurrency"], r["output_tokens"]) for r in bench["results"]]
    assert runs == [("a", 1, 6), ("a", 2, 6), ("b", 1, 6), ("b", 2, 6)], runs
    assert bench["config"]["concurrency"] == [1, 2] and bench["identical_texts"] == 4, bench["config"]
    assert "concurrency 1:" in printed and "concurrency 2:" in printed and f"plot: {png}" in printed, printed
    assert png_size(png)[0] > 0

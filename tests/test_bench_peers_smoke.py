"""Smoke test of benchmarks/bench_peers.py: one tiny configuration, our library only, in
process (no peers needed). Checks the rows and columns of the table and that our scores
agree with the exact ``torch.func`` reference."""

import json
import sys
from dataclasses import replace
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import bench_peers

METHODS = ("graddot", "kfac")


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[bench_peers.CellResult]:
    out = tmp_path_factory.mktemp("peers")
    settings, _ = bench_peers.parse_args(["--quick", "--out", str(out), "--chart", ""])
    shape = replace(settings.shape, model="gpt2")
    reference = settings.reference_path("gpt2")
    bench_peers.run_reference(shape, reference)
    cells = [bench_peers.Cell("gpt2", "ours", m, 4) for m in METHODS]
    return [bench_peers.run_cell(c, shape, 1, reference) for c in cells]


def test_ours_agrees_with_the_reference(results: list[bench_peers.CellResult]) -> None:
    assert [r.cell.method for r in results] == list(METHODS)
    for r in results:
        assert r.status == "ok", r.reason
        assert r.spearman is not None and r.spearman[1] > 0.999
        assert r.max_rel_err is not None and r.max_rel_err < 1e-4
        for phase in (bench_peers.FLOOR, bench_peers.FORWARD, bench_peers.RUN):
            assert len(r.samples[phase]) == 1
            assert r.peaks[phase] > 0


def test_table_has_a_row_per_cell(results: list[bench_peers.CellResult]) -> None:
    table = bench_peers.results_table(results).splitlines()
    header = [c.strip() for c in table[0].strip("|").split("|")]
    assert header[:4] == ["model", "queries", "method", "library"]
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in table[2:]]
    assert [row[2] for row in rows] == list(METHODS)
    assert all(len(row) == len(header) for row in rows)


def test_unsupported_configuration_is_recorded(tmp_path: Path) -> None:
    settings, _ = bench_peers.parse_args(["--quick", "--out", str(tmp_path)])
    shape = replace(settings.shape, model="gpt2")
    cell = bench_peers.Cell("gpt2", "kronfluence", "graddot_proj", 4)
    found = bench_peers.run_cell(cell, shape, 1, settings.reference_path("gpt2"))
    assert found.status in ("unsupported", "error") and found.reason


def test_report_renders_merged_runs(results: list[bench_peers.CellResult], tmp_path: Path) -> None:
    settings, _ = bench_peers.parse_args(["--quick", "--out", str(tmp_path), "--chart", ""])
    shape = replace(settings.shape, model="gpt2")
    first = bench_peers.Run([["--quick"]], ["then"], shape, (4,), 1, {"gpt2": 1}, [], results)
    again = bench_peers.Run.from_json(json.loads(json.dumps(first.to_json())))
    runs = bench_peers.merged([first, replace(again, commands=[["--again"]], dates=["now"])])
    assert len(runs) == 1 and len(runs[0].results) == len(METHODS)
    assert runs[0].commands == [["--quick"], ["--again"]]
    text = bench_peers.report(runs, settings, "a note")
    assert text.startswith(bench_peers.SECTION) and "a note" in text
    targets = [line for line in text.splitlines() if line.startswith("| gpt2 | 4 |")]
    assert len(targets) == 2 * len(METHODS)  # a targets row and a results row per cell


def test_an_empty_chart_path_means_no_chart(tmp_path: Path) -> None:
    """``--chart ''`` turns the chart off (``Path('')`` would be ``.``, a file ``.png``)."""
    off, _ = bench_peers.parse_args(["--quick", "--out", str(tmp_path), "--chart", ""])
    named, _ = bench_peers.parse_args(["--quick", "--out", str(tmp_path), "--chart", "r.png"])
    assert off.chart is None and named.chart == Path("r.png")


def test_runs_ending_in_the_same_minute_keep_both_dumps(tmp_path: Path) -> None:
    """Two runs that end in the same minute write two JSON files, not one over the other."""
    date = "2026-12-01 17:52 UTC"
    first = bench_peers.fresh_dump_path(tmp_path, date)
    first.write_text("{}")
    second = bench_peers.fresh_dump_path(tmp_path, date)
    assert first.name == "peers-2026-12-01_1752_UTC.json"
    assert second.name == "peers-2026-12-01_1752_UTC-2.json"

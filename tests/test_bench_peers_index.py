"""The peer comparison's cell index (``bench_peers.py --index``): every workload x
library cell shows its latest figure or the reason it is missing."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import bench_peers
from peers.coverage import UNEXPLAINED, Gap, load_gaps
from peers.workload import Shape


def measured(cell: bench_peers.Cell, run_s: float, floor_s: float) -> bench_peers.CellResult:
    """An ``ok`` result of one round: the call took ``run_s``, the floor ``floor_s``."""
    samples = {
        bench_peers.FLOOR: [{"wall": floor_s}],
        bench_peers.FORWARD: [{"wall": floor_s / 3}],
        bench_peers.RUN: [{"wall": run_s}],
    }
    return bench_peers.CellResult(cell, "ok", samples=samples)


def run_of(train: int, *results: bench_peers.CellResult) -> bench_peers.Run:
    shape = Shape(model="gpt2", train=train)
    return bench_peers.Run([[]], ["now"], shape, (8,), 1, {"gpt2": 1}, [], list(results))


def rows(text: str) -> dict[tuple[str, str], list[str]]:
    """The index tables' rows, by (training-rows heading, method), cells stripped."""
    found, heading = {}, ""
    for line in text.splitlines():
        if line.startswith("### "):
            heading = line
        elif line.startswith("| gpt2 |"):
            cells = [c.strip() for c in line.strip("|").split("|")]
            found[(heading, cells[2])] = cells[3:]
    return found


@pytest.fixture
def settings(tmp_path: Path) -> bench_peers.Settings:
    argv = ["--models", "gpt2", "--queries", "8", "--out", str(tmp_path), "--chart", ""]
    argv += ["--libraries", "ours", "kronfluence", "--methods", "graddot", "kfac"]
    return bench_peers.parse_args(argv)[0]


def test_each_cell_has_its_figure_or_its_reason(settings: bench_peers.Settings) -> None:
    Cell = bench_peers.Cell
    early = run_of(
        256,
        measured(Cell("gpt2", "ours", "graddot", 8), 30.0, 20.0),
        measured(Cell("gpt2", "kronfluence", "graddot", 8), 99.0, 1.0),
    )
    late = run_of(
        256,
        measured(Cell("gpt2", "kronfluence", "graddot", 8), 26.0, 20.0),
        bench_peers.CellResult(Cell("gpt2", "ours", "kfac", 8), "error", reason="it broke"),
    )
    small = run_of(
        64,
        bench_peers.CellResult(
            Cell("gpt2", "kronfluence", "kfac", 8), "unsupported", reason="no such method"
        ),
    )
    gaps = [Gap("kronfluence", "too slow here", train=64), Gap("kronfluence", "never")]
    dumps = [("a.json", early), ("b.json", late), ("c.json", small)]
    text = bench_peers.index_text(dumps, settings, gaps)
    table = rows(text)
    big, little = "### 256 training rows of 128 tokens", "### 64 training rows of 128 tokens"
    # the later dump replaces the earlier figure; ratios are run over the cell's own floor
    assert table[(big, "graddot")] == ["1.50x", "1.30x"]
    # a run's own failure, and "unsupported" from another size, keep their reasons
    assert table[(big, "kfac")] == ["error [1]", "unsupported [2]"]
    assert "1. it broke" in text and "2. no such method" in text
    # cells no run reached: the first matching gap, or said to be unexplained
    assert table[(little, "graddot")] == ["not measured [1]", "not measured [2]"]
    assert table[(little, "kfac")] == ["not measured [1]", "unsupported [3]"]
    assert f"1. {UNEXPLAINED}" in text and "2. too slow here" in text
    assert "Figures from: `a.json`, `b.json`." in text
    # the chart shows the same latest figures, one panel per size, model and query count
    assert bench_peers.index_panels(dumps) == {
        "gpt2, 256 train x 8 queries": {
            ("graddot", "ours"): pytest.approx(1.5),
            ("graddot", "kronfluence"): pytest.approx(1.3),
        }
    }


def test_a_gpu_run_gets_its_own_table_with_its_models(settings: bench_peers.Settings) -> None:
    """A bf16 run on a GPU is a size of its own, headed by where it ran, and its model
    (qwen2, not among the asked ones) gets rows; the CPU size keeps the asked models."""
    Cell = bench_peers.Cell
    cpu = run_of(256, measured(Cell("gpt2", "ours", "graddot", 8), 30.0, 20.0))
    gpu_shape = Shape(model="qwen2", train=256, seq=512, device="cuda", dtype="bf16")
    gpu = bench_peers.Run(
        [[]],
        ["now"],
        gpu_shape,
        (8,),
        1,
        {"qwen2": 1},
        [],
        [measured(Cell("qwen2", "ours", "graddot", 8), 12.0, 10.0)],
    )
    text = bench_peers.index_text([("a.json", cpu), ("b.json", gpu)], settings, [])
    headings = [line for line in text.splitlines() if line.startswith("### ")]
    assert headings == [
        "### 256 training rows of 128 tokens",
        "### 256 training rows of 512 tokens on cuda, bf16",
    ]
    cpu_part, gpu_part = text.split(headings[1])
    assert "| qwen2 | 8 | graddot | 1.20x |" in gpu_part and "| gpt2 |" in gpu_part
    assert "qwen2" not in cpu_part


def test_index_writes_its_section_and_the_chart_of_its_figures(tmp_path: Path) -> None:
    Cell = bench_peers.Cell
    run = run_of(256, measured(Cell("gpt2", "ours", "graddot", 8), 30.0, 20.0))
    dump, gaps = tmp_path / "peers-a.json", tmp_path / "gaps.json"
    dump.write_text(json.dumps(run.to_json()))
    gaps.write_text("[]")
    results, chart = tmp_path / "RESULTS.md", tmp_path / "chart.png"
    argv = ["--report", str(dump), "--index", str(gaps), "--results", str(results)]
    bench_peers.main([*argv, "--chart", str(chart), "--write", "--models", "gpt2"])
    assert "![time / floor: each cell's latest figure](chart.png)" in results.read_text()
    assert chart.read_bytes().startswith(b"\x89PNG")


def test_gaps_file_lists_libraries_and_refuses_unknown_fields(tmp_path: Path) -> None:
    path = tmp_path / "gaps.json"
    path.write_text(json.dumps([{"library": "logix", "reason": "slow", "model": "gpt2"}]))
    assert load_gaps(path) == [Gap("logix", "slow", model="gpt2")]
    path.write_text(json.dumps([{"library": ["logix", "traker"], "reason": "slow"}]))
    assert load_gaps(path) == [Gap("logix", "slow"), Gap("traker", "slow")]
    path.write_text(json.dumps([{"library": "logix", "reason": "slow", "modle": "gpt2"}]))
    with pytest.raises(ValueError, match="modle"):
        load_gaps(path)


def test_index_needs_the_dumps(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="--report"):
        bench_peers.main(["--index", str(tmp_path / "gaps.json"), "--out", str(tmp_path)])

"""Smoke test of benchmarks/bench_peers.py: one tiny configuration, our library only, in
process (no peers needed). Checks the rows and columns of the table and that our scores
agree with the exact ``torch.func`` reference."""

import json
import sys
from dataclasses import replace
from pathlib import Path
from unittest import mock

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import bench_peers
from peers.workload import Shape

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


def test_bf16_cells_agree_with_the_fp64_reference_of_their_own_weights(tmp_path: Path) -> None:
    """``--dtype bf16`` builds the models in bf16 (here the tiny Qwen2 of the GPU table):
    our cells run, agree with the fp64 reference of the bf16 weights to bf16's precision,
    and that precision shows that the model did run in bf16 (fp32 agrees to < 1e-4)."""
    argv = ["--quick", "--out", str(tmp_path), "--chart", "", "--dtype", "bf16"]
    settings, _ = bench_peers.parse_args([*argv, "--models", "qwen2"])
    shape = replace(settings.shape, model="qwen2")
    reference = settings.reference_path("qwen2")
    assert reference.name.endswith("-bf16.safetensors")  # not the fp32 model's reference
    bench_peers.run_reference(shape, reference)
    for method in METHODS:
        found = bench_peers.run_cell(
            bench_peers.Cell("qwen2", "ours", method, 4), shape, 1, reference
        )
        assert found.status == "ok", found.reason
        assert found.spearman is not None and found.spearman[1] > 0.95
        assert found.max_rel_err is not None and 1e-4 < found.max_rel_err < 0.05


def test_a_child_gets_the_parents_device_and_dtype(tmp_path: Path) -> None:
    """Each cell runs in a child process from :meth:`Settings.shape_flags`: parsed again,
    they give the parent's workload, device and dtype included."""
    settings, _ = bench_peers.parse_args(["--quick", "--out", str(tmp_path), "--dtype", "bf16"])
    child, _ = bench_peers.parse_args(["--out", str(tmp_path), *settings.shape_flags()])
    assert child.shape == settings.shape and child.shape.dtype == "bf16"


def test_cuda_is_refused_where_torch_sees_no_gpu(tmp_path: Path) -> None:
    with (
        mock.patch("torch.cuda.is_available", return_value=False),
        pytest.raises(SystemExit, match="no CUDA device"),
    ):
        bench_peers.parse_args(["--quick", "--out", str(tmp_path), "--device", "cuda"])


def test_a_gpu_run_says_where_it_ran_and_that_its_peaks_are_gpu_memory(
    results: list[bench_peers.CellResult],
) -> None:
    shape = Shape(model="gpt2", tiny=True, device="cuda", dtype="bf16")
    run = bench_peers.Run([["--quick"]], ["now"], shape, (4,), 1, {"gpt2": 1}, [], results)
    text = bench_peers.run_text(run)
    assert text.splitlines()[0].endswith("queries on cuda, bf16")
    assert "peak GPU memory MB" in text and "RSS" not in text


def test_on_a_gpu_a_phase_peak_is_torchs_allocated_memory_after_a_synchronize() -> None:
    """The CUDA branch of the timing (no GPU here: torch.cuda's calls are mocked): the
    peak is reset before the phase and read after it, in MB, and the timer's synchronize
    waits for the device; on the CPU neither touches torch.cuda."""
    gpu, cpu = torch.device("cuda"), torch.device("cpu")
    peaks: dict[str, float] = {"run": 1.0}
    with (
        mock.patch("torch.cuda.reset_peak_memory_stats") as reset,
        mock.patch("torch.cuda.max_memory_allocated", return_value=3 * 2**20) as allocated,
        mock.patch("torch.cuda.synchronize") as synchronize,
    ):
        with bench_peers.device_peak(peaks, "run", gpu):
            reset.assert_called_once_with(gpu)
            allocated.assert_not_called()
        bench_peers.synchronize(gpu)
        synchronize.assert_called_once_with(gpu)
        assert peaks["run"] == 3.0
        with bench_peers.device_peak(peaks, "floor", cpu):
            bench_peers.synchronize(cpu)
        assert reset.call_count == 1 and synchronize.call_count == 1
        assert peaks["floor"] > 0  # the process's RSS

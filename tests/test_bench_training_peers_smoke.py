"""Smoke tests of the in-training peer workloads (benchmarks/peer_capture.py: (4) capture
overhead, benchmarks/peer_selection.py: (5) selection): one tiny configuration in process,
our library and whichever peers are installed (none in CI: their rows say why). The
ratio table's verdicts are checked on made-up step times."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import peer_capture
import peer_selection
from common import Sample
from peers.training import ModeResult, ratio_table


def _rows(table: str) -> list[list[str]]:
    return [[c.strip() for c in line.strip("|").split("|")] for line in table.splitlines()[2:]]


@pytest.mark.slow
def test_capture_workload_times_every_way_or_says_why(tmp_path: Path) -> None:
    result = peer_capture.main(["--quick", "--no-write", "--results", str(tmp_path / "r.md")])
    names = [way.name for way in peer_capture.WAYS]
    assert result.ways == names
    assert {"plain", "ours", "ours + K-FAC"} <= set(result.samples)
    assert set(result.samples) | set(result.reasons) == set(names)
    assert "logix" in result.reasons and result.peers == ["bergson", "dattri-llm", "logix"]
    assert all(len(s) >= 2 for s in result.samples.values())  # two runs, warm-up dropped


@pytest.mark.slow
def test_selection_workload_times_every_way_or_says_why(tmp_path: Path) -> None:
    args = ["--quick", "--mode", "full", "--no-write", "--results", str(tmp_path / "r.md")]
    (result,) = peer_selection.main(args)
    assert {"plain", "ours"} <= set(result.samples)
    assert set(result.samples) | set(result.reasons) == {"plain", "ours", "dattri-llm"}
    assert result.peers == ["dattri-llm"]


def test_ratio_table_holds_each_peer_against_ours() -> None:
    def steps(cpu: float) -> list[Sample]:
        return [Sample(cpu, cpu)] * 3

    result = ModeResult(
        "m",
        ["plain", "ours", "slow", "fast", "absent"],
        {"plain": steps(1.0), "ours": steps(1.2), "slow": steps(1.5), "fast": steps(1.1)},
        {"absent": "not installed"},
        ["slow", "fast", "absent"],
    )
    rows = {row[1]: row for row in _rows(ratio_table([result], "ours below"))}
    assert rows["ours"][3] == "**1.20x**" and rows["ours"][-1] == ""
    assert rows["slow"][-2:] == ["2.50x", "yes"]  # (1.5 - 1) / (1.2 - 1)
    assert rows["fast"][-2:] == ["0.50x", "**no**"]
    assert rows["absent"][2] == "not installed"

"""HF Trainer under ``torchrun --nproc-per-node=2`` (DDP, gloo): one store directory per
rank, and the merged view equals the single-process store on the same data; the influence
logged on each rank equals the single-process run's, and one report covers every example."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tda_plugins.store import StoreReader

ROOT = Path(__file__).resolve().parent.parent


def _run(args: list[str], tmp: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    result = subprocess.run(
        [sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]


def _by_id(store: StoreReader) -> dict[int, dict[str, torch.Tensor]]:
    chunk = store.load_all()
    return {
        example: {name: grads.materialize()[row] for name, grads in chunk.layers.items()}
        for row, example in enumerate(chunk.example_ids.tolist())
    }


@pytest.mark.slow
@pytest.mark.multiprocess
def test_ddp_ranks_write_shards_whose_merge_equals_one_process(tmp_path: Path) -> None:
    worker = "tests/hf_ddp_worker.py"
    _run(
        [
            "-m",
            "torch.distributed.run",
            "--nproc-per-node=2",
            "--master-port=29533",
            worker,
            str(tmp_path / "ddp"),
            str(tmp_path / "ddp-out"),
        ],
        tmp_path,
    )
    _run([worker, str(tmp_path / "single"), str(tmp_path / "single-out")], tmp_path)

    assert sorted(p.name for p in (tmp_path / "ddp").glob("rank-*")) == ["rank-0", "rank-1"]
    merged, single = _by_id(StoreReader(tmp_path / "ddp")), _by_id(StoreReader(tmp_path / "single"))
    assert len(single) == 16 and merged.keys() == single.keys()
    worst = max(
        ((merged[i][n] - single[i][n]).norm() / single[i][n].norm()).item()
        for i in single
        for n in single[i]
    )
    assert worst <= 1e-4

    # Influence: every rank logs the whole global step (equal to one process), and the one
    # report (rank 0's) covers all 16 examples.
    one = json.loads((tmp_path / "single-out" / "influence-rank0.json").read_text())
    for rank in range(2):
        logged = json.loads((tmp_path / "ddp-out" / f"influence-rank{rank}.json").read_text())
        assert [h["step"] for h in logged] == [h["step"] for h in one] == [0, 1, 2, 3]
        for got, want in zip(logged, one, strict=True):
            assert sorted(got["ids"]) == sorted(want["ids"]) and len(got["ids"]) == 4
            # fp32 sums in another order: within 1e-4 of the step's largest score
            scale = 1e-4 * max(abs(v) for v in want["max"] + want["mean"])
            for key in ("mean", "max"):
                diff = (torch.tensor(got[key]) - torch.tensor(want[key])).abs().max()
                assert diff <= scale, (key, got[key], want[key])
    report = json.loads((tmp_path / "ddp-out" / "influence" / "influence.json").read_text())
    assert sorted(e["id"] for e in report["cumulative"]) == sorted(single)  # every rank's
    assert len(report["top_k"]) == 2 and len(report["history"]) == 4

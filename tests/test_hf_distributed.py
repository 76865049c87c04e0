"""The transformers callbacks under ``torchrun --nproc-per-node=2`` (gloo, CPU) against the
same script's one-process run on the same global batches (``tests/hf_ddp_worker.py``).

One launch covers two runs: the HF ``Trainer`` with DDP (through accelerate), and a
``fully_shard``-ed model (FSDP2, DTensor parameters) whose callbacks' trainer events are
driven by hand around a hand-written step (the ``Trainer`` on CPU turns an FSDP2 config
into DDP). Each with ``GradientCaptureCallback`` (every layer: linear, embedding, norm
scales) and ``InfluenceLoggingCallback`` (GradDot), AdamW at a non-zero learning rate.

Checked for both runs:

* the merged store (``StoreReader`` on the root, one ``rank-<r>`` per process) equals the
  one-process store: the same example ids, each at the same step with the same gradient
  in every layer (relative error <= 1e-4); the K-FAC statistics summed over the ranks
  equal the one-process statistics; the Adam moments (under FSDP2 gathered from the
  shards by every rank, written by rank 0) equal the one-process moments;
* the influence metrics logged at each step are identical on every rank and equal the
  one-process run's (relative 1e-4);
* one report, written by rank 0 alone, ranks every example of every rank with the
  one-process run's cumulative scores, and its HTML shows every example's tokens;
* (FSDP2) the K-FAC statistics kept at ``on_save`` for a resume, summed over the ranks,
  equal the one-process run's at the same step;
* the rank exchange behind the influence gathering: rows of unequal counts (none on one
  rank) and one object per rank arrive on every rank, whole and in rank order.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from tda_plugins.precondition import load_curvature
from tda_plugins.precondition.adam import OPTIMIZER_FILE
from tda_plugins.store import StoreReader
from tests.hf_ddp_worker import EXAMPLES, SAVE_AT, STEPS, rows
from tests.launch import torchrun
from tests.stores import rel_error

ROOT = Path(__file__).resolve().parent.parent
WORLD = 2
TOL = 1e-4
RUNS = ("trainer", "sharded")

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]


def _run(args: list[str]) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    result = subprocess.run(
        [sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-6000:]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``<root>/2/<run>``: the two-rank runs; ``<root>/1/<run>``: the one-process runs."""
    root = tmp_path_factory.mktemp("hf-distributed")
    torchrun("hf_ddp_worker.py", root, ranks=WORLD)
    _run(["tests/hf_ddp_worker.py", str(root)])
    return root


def _by_id(store: StoreReader) -> dict[int, tuple[int, dict[str, torch.Tensor]]]:
    chunk = store.load_all()
    return {
        example: (
            int(chunk.steps[row]),
            {name: grads.materialize()[row] for name, grads in chunk.layers.items()},
        )
        for row, example in enumerate(chunk.example_ids.tolist())
    }


def _logs(folder: Path, rank: int) -> list[dict[str, Any]]:
    return json.loads((folder / f"logs-{rank}.json").read_text())


@pytest.mark.parametrize("run", RUNS)
def test_merged_store_equals_the_one_process_store(runs: Path, run: str) -> None:
    multi, single = runs / str(WORLD) / run / "store", runs / "1" / run / "store"
    assert sorted(p.name for p in multi.glob("rank-*")) == ["rank-0", "rank-1"]
    merged, expected = _by_id(StoreReader(multi)), _by_id(StoreReader(single))
    assert len(expected) == EXAMPLES and merged.keys() == expected.keys()
    assert {"model.embed_tokens", "model.norm", "lm_head"} <= set(expected[next(iter(expected))][1])
    for example, (step, grads) in expected.items():
        assert merged[example][0] == step, f"example {example}: another step"
        for layer, grad in grads.items():
            err = rel_error(merged[example][1][layer], grad)
            assert err <= TOL, f"example {example} layer {layer}: {err:.2e}"

    curvature, reference = load_curvature(multi), load_curvature(single)
    assert curvature.keys() == reference.keys()
    for layer, factors in reference.items():
        assert torch.equal(curvature[layer].tokens, factors.tokens)
        assert rel_error(curvature[layer].a_sum, factors.a_sum) <= TOL
        assert rel_error(curvature[layer].g_sum, factors.g_sum) <= TOL

    moments, reference_moments = (
        load_file(multi / OPTIMIZER_FILE),
        load_file(single / OPTIMIZER_FILE),
    )
    assert moments.keys() == reference_moments.keys()
    for key, value in reference_moments.items():
        assert moments[key].shape == value.shape, key
        assert rel_error(moments[key], value) <= TOL, key


@pytest.mark.parametrize("run", RUNS)
def test_logged_influence_is_the_global_batchs_on_every_rank(runs: Path, run: str) -> None:
    reference = _logs(runs / "1" / run, 0)
    assert [entry["step"] for entry in reference] == list(range(1, STEPS + 1))
    ranks = [_logs(runs / str(WORLD) / run, rank) for rank in range(WORLD)]
    assert ranks[1] == ranks[0]  # bit for bit: the same gathered scores on every rank
    for got, want in zip(ranks[0], reference, strict=True):
        assert got.keys() == want.keys() and got["step"] == want["step"]
        for key in want.keys() - {"step"}:
            assert got[key] == pytest.approx(want[key], rel=TOL, abs=1e-6), (got["step"], key)


@pytest.mark.parametrize("run", RUNS)
def test_one_report_by_rank_0_covers_every_example(runs: Path, run: str) -> None:
    folder, single = runs / str(WORLD) / run, runs / "1" / run
    written = [json.loads((folder / f"report-{rank}.json").read_text()) for rank in range(WORLD)]
    assert written == [["html", "json", "png"], []]  # rank 0 wrote it, rank 1 nothing
    report = json.loads((folder / "report" / "influence.json").read_text())
    expected = json.loads((single / "report" / "influence.json").read_text())
    assert len(report["history"]) == STEPS
    ours = {e["id"]: e["scores"] for e in report["cumulative"]}
    theirs = {e["id"]: e["scores"] for e in expected["cumulative"]}
    assert len(theirs) == EXAMPLES and ours.keys() == theirs.keys()
    for example, scores in theirs.items():
        assert ours[example] == pytest.approx(scores, rel=TOL, abs=1e-6)
    assert [q["query_id"] for q in report["top_k"]] == [q["query_id"] for q in expected["top_k"]]
    html = (folder / "report" / "influence.html").read_text()
    for row in rows():
        assert " ".join(map(str, row["input_ids"])) in html


def test_fsdp2_checkpoint_statistics_equal_the_one_process_runs(runs: Path) -> None:
    name = f"curvature-before-step{SAVE_AT}.safetensors"
    store = runs / str(WORLD) / "sharded" / "store"
    parts = [load_file(store / f"rank-{rank}" / name) for rank in range(WORLD)]
    expected = load_file(runs / "1" / "sharded" / "store" / "rank-0" / name)
    # each layer's statistics are owned by one rank: the two files split the layers
    assert not parts[0].keys() & parts[1].keys()
    assert parts[0].keys() | parts[1].keys() == expected.keys()
    merged = {**parts[0], **parts[1]}
    for key, value in expected.items():
        assert rel_error(merged[key], value) <= TOL, key


def test_ranks_exchange_unequal_rows_and_objects_in_rank_order(runs: Path) -> None:
    expected = {
        "rows": [[1.0, 0.0], [1.0, 1.0], [1.0, 2.0]],  # rank 0 had none, rank 1 three
        "objects": [{"0": [0]}, {"10": [1], "11": [1, 1]}],
    }
    for rank in range(WORLD):
        got = json.loads((runs / str(WORLD) / f"gathered-{rank}.json").read_text())
        assert got == expected

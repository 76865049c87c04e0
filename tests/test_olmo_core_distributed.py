"""``GradientCaptureCallback`` under torchrun: DDP, FSDP and HSDP store what one process stores.

Two gloo ranks (``tests/olmo_core_dist_worker.py``, one launch for the three modes) train the
tiny OLMo-2 transformer with
OLMo-core's data parallelism (``dp_config`` DDP; FSDP with its default ``full`` wrapping:
sharded DTensor parameters and optimizer state; HSDP as two replicas, whose parameters
and moments are DTensors on a 2-D replicate x shard mesh), and the same script's
one-process run on the same data and global batch size is the reference. OLMo-core gives
rank ``r`` every second instance of the same global batch (``[r::2]``), so each step
covers the same instances in both runs; with the per-rank loss divisor averaged across
ranks, the parameters stay equal at every step (up to fp32 rounding), so per-example
gradients are compared at matching steps with a non-zero learning rate.

Checked: one ``rank-<r>`` directory per process holding that rank's instances, and the
merged store (``StoreReader`` on the root) equal to the one-process store: the same
instance indices, each at the same step with the same gradient in every layer (linear,
embedding, norm scales; relative error <= 1e-4), the same summed K-FAC statistics and the
same Adam moments (gathered from the DTensors under FSDP and HSDP).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tda_plugins.precondition import load_curvature
from tda_plugins.precondition.adam import OPTIMIZER_FILE
from tda_plugins.store import StoreReader
from tda_plugins.store.io import read_json
from tda_plugins.store.layout import INDEX_FILE
from tests.launch import torchrun
from tests.olmo_core_dist_worker import (
    GLOBAL_BATCH,
    STEPS,
    WORLD,
    StepLog,
    train,
    write_tokens,
)
from tests.stores import rel_error

FP32_TOL = 1e-4
#: The DTensor placements of the parameters in each mode (DDP: plain tensors).
PLACEMENTS = {
    "ddp": set(),
    "fsdp": {"(Shard(dim=0),)"},
    "hsdp": {"(Replicate(), Shard(dim=0))"},
}


def rank_step_ids(store: Path, rank: int) -> dict[int, list[int]]:
    """Step -> the example ids that rank ``rank`` stored there, in order."""
    out: dict[int, list[int]] = {}
    for shard in read_json(store / f"rank-{rank}" / INDEX_FILE)["shards"]:
        out.setdefault(int(shard["step"]), []).extend(shard["example_ids"])
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, StepLog]:
    """One launch trains every mode in turn (one process start for the three); then the
    one-process reference. Returns the folder and the reference's log."""
    folder = tmp_path_factory.mktemp("olmo_core_dp")
    write_tokens(folder)
    torchrun("olmo_core_dist_worker.py", folder, *PLACEMENTS)
    return folder, train(folder, "single")


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("mode", list(PLACEMENTS))
def test_two_ranks_store_what_one_process_stores(runs: tuple[Path, StepLog], mode: str) -> None:
    folder, reference = runs
    single, multi = folder / "single" / "grads", folder / mode / "grads"
    logs = [torch.load(folder / mode / f"rank{r}.pt") for r in range(WORLD)]
    assert sorted(p.name for p in multi.glob("rank-*")) == ["rank-0", "rank-1"]
    assert logs[0]["placements"] == PLACEMENTS[mode]  # the parameters' layout is the mode's

    # Data order: each step, rank r trains on (and stores) the instances [r::2] of the
    # one-process run's global batch, and the runs' parameters agree.
    for step in range(STEPS):
        batch = reference.indices[step].tolist()
        for rank, log in enumerate(logs):
            assert log["indices"][step].tolist() == batch[rank::WORLD]
            assert rank_step_ids(multi, rank)[step] == batch[rank::WORLD]
        ours, theirs = logs[0]["params"][step], reference.params[step]
        assert ours.keys() == theirs.keys()
        for name in theirs:
            err = rel_error(ours[name], theirs[name])
            assert err <= FP32_TOL, f"step {step}: {name} differs by {err:.2e}"

    # The merged store: same ids, each at the same step with the same gradients.
    expected, merged = StoreReader(single), StoreReader(multi)
    assert merged.layer_names == expected.layer_names
    assert {"embeddings", "lm_head.norm", "blocks.0.attention.q_norm"} <= set(merged.layer_names)
    assert merged.steps == expected.steps == list(range(STEPS))
    want, got = expected.load_all(), merged.load_all()
    assert sorted(got.example_ids.tolist()) == sorted(want.example_ids.tolist())
    assert len(set(want.example_ids.tolist())) == STEPS * GLOBAL_BATCH
    row = {int(i): r for r, i in enumerate(got.example_ids.tolist())}
    for i, example in enumerate(want.example_ids.tolist()):
        j = row[example]
        assert got.steps[j] == want.steps[i], f"instance {example}: another step"
        for layer in expected.layer_names:
            err = rel_error(got.layers[layer].materialize()[j], want.layers[layer].materialize()[i])
            assert err <= FP32_TOL, f"instance {example} layer {layer}: {err:.2e}"

    # K-FAC statistics summed over the ranks, and the Adam moments saved by rank 0.
    curvature, reference_curvature = load_curvature(multi), load_curvature(single)
    assert curvature.keys() == reference_curvature.keys()
    for layer, factors in reference_curvature.items():
        assert torch.equal(curvature[layer].tokens, factors.tokens)
        assert rel_error(curvature[layer].a_sum, factors.a_sum) <= FP32_TOL
        assert rel_error(curvature[layer].g_sum, factors.g_sum) <= FP32_TOL
    moments, reference_moments = (
        load_file(multi / OPTIMIZER_FILE),
        load_file(single / OPTIMIZER_FILE),
    )
    assert moments.keys() == reference_moments.keys()
    for key, value in reference_moments.items():
        assert rel_error(moments[key], value) <= FP32_TOL, key

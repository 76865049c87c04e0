"""The OLMo-core callbacks on two ranks: DDP, FSDP and HSDP do what one process does.

One launch of two gloo ranks (``tests/ranks_worker.py``, forked with torchrun's
environment by ``tests.launch.forked_ranks``) runs three workers in turn, each
against its one-process run in this process: ``tests/olmo_core_dist_worker.py``
(``GradientCaptureCallback``, below), ``tests/olmo_core_influence_worker.py``
(``InfluenceLoggingCallback``) and ``tests/olmo_core_selection_worker.py``
(``DataSelectionCallback``); each test names its claims.

In ``tests/olmo_core_dist_worker.py`` (the three modes one after the other), two ranks
train the tiny OLMo-2 transformer with
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

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from olmo_core.nn.transformer import Transformer
from safetensors.torch import load_file

from tda_plugins.precondition import load_curvature
from tda_plugins.precondition.adam import OPTIMIZER_FILE
from tda_plugins.store import StoreReader
from tda_plugins.store.io import read_json
from tda_plugins.store.layout import INDEX_FILE
from tests import olmo_core_influence_worker as influence
from tests import olmo_core_selection_worker as selection
from tests.launch import forked_ranks
from tests.olmo_core_dist_worker import (
    GLOBAL_BATCH,
    MODEL,
    STEPS,
    WORLD,
    StepLog,
    train,
    write_label_mask,
    write_tokens,
)
from tests.oracle import max_rel_error
from tests.stores import rel_error
from tests.zygote import Zygote

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


#: The workers of the launch, each with its arguments.
JOBS = {
    "olmo_core_dist_worker": ",".join(PLACEMENTS),
    "olmo_core_influence_worker": "",
    "olmo_core_selection_worker": "",
}


@pytest.fixture(scope="module")
def launched(tmp_path_factory: pytest.TempPathFactory, zygote: Zygote) -> Path:
    """``<root>/<worker>``: each worker's token file and output, from one two-rank launch
    (one process start for the three)."""
    root = tmp_path_factory.mktemp("olmo_core_ranks")
    for worker in JOBS:
        (root / worker).mkdir()
        write_tokens(root / worker)
    masked = root / "olmo_core_selection_worker" / selection.MASKED
    masked.mkdir()
    write_tokens(masked)
    write_label_mask(masked)
    jobs = [f"{worker}:{args}" for worker, args in JOBS.items()]
    forked_ranks(zygote, root, *jobs, timeout=600)
    return root


@pytest.fixture(scope="module")
def runs(launched: Path) -> tuple[Path, StepLog]:
    """The capture worker's folder and the log of its one-process reference."""
    folder = launched / "olmo_core_dist_worker"
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


# -- InfluenceLoggingCallback --------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.multiprocess
def test_two_ranks_record_what_one_process_records(launched: Path) -> None:
    """DDP and FSDP over 2 gloo ranks: every rank records, at every step, the influence
    metrics of the whole global batch (those of the one-process run on the same global
    batches, whose weights stay equal up to fp32 rounding), and rank 0 alone writes a
    report covering both ranks' instances."""
    folder = launched / "olmo_core_influence_worker"
    single = influence.train(folder, "single")
    assert sorted(single["metrics"]) == list(range(1, STEPS + 1))
    single_report = json.loads(Path(single["report"]["json"]).read_text())
    for mode in influence.MODES:
        ranks = [torch.load(folder / mode / f"rank{r}.pt") for r in range(WORLD)]
        for rank, saved in enumerate(ranks):
            assert sorted(saved["metrics"]) == sorted(single["metrics"]), (mode, rank)
            for step, expected in single["metrics"].items():
                got = saved["metrics"][step]
                assert got.keys() == expected.keys() and len(got) == 2 * len(influence.QUERIES)
                for name, value in expected.items():
                    assert got[name] == pytest.approx(value, rel=FP32_TOL, abs=1e-6), (
                        mode,
                        rank,
                        step,
                        name,
                    )
        assert ranks[1]["report"] == {}
        summary = json.loads(Path(ranks[0]["report"]["json"]).read_text())
        both = {int(i) for saved in ranks for idx in saved["indices"] for i in idx}
        assert {e["id"] for e in summary["cumulative"]} == both
        assert both == {e["id"] for e in single_report["cumulative"]}
        assert len(both) == STEPS * GLOBAL_BATCH


# -- DataSelectionCallback ---------------------------------------------------------------


def twin(params: dict[str, torch.Tensor]) -> Transformer:
    model = MODEL.build(init_device="cpu").double()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(params[name])
    return model


def fresh_kept(model: Transformer, input_ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """Gradient of ``sum_{kept} L_i / N_kept`` over the kept instances ``input_ids``."""
    logits = model(input_ids)[:, :-1]
    loss = F.cross_entropy(logits.transpose(1, 2), input_ids[:, 1:], reduction="sum")
    names = [n for n, _ in model.named_parameters()]
    grads = torch.autograd.grad(loss / input_ids[:, 1:].numel(), list(model.parameters()))
    return dict(zip(names, grads, strict=True))


@pytest.mark.slow
@pytest.mark.multiprocess
def test_olmo_core_ddp_fsdp_hsdp_select_what_one_process_selects(launched: Path) -> None:
    """OLMo-core under ``dp_config`` DDP, FSDP and HSDP: every rank logs the global
    outcome, which drops exactly the instances the one-process run drops at each step,
    and every parameter's ``.grad`` after selection (shards gathered) is the fresh
    backward over the kept instances of the whole global batch."""
    folder = launched / "olmo_core_selection_worker"
    single = selection.train(folder, "single")
    assert not single["sharded"]
    for mode in selection.MODES:
        ranks = [torch.load(folder / mode / f"rank{r}.pt") for r in range(WORLD)]
        assert ranks[0]["history"] == ranks[1]["history"]
        assert ranks[0]["sharded"] == (mode != "ddp")
        for step in range(STEPS):
            entry, reference = ranks[0]["history"][step], single["history"][step]
            assert sorted(entry["dropped_ids"]) == sorted(reference["dropped_ids"]), mode
            batch = torch.cat([ranks[0]["indices"][step], ranks[1]["indices"][step]])
            assert sorted(batch.tolist()) == sorted(single["indices"][step].tolist())
            ids = torch.cat([ranks[0]["input_ids"][step], ranks[1]["input_ids"][step]])
            kept = torch.tensor([int(i) not in entry["dropped_ids"] for i in batch])
            assert int(kept.sum()) == 2
            fresh = fresh_kept(twin(ranks[0]["params"][step]), ids[kept])
            for rank in ranks:
                error = max_rel_error(rank["grads"][step], fresh)
                assert error <= FP32_TOL, f"{mode} step {step}: .grad {error:.2e} off"


@pytest.mark.slow
@pytest.mark.multiprocess
def test_olmo_core_ddp_and_fsdp_with_the_default_rule_select_what_one_process_selects(
    launched: Path,
) -> None:
    """The callback's defaults (``step_cosine`` in Adam's metric) under ``dp_config`` DDP
    and FSDP: every rank drops at each step what the one-process run drops on the same
    global batch, the run drops something, and ``.grad`` after selection is the fresh
    backward over the kept. (A batch where the pairs across ranks change the kept set:
    ``tests/test_hf_distributed.py``'s twin examples.)"""
    folder = launched / "olmo_core_selection_worker"
    single = selection.train(folder, "single-defaults")
    assert any(entry["dropped_ids"] for entry in single["history"]), "vacuous: nothing dropped"
    for run in selection.DEFAULTS:
        ranks = [torch.load(folder / run / f"rank{r}.pt") for r in range(WORLD)]
        assert ranks[0]["history"] == ranks[1]["history"]
        for step in range(STEPS):
            entry, reference = ranks[0]["history"][step], single["history"][step]
            assert sorted(entry["dropped_ids"]) == sorted(reference["dropped_ids"]), run
            batch = torch.cat([ranks[0]["indices"][step], ranks[1]["indices"][step]])
            ids = torch.cat([ranks[0]["input_ids"][step], ranks[1]["input_ids"][step]])
            kept = torch.tensor([int(i) not in entry["dropped_ids"] for i in batch])
            fresh = fresh_kept(twin(ranks[0]["params"][step]), ids[kept])
            for rank in ranks:
                error = max_rel_error(rank["grads"][step], fresh)
                assert error <= FP32_TOL, f"{run} step {step}: .grad {error:.2e} off"


@pytest.mark.slow
@pytest.mark.multiprocess
def test_olmo_core_ddp_selection_refuses_ranks_with_unequal_label_tokens(launched: Path) -> None:
    """OLMo-core divides each rank's loss by that rank's own label tokens; with a label mask
    that leaves the ranks unequal counts, the rebuilt ``.grad`` would not be the token mean
    over the kept instances, so every rank refuses the step with the same message, which
    names OLMo-core's per-rank division and the ways out. (Without the mask the same run
    selects exactly: the tests above.)"""
    folder = launched / "olmo_core_selection_worker" / selection.MASKED
    messages = [torch.load(folder / f"refusal{r}.pt")["message"] for r in range(WORLD)]
    assert messages[0] == messages[1]
    assert "step 1:" in messages[0]
    assert "that rank's own label tokens" in messages[0]
    assert "select in one process" in messages[0]

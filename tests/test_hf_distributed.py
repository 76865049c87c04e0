"""The transformers callbacks on two data-parallel ranks (gloo, CPU), from one launch
(``tests/ranks_worker.py``, the ranks forked with torchrun's environment by
``tests.launch.forked_ranks``) of two workers.

``tests/hf_ddp_worker.py`` against the same script's one-process run on the same global
batches covers two runs: the HF ``Trainer`` with DDP (through accelerate), and a
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

(FSDP2 with ``MixedPrecisionPolicy(param_dtype=torch.bfloat16)``, two steps, the capture
alone) the stored gradients are the bf16 forward's: within bf16 rounding of fp64
autograd's, their sum the trainer's reduced ``.grad`` to that rounding.

``tests/selection_ddp_worker.py``: ``DataSelectionCallback`` under the DDP ``Trainer`` and
on a ``fully_shard``-ed model, whose every step drops what one process drops on the same
global batch (see that test).

``tests/step_cosine_ranks_worker.py``: the library's default rule, ``step_cosine`` in
Adam's metric, which weighs every pair of the global batch's gradients, on ranks that each
hold half of it (DDP and FSDP2), against the brute-force greedy of one process.

``tests/alone_ranks_worker.py``: the same launch with ``use_cpu`` unset, where accelerate
trains each rank alone; every callback refuses it before the first step.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from transformers import TrainerControl, TrainerState, TrainingArguments

from tda_plugins import CaptureEngine, LayerSelection
from tda_plugins.capture.identity import content_hash
from tda_plugins.data_selection import DataSelector, rule_by_name
from tda_plugins.data_selection.target import target_gradient
from tda_plugins.integrations.transformers import GradientCaptureCallback, pad_examples
from tda_plugins.integrations.transformers.selection import causal_lm_token_counts
from tda_plugins.precondition import load_curvature
from tda_plugins.precondition.adam import OPTIMIZER_FILE
from tda_plugins.session.batch import causal_lm_losses
from tda_plugins.session.capture import capture_plan
from tda_plugins.store import StoreError, StoreReader
from tda_plugins.store.fingerprint import fingerprint_differences
from tests import hf_ddp_worker
from tests.hf_ddp_worker import (
    EXAMPLES,
    GLOBAL_BATCH,
    MIXED_STEPS,
    SAVE_AT,
    STEPS,
    plan_settings,
    rows,
)
from tests.launch import forked_ranks
from tests.models import tiny_causal_lm
from tests.selection_ddp_worker import FORCED, FRACTION, target_rows
from tests.selection_ddp_worker import STEPS as SELECTION_STEPS
from tests.selection_helpers import (
    SelectionAudit,
    StepAudit,
    assert_trainer_grads_match_fresh,
    example_losses,
    fresh_kept_gradient,
    label_counts,
    oracle_kept,
)
from tests.step_cosine_ranks_worker import MARGIN, target_batch, warmed, window
from tests.step_cosine_ranks_worker import MODES as COSINE_MODES
from tests.stores import ManualScale, rel_error
from tests.trainers import FP32_TOL
from tests.zygote import Zygote

WORLD = 2
TOL = 1e-4
RUNS = ("trainer", "sharded")

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]


@pytest.fixture(scope="module")
def launched(tmp_path_factory: pytest.TempPathFactory, zygote: Zygote) -> Path:
    """``<root>/<worker>``: each worker's output, from one two-rank launch."""
    root = tmp_path_factory.mktemp("hf-distributed")
    forked_ranks(
        zygote,
        root,
        "hf_ddp_worker",
        "selection_ddp_worker",
        "step_cosine_ranks_worker",
        "alone_ranks_worker",
        ranks=WORLD,
    )
    return root


@pytest.fixture(scope="module")
def runs(launched: Path) -> Path:
    """``<folder>/2/<run>``: the two-rank runs; ``<folder>/1/<run>``: the one-process runs
    (in this process)."""
    folder = launched / "hf_ddp_worker"
    hf_ddp_worker.main(folder)
    return folder


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


def test_a_sharded_store_records_the_models_own_class(runs: Path) -> None:
    """``fully_shard`` swaps in an ``FSDP<Class>`` subclass; the store's fingerprint names
    the model's own class, so the sharded run's store and the one-process run's agree (and
    queries captured from the saved unsharded model are not refused as another model)."""
    sharded = StoreReader(runs / str(WORLD) / "sharded" / "store").fingerprint
    single = StoreReader(runs / "1" / "sharded" / "store").fingerprint
    assert sharded is not None and single is not None
    assert sharded["model"]["class"] == "LlamaForCausalLM"
    assert fingerprint_differences(sharded, single) == []


def test_a_rank_that_refuses_a_resume_stops_every_rank_before_any_step_is_removed(
    runs: Path,
) -> None:
    """Two ranks resume a store whose rank-1 folder is gone: rank 1 refuses (no step of its
    own), and so does rank 0, which found its own steps whole, before it truncated them;
    rank 1's writer leaves no folder behind."""
    folder = runs / str(WORLD) / "without-rank-1"
    outcomes = [json.loads((folder / f"refused-{r}.json").read_text()) for r in range(WORLD)]
    assert "written by other processes than this run's 2" in outcomes[1]["refusal"]
    assert outcomes[0]["refusal"].startswith("rank 1 refused this start: ")
    whole = {str(step): GLOBAL_BATCH // WORLD for step in range(STEPS)}
    assert [o["steps"] for o in outcomes] == [whole, whole]  # rank 0's steps all kept
    assert [o["rank_folders"] for o in outcomes] == [["rank-0"], ["rank-0"]]  # none made


def test_a_store_of_two_ranks_is_not_resumed_by_one_process(runs: Path, tmp_path: Path) -> None:
    """One process resuming the two-rank store would keep rank 1's later steps beside its
    own new ones (each of those examples counted twice): refused, nothing removed."""
    store = tmp_path / "store"
    shutil.copytree(runs / str(WORLD) / "sharded" / "store", store)
    before = StoreReader(store).step_example_ids()
    capture = GradientCaptureCallback(store_dir=str(store), layers="all")
    args = TrainingArguments(output_dir=str(tmp_path / "out"), use_cpu=True, report_to=[])
    model = tiny_causal_lm("llama", torch.float32).train()
    with pytest.raises(StoreError, match=r"rank-1 steps 0\.\.3\): resumed by another number"):
        capture.on_train_begin(
            args, TrainerState(global_step=SAVE_AT), TrainerControl(), model=model
        )
    assert StoreReader(store).step_example_ids() == before


def test_the_memory_plan_counts_the_training_state_each_rank_holds(runs: Path) -> None:
    """FSDP2 over both ranks holds the model's training state once between them; HSDP
    with the two ranks as replicas holds it whole on each (not halved by the world)."""
    whole = capture_plan(plan_settings(runs), tiny_causal_lm("llama", torch.float32)).training_bytes
    plans = [json.loads((runs / str(WORLD) / f"plan-{r}.json").read_text()) for r in range(WORLD)]
    assert sum(plan["fsdp"] for plan in plans) == whole
    assert [plan["hsdp"] for plan in plans] == [whole, whole]


def _exact_gradients(model: torch.nn.Module, tokens: list[int]) -> dict[str, torch.Tensor]:
    """The gradient of one example's summed next-token loss: fp64 autograd, unpadded."""
    ids = torch.tensor([tokens])
    logits = model(input_ids=ids).logits[0, :-1]
    loss = F.cross_entropy(logits, ids[0, 1:], reduction="sum")
    params = dict(model.named_parameters())
    return dict(zip(params, torch.autograd.grad(loss, list(params.values())), strict=True))


def example_id(example: dict[str, list[int]]) -> int:
    """The id the store names an unpadded example by (a content hash of its tokens)."""
    return int(content_hash(torch.tensor([example["input_ids"]]))[0])


def _whole(got: list[torch.Tensor], ref: list[torch.Tensor]) -> float:
    return rel_error(torch.cat([g.flatten() for g in got]), torch.cat([r.flatten() for r in ref]))


def test_fsdp2_bf16_mixed_precision_stores_the_bf16_forwards_gradients(runs: Path) -> None:
    """README: under ``MixedPrecisionPolicy(param_dtype=torch.bfloat16)`` the stored
    gradients are those of the bf16 forward each step trained on: within bf16 rounding of
    the exact ones (fp64 autograd, one example at a time, its summed token loss; measured
    8e-3 to 2e-2 a layer), and their sum over the global batch, over its label tokens,
    is the trainer's ``.grad`` after the ranks' bf16 reduction to that rounding (measured
    2.5e-3 on the whole model, at most 4e-3 a layer), closer than the exact gradients'
    sum (5e-3 to 6e-3): the stored ones are that forward's, not bit for bit."""
    folder = runs / str(WORLD) / "mixed"
    record = torch.load(folder / "record.pt")
    chunk = StoreReader(folder / "store").load_all()
    rows_of = {layer: grads.materialize() for layer, grads in chunk.layers.items()}
    unit = 2.0**-8  # bf16's unit roundoff
    assert len(record["weights"]) == MIXED_STEPS
    for step, (weights, grad) in enumerate(zip(record["weights"], record["grads"], strict=True)):
        model = tiny_causal_lm("llama", torch.float64)
        model.load_state_dict(weights)
        batch = rows()[step * GLOBAL_BATCH : (step + 1) * GLOBAL_BATCH]
        exact = [_exact_gradients(model, example["input_ids"]) for example in batch]
        at_step = (chunk.steps == step).nonzero().flatten().tolist()
        row_of = {chunk.example_ids[r].item(): r for r in at_step}
        names = [f"{layer}.weight" for layer in rows_of]
        assert len(at_step) == GLOBAL_BATCH and len(names) == len(exact[0])  # every weight
        stored = [
            {
                layer: values[row_of[example_id(example)]].reshape(weights[f"{layer}.weight"].shape)
                for layer, values in rows_of.items()
            }
            for example in batch
        ]
        for got, want in zip(stored, exact, strict=True):
            for layer, value in got.items():
                err = rel_error(value, want[f"{layer}.weight"])
                # bf16's rounding, not fp32's (1e-6): the bf16 forward's gradients
                assert unit / 4 <= err <= 8 * unit, f"step {step} {layer}: {err:.2e}"
        tokens = sum(len(example["input_ids"]) - 1 for example in batch)
        summed = {f"{layer}.weight": sum(g[layer] for g in stored) / tokens for layer in stored[0]}
        exact_sum = {n: sum(e[n] for e in exact) / tokens for n in names}
        for name in names:
            err = rel_error(summed[name], grad[name])
            assert err <= 2 * unit, f"step {step} {name}: {err:.2e}"
        trainers = [grad[n] for n in names]
        ours, theirs = (
            _whole([summed[n] for n in names], trainers),
            _whole([exact_sum[n] for n in names], trainers),
        )
        assert 0 < ours <= unit and ours < theirs, f"step {step}: {ours:.2e}, {theirs:.2e}"


def test_ranks_exchange_unequal_rows_and_objects_in_rank_order(runs: Path) -> None:
    expected = {
        "rows": [[1.0, 0.0], [1.0, 1.0], [1.0, 2.0]],  # rank 0 had none, rank 1 three
        "objects": [{"0": [0]}, {"10": [1], "11": [1, 1]}],
    }
    for rank in range(WORLD):
        got = json.loads((runs / str(WORLD) / f"gathered-{rank}.json").read_text())
        assert got == expected


# -- data selection ------------------------------------------------------------------------


def one_process_dropped(audit: StepAudit) -> tuple[list[int], list[int]]:
    """The ids and dropped ids of one process's selection over ``audit``'s micro-batches
    (every rank's, in rank order) at its weights: the fp32 model, the target pool of the
    run, the loss over the window's label tokens."""
    model = tiny_causal_lm("llama", torch.float32)
    model.load_state_dict(audit.weights)
    tokens = float(sum(int(label_counts(b).sum()) for b in audit.micro_batches))
    normalization = ManualScale()
    normalization.value = tokens
    with CaptureEngine(
        model,
        layers=LayerSelection("all"),
        normalization=normalization,
    ) as engine:
        selector = DataSelector(
            engine.captured_layers,
            rule=rule_by_name("bottom_fraction", fraction=FRACTION),
            token_counts=causal_lm_token_counts,
        )
        engine.add_consumer(selector)
        with engine.paused():
            target = pad_examples(target_rows())
            layers = engine.captured_layers
            selector.set_target(target_gradient(model, layers, target, causal_lm_losses))
        for batch in audit.micro_batches:
            (example_losses(model, batch).sum() / tokens).backward()
        engine.optimizer_step()
    (outcome,) = selector.history
    return outcome.example_ids.tolist(), outcome.summary()["dropped_ids"]


def merged_ranks(folder: Path) -> tuple[dict[int, StepAudit], list[dict[str, Any]]]:
    """Both ranks' audits as one global batch per step (rank 0's micro-batches first), after
    checking that the ranks agree on ``.grad`` and on the selection's outcome."""
    ranks = [SelectionAudit.load(folder / f"rank{r}") for r in range(WORLD)]
    histories = [
        json.loads((folder / f"rank{r}" / "history.json").read_text()) for r in range(WORLD)
    ]
    assert histories[0] == histories[1], "the ranks disagree on the global outcome"
    merged = {}
    for step in range(SELECTION_STEPS):
        zero, one = ranks[0].steps[step], ranks[1].steps[step]
        differ = [n for n in zero.grads if not torch.equal(zero.grads[n], one.grads[n])]
        assert not differ, f"step {step}: ranks disagree on .grad of {differ[:3]}"
        merged[step] = StepAudit(
            zero.weights,
            zero.micro_batches + one.micro_batches,
            zero.num_items + one.num_items,
            grads=zero.grads,
        )
    return merged, [histories[0][str(step)] for step in range(SELECTION_STEPS)]


def assert_same_as_one_process(merged: dict[int, StepAudit], history: list[dict]) -> None:
    dropped = {}
    for step, audit in merged.items():
        ids, expected = one_process_dropped(audit)
        entry = history[step]
        assert entry["dropped_ids"] == expected, f"step {step}: dropped {entry['dropped_ids']}"
        assert len(expected) == len(ids) // 2 == entry["dropped"] == entry["kept"]
        dropped[step] = set(expected)
    check = assert_trainer_grads_match_fresh(
        merged, dropped, lambda: tiny_causal_lm("llama", torch.float64), math.inf, FP32_TOL
    )
    assert check.steps == SELECTION_STEPS


def test_transformers_ddp_and_fsdp2_select_what_one_process_selects(launched: Path) -> None:
    """DDP ``Trainer`` and a ``fully_shard``-ed model driven through the callback's events:
    each rank's ``.grad`` after selection equals the fresh backward over the kept examples
    of the global batch, the dropped set equals one process's on that batch, and the
    JSONL log (written by rank 0 alone) holds one line per step with the global outcome.
    Under FSDP both correction routes are exact (forced at steps 1 and 2; the cost
    model's choice at step 0), the memory the selection holds at once stays within one
    layer's size (the cost model's routes), and ``max_grad_norm`` is restored."""
    folder = launched / "selection_ddp_worker"
    for mode in ("ddp", "fsdp"):
        merged, history = merged_ranks(folder / mode)
        assert_same_as_one_process(merged, history)
    lines = (folder / "ddp" / "trainer" / "selection.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == merged_ranks(folder / "ddp")[1]

    routes = json.loads((folder / "fsdp" / "rank0" / "routes.json").read_text())
    for step, forced in FORCED.items():
        assert set(routes[str(step)].values()) == {forced}
    assert set(routes["0"]) == set(routes["1"]) and set(routes["0"].values()) <= set(
        FORCED.values()
    )
    memory = json.loads((folder / "fsdp" / "rank0" / "memory.json").read_text())
    model = tiny_causal_lm("llama", torch.float32)
    largest = max(m.weight.numel() * 4 for m in model.modules() if hasattr(m, "weight"))
    assert 0 < memory["target_peak_bytes"] <= largest  # one layer's target at a time
    # the cost model gathers a layer only when that moves fewer bytes than reducing it
    assert 0 < memory["surgery_peak_bytes"]["0"] <= largest
    assert memory["max_grad_norm_restored"]


@pytest.mark.parametrize("callback", ["capture", "influence", "selection"])
def test_launched_ranks_that_the_trainer_runs_alone_are_refused_before_any_step(
    launched: Path, callback: str
) -> None:
    """torchrun's two ranks, the ``Trainer`` without ``use_cpu`` on this GPU-less machine:
    accelerate runs each rank alone (``not_parallel``), so each would train on all the data
    as rank 0. Each callback refuses at ``on_train_begin``, naming the cause and the fix."""
    for rank in range(WORLD):
        outcome = json.loads(
            (launched / "alone_ranks_worker" / f"{callback}-{rank}.json").read_text()
        )
        assert outcome["parallel_mode"] == "not_parallel"  # the setup really is the case
        refusal = outcome["refusal"]
        assert refusal is not None, f"rank {rank} trained"
        for phrase in ("2 processes were launched", "runs each one alone", "use_cpu=True"):
            assert phrase in refusal, refusal
        assert outcome["steps"] == 0 and not outcome["store"]


@pytest.mark.parametrize("mode", COSINE_MODES)
def test_step_cosine_on_ranks_keeps_the_greedy_set_of_the_global_batch(
    launched: Path, mode: str
) -> None:
    """DDP and FSDP2, each rank holding half the global batch: every rank's outcome is the
    brute-force greedy's on the whole batch, in the Adam metric of the step (the pairs
    across ranks included, which no rank holds alone), and ``.grad`` is the fresh
    backward over the kept examples."""
    saved = torch.load(launched / "step_cosine_ranks_worker" / f"{mode}.pt")
    torch.manual_seed(0)
    model = tiny_causal_lm("llama", torch.float64)
    optimizer = warmed(model)
    for name, value in model.state_dict().items():  # the ranks stepped from these weights
        assert rel_error(saved["weights"][name], value) <= 1e-12, name
    whole = window()
    expected = oracle_kept(model, optimizer, whole, target_batch(), MARGIN)
    assert 0 < int(expected.sum()) < len(expected), "vacuous: nothing or everything dropped"
    for rank, dropped in enumerate(saved["dropped"]):
        assert (~dropped).tolist() == expected.tolist(), f"rank {rank}"
    tokens = float(label_counts(whole).sum())
    micro = [{k: v[j : j + 2] for k, v in whole.items()} for j in range(0, 8, 2)]
    masks = [expected[j : j + 2] for j in range(0, 8, 2)]
    fresh = fresh_kept_gradient(model, micro, masks, tokens)
    for name, grad in fresh.items():
        err = rel_error(saved["grads"][name], grad)
        assert err <= 1e-9, f"{name}: {err:.2e}"

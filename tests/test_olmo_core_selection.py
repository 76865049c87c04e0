"""OLMo-core ``Trainer`` + ``DataSelectionCallback``: after each step's selection, ``.grad``
is a fresh backward over the kept instances alone, with OLMo-core's normalization.

The tiny OLMo-2 transformer and ``NumpyFSLDataset`` of ``tests.test_olmo_core`` train for
:data:`STEPS` steps on CPU in fp32 (AdamW, 4 instances per step, one or two micro-batches).
Two audit callbacks surround the selection callback: each keeps, per step, the weights the
step starts from and its batch (``pre_step``) and every ``.grad`` at ``pre_optim_step``:
the first what the backward left, the second what the optimizer (after OLMo-core's own
clipping, inside ``optim_step``) is given.

The reference never touches the engine: an fp64 copy of the model at the step's weights,
one backward of ``sum_{kept i} L_i / N_kept`` over the kept instances alone (``L_i`` an
instance's summed next-token cross-entropy written by hand from the logits, ``N_kept``
their label tokens). Which instances must be dropped is worked out independently too:
each instance's own gradient and the target pool's summed gradient, one backward each,
scored (dot, or cosine over all parameters) and the rule applied by hand.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from olmo_core.data import NumpyDataLoaderConfig
from olmo_core.nn.transformer import Transformer
from olmo_core.optim import AdamWConfig
from olmo_core.train import Duration, TrainerConfig
from olmo_core.train.callbacks import Callback
from olmo_core.train.train_module import TransformerTrainModule, TransformerTrainModuleConfig
from torch import Tensor

from tda_plugins.integrations.olmo_core import DataSelectionCallback, UnsupportedTrainingSetup
from tda_plugins.integrations.olmo_core.pool import pool_batch
from tda_plugins.integrations.olmo_core.selection import loss_token_counts
from tests.oracle import max_rel_error
from tests.selection_helpers import PINNED
from tests.test_olmo_core import BATCH, MODEL, SEQ, VOCAB, dataset_config

FP32_TOL = 1e-4
STEPS = 3
FRACTION = 0.5  # floor(0.5 * 4) = 2 of each step's 4 instances dropped
#: Target pools: token-id lists of different lengths (right-padded inside), or a tensor.
rng = np.random.default_rng(7)
TARGET_LISTS = [rng.integers(1, VOCAB, size=n).tolist() for n in (8, 5, 6)]
TARGET_TENSOR = torch.as_tensor(rng.integers(1, VOCAB, size=(3, SEQ)))


@dataclass
class AuditedStep:
    params: dict[str, Tensor]
    index: Tensor
    input_ids: Tensor
    grads: dict[str, Tensor] = field(default_factory=dict)


@dataclass
class GradAudit(Callback):
    """Per step: the starting weights and batch (``pre_step``), ``.grad`` (``pre_optim_step``)."""

    steps: list[AuditedStep] = field(default_factory=list)

    def model(self) -> Transformer:
        train_module = self.trainer.train_module
        assert isinstance(train_module, TransformerTrainModule)
        return train_module.model

    def pre_step(self, batch: dict[str, Any]) -> None:
        model = self.model()
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
        self.steps.append(AuditedStep(params, batch["index"].clone(), batch["input_ids"].clone()))

    def pre_optim_step(self) -> None:
        model = self.model()
        self.steps[-1].grads = {
            n: torch.zeros_like(p) if p.grad is None else p.grad.detach().clone()
            for n, p in model.named_parameters()
        }


@dataclass
class Run:
    before: list[AuditedStep]
    after: list[AuditedStep]
    selection: DataSelectionCallback
    work_dir: Path


def train(
    tmp_path: Path,
    selection: DataSelectionCallback,
    micro_batch: int,
    others: dict[str, Callback] | None = None,
) -> Run:
    """``STEPS`` steps, ``BATCH`` instances per step, ``micro_batch`` per forward/backward,
    with the audits before and after ``selection`` (callbacks of one priority run in the
    order given) and ``others`` first."""
    torch.manual_seed(0)
    dataset = dataset_config(tmp_path).build()
    loader = NumpyDataLoaderConfig(global_batch_size=BATCH * SEQ, seed=0).build(dataset)
    module = TransformerTrainModuleConfig(
        rank_microbatch_size=micro_batch * SEQ,
        max_sequence_length=SEQ,
        optim=AdamWConfig(lr=1e-2),
        max_grad_norm=1.0,
    ).build(MODEL.build(init_device="cpu"), device=torch.device("cpu"))
    before, after = GradAudit(), GradAudit()
    config = TrainerConfig(
        save_folder=str(tmp_path / "run"),
        max_duration=Duration.steps(STEPS),
        metrics_collect_interval=1,
        no_checkpoints=True,
    ).with_callbacks({**(others or {}), "before": before, "selection": selection, "after": after})
    trainer = config.build(module, loader)
    trainer.fit()
    return Run(before.steps, after.steps, selection, Path(trainer.work_dir))


# -- the reference, fp64 ---------------------------------------------------------------


def twin(params: dict[str, Tensor]) -> Transformer:
    """An fp64 copy of the tiny model at ``params``."""
    model = MODEL.build(init_device="cpu").double()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(params[name])
    return model


def summed_loss(model: Transformer, rows: list[Tensor]) -> Tensor:
    """Sum over ``rows`` (1-D token ids, each unpadded) of its summed next-token CE."""
    total = torch.zeros((), dtype=torch.float64)
    for ids in rows:
        logits = model(ids[None])[0, :-1]
        total = total + F.cross_entropy(logits, ids[1:], reduction="sum")
    return total


def grads_of(model: Transformer, loss: Tensor) -> dict[str, Tensor]:
    names = [n for n, _ in model.named_parameters()]
    return dict(zip(names, torch.autograd.grad(loss, list(model.parameters())), strict=True))


def fresh_kept_gradient(model: Transformer, input_ids: Tensor, keep: Tensor) -> dict[str, Tensor]:
    """Gradient of ``sum_{kept} L_i / N_kept`` in one batch of the kept instances alone."""
    kept = input_ids[keep]
    logits = model(kept)[:, :-1]
    loss = F.cross_entropy(logits.transpose(1, 2), kept[:, 1:], reduction="sum")
    return grads_of(model, loss / kept[:, 1:].numel())


def target_rows(target: Any) -> list[Tensor]:
    if isinstance(target, Tensor):
        return list(target)
    return [torch.as_tensor(row) for row in target]


def expected_dropped(
    model: Transformer, input_ids: Tensor, target: Any, score: str, index: Tensor
) -> set[int]:
    """The ``floor(FRACTION * N)`` lowest-scoring instances (their batch index values),
    each instance's and the target's gradient taken in its own backward."""
    t = grads_of(model, summed_loss(model, target_rows(target)))
    scores = []
    for ids in input_ids:
        g = grads_of(model, summed_loss(model, [ids]))
        dot = sum(float((g[n].double() * t[n]).sum()) for n in t)
        if score == "cosine":
            g_norm = math.sqrt(sum(float(v.pow(2).sum()) for v in g.values()))
            t_norm = math.sqrt(sum(float(v.pow(2).sum()) for v in t.values()))
            dot /= g_norm * t_norm
        scores.append(dot)
    lowest = sorted(range(len(scores)), key=scores.__getitem__)
    return {int(index[i]) for i in lowest[: math.floor(FRACTION * len(scores))]}


# -- tests -----------------------------------------------------------------------------


CASES = [
    pytest.param(score, micro_batch, target, id=f"{score}-ga{BATCH // micro_batch}-{kind}")
    for score, micro_batch, target, kind in [
        ("dot", BATCH, TARGET_LISTS, "lists"),
        ("dot", BATCH // 2, TARGET_TENSOR, "tensor"),
        ("cosine", BATCH, TARGET_TENSOR, "tensor"),
        ("cosine", BATCH // 2, TARGET_LISTS, "lists"),
    ]
]


@pytest.mark.slow
@pytest.mark.parametrize("score, micro_batch, target", CASES)
def test_grad_after_selection_is_a_fresh_backward_over_the_kept_instances(
    tmp_path: Path, score: str, micro_batch: int, target: Any
) -> None:
    """Every step drops the 2 instances the oracle's scores rank lowest (logged by their
    OLMo-core batch index), and every parameter's ``.grad`` after the selection equals
    the fresh backward over the other 2 alone, normalized by their own label tokens."""
    selection = DataSelectionCallback(target, fraction=FRACTION, **{**PINNED, "score": score})
    run = train(tmp_path, selection, micro_batch)
    history = selection.history
    assert [h.step for h in history] == list(range(STEPS))
    assert len(run.after) == STEPS
    lines = (run.work_dir / "selection.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == [h.summary() for h in history]
    assert [json.loads(line)["step"] for line in lines] == list(range(1, STEPS + 1))  # OLMo's

    for k, (step, before) in enumerate(zip(run.after, run.before, strict=True)):
        entry = history[k].summary()
        assert history[k].example_ids.tolist() == step.index.tolist()
        dropped = set(entry["dropped_ids"])
        assert dropped <= set(step.index.tolist()) and len(dropped) == 2
        model = twin(step.params)
        assert dropped == expected_dropped(model, step.input_ids, target, score, step.index)
        keep = torch.tensor([int(i) not in dropped for i in step.index])
        fresh = fresh_kept_gradient(model, step.input_ids, keep)
        error = max_rel_error(step.grads, fresh)
        assert error <= FP32_TOL, f"step {k}: .grad is {error:.2e} away from the fresh backward"
        assert max_rel_error(before.grads, fresh) > 1e-2, "the selection changed nothing"


@pytest.mark.slow
def test_dropping_nothing_leaves_grad_unchanged(tmp_path: Path) -> None:
    """``fraction=0``: no instance is dropped and every ``.grad`` is bit for bit what the
    backward left (two micro-batches per step)."""
    selection = DataSelectionCallback(TARGET_LISTS, fraction=0.0, **PINNED)
    run = train(tmp_path, selection, BATCH // 2)
    assert len(selection.history) == STEPS
    assert not any(h.dropped.any() for h in selection.history)
    for before, after in zip(run.before, run.after, strict=True):
        changed = [n for n in before.grads if not torch.equal(before.grads[n], after.grads[n])]
        assert not changed, f".grad changed: {changed[:3]}"


def test_uncaptured_trainable_parameters_are_refused_before_any_step(tmp_path: Path) -> None:
    """Linear layers only leave the embedding and the norm scales uncaptured: ``fit``
    refuses at ``pre_train`` (before the dry run and any step), naming them."""
    selection = DataSelectionCallback(TARGET_LISTS, layers="linear")
    with pytest.raises(UnsupportedTrainingSetup, match=r"not captured.*layers='all'") as info:
        train(tmp_path, selection, BATCH)
    assert "embeddings" in str(info.value)
    assert selection.selector is None


def test_a_trajectory_recorded_beside_selection_is_refused_before_any_step(
    tmp_path: Path,
) -> None:
    """``record_trajectory`` records every instance of a step as trained and the whole
    batch's clipping; selection drops instances from ``.grad`` (which OLMo-core zeroes
    before the recorder's own check could see it), so the recorded run would not be the
    one trained: refused at ``pre_train``, before any step or store."""
    from tda_plugins.integrations.olmo_core import GradientCaptureCallback
    from tda_plugins.session.settings import CaptureSettings

    settings = CaptureSettings.from_options(
        store_dir=str(tmp_path / "store"), layers="all", curvature=False, record_trajectory=True
    )
    selection = DataSelectionCallback(TARGET_LISTS, layers="all")
    with pytest.raises(UnsupportedTrainingSetup, match="record_trajectory=True"):
        train(tmp_path, selection, BATCH, {"capture": GradientCaptureCallback(settings)})
    assert selection.selector is None and not (tmp_path / "store").exists()


@dataclass
class CheckpointLike(Callback):
    """Reads the influence callback's state at ``post_train_batch`` of every step, before
    any ``post_step``, as OLMo-core's checkpointer (priority 1) saves it; and keeps the
    metrics the trainer logs."""

    priority: ClassVar[int] = 1
    states: list[dict[str, Any]] = field(default_factory=list)
    logged: dict[int, dict[str, float]] = field(default_factory=dict)

    def post_train_batch(self) -> None:
        self.states.append(self.trainer.callbacks["influence"].state_dict())

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        self.logged.setdefault(step, {}).update(metrics)


def test_influence_leaves_out_the_instances_the_selection_dropped(tmp_path: Path) -> None:
    """The influence callback runs before the selection; still, each step's influence
    covers exactly the instances the selection kept (dropped ones did not train), in the
    live log, in the state a checkpoint saves before ``post_step``, and in the metrics
    logged at every step."""
    from tda_plugins.integrations.olmo_core import InfluenceLoggingCallback

    influence = InfluenceLoggingCallback(
        TARGET_LISTS[:2], method="graddot", layers="all", report_dir=str(tmp_path / "report")
    )
    checkpoints = CheckpointLike()
    selection = DataSelectionCallback(TARGET_LISTS, fraction=FRACTION, layers="all", **PINNED)
    train(tmp_path, selection, BATCH, {"influence": influence, "checkpoints": checkpoints})
    kept = {h.step: set(h.example_ids[~h.dropped].tolist()) for h in selection.history}
    assert len(kept) == STEPS and all(len(ids) == BATCH // 2 for ids in kept.values())
    history = influence.influence_log.history
    assert {h.step: set(h.example_ids.tolist()) for h in history} == kept
    ever_kept = set().union(*kept.values())
    for state in checkpoints.states:
        assert set(state["influence_log"]["cumulative_ids"].tolist()) <= ever_kept
    report = json.loads((tmp_path / "report" / "influence.json").read_text())
    for h, logged in zip(history, report["history"], strict=True):
        assert logged["mean"] == pytest.approx(h.scores.mean(0).tolist())
        metrics = checkpoints.logged[h.step + 1]
        assert metrics["influence/q0_mean"] == pytest.approx(float(h.scores[:, 0].mean()))


def test_target_pool_labels_are_shifted_and_padding_is_ignored() -> None:
    batch = pool_batch([[5, 6, 7], [8, 9]])
    assert batch["input_ids"].tolist() == [[5, 6, 7], [8, 9, 0]]
    assert batch["labels"].tolist() == [[6, 7, -100], [9, -100, -100]]
    tensor = pool_batch(torch.tensor([[1, 2, 3]]), ignore_index=-1)
    assert tensor["labels"].tolist() == [[2, 3, -1]]
    with pytest.raises(ValueError, match="two or more tokens"):
        DataSelectionCallback([[1]])


def test_loss_tokens_count_masked_instances_whole_as_olmo_core_does() -> None:
    """An instance-filtered instance (all labels ignored) adds its whole length to
    OLMo-core's ``loss_div_factor``; the others their labels that are not ignored."""
    labels = torch.tensor([[1, 2, -100], [-100, -100, -100], [3, -100, -100]])
    mask = torch.tensor([True, False, True])
    assert loss_token_counts(labels, -100).tolist() == [2, 0, 1]
    assert loss_token_counts(labels, -100, mask).tolist() == [2, 3, 1]

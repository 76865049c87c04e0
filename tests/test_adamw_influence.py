"""Trajectory recording and ``adamw_influence``.

1. Inside real ``Trainer`` runs (full fine-tuning and LoRA, gradient accumulation 1 and
   2, with and without clipping, weight decay, a decaying learning rate), the method's
   scores equal a brute-force derivative of each query's loss at the final weights with
   respect to each example's loss weight, through a ``torch.func`` replay of the run's
   AdamW steps with the denominators held fixed (``tests.trajectory_oracle``), and the
   replay's final weights equal the trainer's.
2. The sign convention and scale against actual leave-one-out retraining.
3. Crash and resume: a resumed run's trajectory equals an uninterrupted run's.
4. Refusals: unsupported optimizers and captures before the first step, stores without
   a trajectory, ``.grad`` edited behind the recording.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from datasets import Dataset
from torch import Tensor, nn
from transformers import Trainer, TrainerCallback

from tda_plugins import LayerSelection, causal_lm_example_losses
from tda_plugins.capture import content_hash
from tda_plugins.capture.normalization import SummedLoss
from tda_plugins.integrations.transformers import GradientCaptureCallback
from tda_plugins.methods import method_by_name
from tda_plugins.session import CaptureSession, CaptureSettings
from tda_plugins.store import StoreReader
from tda_plugins.trajectory import TrajectoryReader
from tests.models import tiny_causal_lm, with_lora
from tests.stores import capture_store, rel_error, scores_by_id, summed_loss
from tests.trainers import RecordingCollator, WeightSnapshots, pad_rows, token_rows, training_args
from tests.trajectory_oracle import AdamWRun, replay

ROWS = 24
STEPS = 4


def fp64_loss(
    logits: Tensor,
    labels: Tensor,
    vocab_size: int,
    num_items_in_batch: Tensor | int | None = None,
    **kwargs: Any,
) -> Tensor:
    """The transformers causal-LM loss (summed token losses over ``num_items_in_batch``,
    else the mean) without its cast of the logits to fp32, so an fp64 run stays fp64."""
    divisor = num_items_in_batch or int((labels[..., 1:] != -100).sum())
    return causal_lm_example_losses(logits, labels).sum() / divisor


def fp64_model(kind: str) -> nn.Module:
    """The tiny Llama in fp64 computing its training loss in fp64 (``"lora"``: with LoRA)."""
    model = tiny_causal_lm("llama", torch.float64)
    model.loss_function = fp64_loss
    return with_lora(model) if kind == "lora" else model


@dataclass
class Run:
    trainer: Trainer
    collator: RecordingCollator
    snapshots: WeightSnapshots
    store_dir: Path

    @property
    def store(self) -> StoreReader:
        return StoreReader(self.store_dir)


def train(
    tmp_path: Path,
    kind: str = "full",
    capture: dict[str, Any] | None = None,
    callbacks: Sequence[TrainerCallback] = (),
    resume_from: Path | None = None,
    **overrides: Any,
) -> Run:
    """An fp64 ``Trainer`` run of the tiny Llama (``kind``: ``"full"`` or ``"lora"``) with
    ``GradientCaptureCallback(record_trajectory=True, **capture)``."""
    options: dict[str, Any] = dict(max_steps=STEPS, weight_decay=0.1, adam_beta2=0.99)
    options.update(overrides)
    store_dir = tmp_path / "store"
    collator = RecordingCollator()
    snapshots = WeightSnapshots()
    settings = dict(
        store_dir=str(store_dir), curvature=False, record_trajectory=True, **(capture or {})
    )
    trainer = Trainer(
        model=fp64_model(kind),
        args=training_args(tmp_path / "out", **options),
        train_dataset=Dataset.from_list([{"input_ids": r} for r in token_rows(ROWS)]),
        data_collator=collator,
        callbacks=[snapshots, *callbacks, GradientCaptureCallback(**settings)],
    )
    trainer.train(resume_from_checkpoint=None if resume_from is None else str(resume_from))
    return Run(trainer, collator, snapshots, store_dir)


def query_rows() -> list[list[int]]:
    return token_rows(3, seed=11)


def capture_queries(run: Run, path: Path) -> StoreReader:
    """Query gradients at the run's final weights, with the store's layers."""
    batch = pad_rows([{"input_ids": r} for r in query_rows()])
    layers = LayerSelection(include="|".join(f"^{n}$" for n in run.store.layer_names))
    return capture_store(run.trainer.model, [batch], path, layers=layers, curvature=False)


def replay_run(run: Run, accumulation: int, max_grad_norm: float) -> tuple[Any, ...]:
    """The brute-force replay of ``run`` from its initial weights."""
    model = run.trainer.model
    initial = fp64_model("lora" if hasattr(model, "peft_config") else "full")
    initial.load_state_dict(run.snapshots.weights[0])
    initial.train()
    decayed = set(run.trainer.get_decay_parameter_names(model))
    trained = [n for n, p in model.named_parameters() if p.requires_grad]
    captured = {
        f"{layer}.{local}"
        for layer in run.store.layer_names
        for local, _ in model.get_submodule(layer).named_parameters(recurse=False)
    }
    args = run.trainer.args
    batches = run.collator.batches
    windows = [batches[s * accumulation : (s + 1) * accumulation] for s in range(STEPS)]
    steps = [
        [i for b in window for i in content_hash(b["input_ids"], b["attention_mask"]).tolist()]
        for window in windows
    ]
    oracle = AdamWRun(
        steps=steps,
        examples=run.collator.examples(),
        lr=[args.learning_rate * (STEPS - s) / STEPS for s in range(STEPS)],
        betas=(args.adam_beta1, args.adam_beta2),
        eps=args.adam_epsilon,
        weight_decay={n: args.weight_decay if n in decayed else 0.0 for n in trained},
        max_grad_norm=max_grad_norm,
        captured=frozenset(captured),
    )
    queries = [(torch.tensor(r), torch.tensor(r)) for r in query_rows()]
    return replay(initial, oracle, queries)


CASES = {
    "full-accumulation1-noclip": ("full", 1, 0.0),
    "full-accumulation2-clip": ("full", 2, 1.0),
    "lora-accumulation1-clip": ("lora", 1, 1.0),
    "lora-accumulation2-noclip": ("lora", 2, 0.0),
}


@pytest.mark.parametrize("case", CASES)
def test_scores_equal_the_derivative_of_a_replayed_run(tmp_path: Path, case: str) -> None:
    """``adamw_influence`` = ``-d L_q(theta_T) / d w_z`` of the brute-force replay (an fp64
    run, relative 1e-6: scores are fp32), whose final weights are the trainer's (1e-10)."""
    kind, accumulation, clip = CASES[case]
    run = train(tmp_path, kind, gradient_accumulation_steps=accumulation, max_grad_norm=clip)
    trajectory = TrajectoryReader(run.store_dir)
    clips = [trajectory.record(step).clip for step in trajectory.steps]
    assert trajectory.steps == list(range(STEPS))
    assert min(clips) < 1 if clip else clips == [1.0] * STEPS  # clipping acted where on
    queries = capture_queries(run, tmp_path / "queries")
    scores = method_by_name("adamw_influence").score(run.store, queries)

    final, occurrences, derivatives = replay_run(run, accumulation, clip)
    trained = dict(run.trainer.model.named_parameters())
    assert max(rel_error(trained[n].detach(), t) for n, t in final.items()) < 1e-10
    ids = torch.tensor([i for _, i in occurrences])
    assert len(set(ids.tolist())) == len(ids)  # one epoch: each example once
    got = scores_by_id(scores, ids, queries.load_all().example_ids)
    expected = -derivatives
    assert expected.abs().max() > 0
    assert rel_error(got, expected) < 1e-6


# -- 2. against leave-one-out retraining ---------------------------------------------------


LOO_ROWS = token_rows(12)
LOO_BATCH = 4


def linear_only_llama() -> nn.Module:
    """The tiny fp64 Llama training its linear layers alone (every trained parameter is
    captured, so removing an example changes nothing the scores do not see)."""
    model = tiny_causal_lm("llama", torch.float64)
    for name, p in model.named_parameters():
        p.requires_grad_(name.endswith("proj.weight") or name.startswith("lm_head"))
    return model.train()


def train_plain(
    lr: float, eps: float, removed: int | None = None, store_dir: Path | None = None
) -> nn.Module:
    """3 AdamW steps of 4 rows of ``LOO_ROWS`` (without row ``removed``), each step the
    plain sum of its examples' losses; recorded into ``store_dir`` when given, through
    :class:`CaptureSession` as a training loop of one's own drives it."""
    model = linear_only_llama()
    trained = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trained, lr=lr, eps=eps, weight_decay=0.01)
    session = None
    if store_dir is not None:
        settings = CaptureSettings(
            str(store_dir), curvature=False, store_texts=False, record_trajectory=True
        )
        session = CaptureSession(settings, model, SummedLoss(), optimizer=optimizer)
    for first in range(0, len(LOO_ROWS), LOO_BATCH):
        rows = [
            {"input_ids": r}
            for i, r in enumerate(LOO_ROWS[first : first + LOO_BATCH], start=first)
            if i != removed
        ]
        summed_loss(model, pad_rows(rows)).backward()
        if session is not None:
            session.step()
        optimizer.step()
        if session is not None:
            session.after_optimizer_step()
            session.finish_step()
        optimizer.zero_grad()
    if session is not None:
        session.end(optimizer)
    return model


def query_losses(model: nn.Module) -> Tensor:
    """``(M,)`` each query's summed token loss."""
    with torch.no_grad():
        return torch.stack([summed_loss(model, pad_rows([{"input_ids": r}])) for r in query_rows()])


def ranks(values: Tensor) -> Tensor:
    return values.argsort().argsort().double()


def test_scores_predict_leave_one_out_retraining(tmp_path: Path) -> None:
    """Removing an example and retraining from the same start changes each query's loss
    by what ``adamw_influence`` predicts: positive = the loss rises without it. With
    ``eps`` dominating Adam's denominator (so that holding the denominator fixed is
    nearly exact) and a small step: within 5% overall, same sign for at least 90% of
    the pairs, Spearman >= 0.95 per query."""
    lr, eps = 1e-3, 10.0
    model = train_plain(lr, eps, store_dir=tmp_path / "store")
    batch = pad_rows([{"input_ids": r} for r in query_rows()])
    queries = capture_store(model, [batch], tmp_path / "queries", curvature=False)
    scores = method_by_name("adamw_influence").score(StoreReader(tmp_path / "store"), queries)

    base = query_losses(model)
    loo = torch.stack([query_losses(train_plain(lr, eps, removed=z)) - base for z in range(12)])
    rows = pad_rows([{"input_ids": r} for r in LOO_ROWS])
    ids = content_hash(rows["input_ids"], rows["attention_mask"])
    got = scores_by_id(scores, ids, queries.load_all().example_ids).double()
    assert loo.abs().min() > 0
    assert rel_error(got, loo) < 0.05
    assert (got.sign() == loo.sign()).double().mean() >= 0.9
    for j in range(loo.shape[1]):
        spearman = torch.corrcoef(torch.stack([ranks(got[:, j]), ranks(loo[:, j])]))[0, 1]
        assert spearman >= 0.95, (j, float(spearman))

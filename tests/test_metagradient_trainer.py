"""A real transformers ``Trainer`` run, replayed by the metagradient from what it did.

The run (gradient accumulation, the default linear schedule, weight decay groups and
clipping at 1.0, ``num_items_in_batch`` normalization) is recorded with a collator that
keeps every micro-batch and a callback that keeps each step's learning rate; the replay
must end at the trainer's own final weights, and a trajectory that misstates the run is
refused.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from datasets import Dataset
from transformers import Trainer, TrainerCallback

from tda_plugins.capture import content_hash
from tda_plugins.methods.metagradient import loss_weight_derivatives
from tda_plugins.methods.training_run import (
    AdamWSettings,
    MicroBatch,
    TrainingStep,
    TrainingTrajectory,
)
from tests.models import tiny_causal_lm
from tests.trainers import RecordingCollator, token_rows, training_args

ACCUMULATION = 2
STEPS = 3


class StepRates(TrainerCallback):
    """The learning rate each optimizer step is taken with (the scheduler moves after it)."""

    def __init__(self) -> None:
        self.rates: list[float] = []

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.rates.append(float(kwargs["optimizer"].param_groups[0]["lr"]))


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    model = tiny_causal_lm("gpt2").train()
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    collator, rates = RecordingCollator(), StepRates()
    args = training_args(
        Path(tmp_path_factory.mktemp("run")),
        gradient_accumulation_steps=ACCUMULATION,
        max_steps=STEPS,
        weight_decay=0.1,
    )
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=Dataset.from_list([{"input_ids": r} for r in token_rows(16)]),
        data_collator=collator,
        callbacks=[rates],
    )
    trainer.train()
    assert args.max_grad_norm == 1.0 and len(rates.rates) == STEPS
    batches = [
        MicroBatch(content_hash(b["input_ids"], b["attention_mask"]), b)
        for b in collator.batches[: ACCUMULATION * STEPS]
    ]
    steps = [
        TrainingStep(batches[t * ACCUMULATION : (t + 1) * ACCUMULATION], rates.rates[t])
        for t in range(STEPS)
    ]
    return {
        "model": model,
        "start": start,
        "end": {n: p.detach().clone() for n, p in model.named_parameters()},
        "run": TrainingTrajectory(steps),
        "settings": AdamWSettings.from_optimizer(
            trainer.optimizer, model, max_grad_norm=args.max_grad_norm
        ),
        "queries": MicroBatch(
            torch.tensor([7]), {k: v[:1] for k, v in collator.batches[0].items()}
        ),
    }


def replay(recorded: dict[str, Any], run: TrainingTrajectory | None = None, **change: Any) -> None:
    """The metagradient of the recorded run (or of ``run``), checked against the
    trainer's final weights."""
    options = {
        "optimizer": recorded["settings"],
        "loss_convention": "window_mean",
        "initial_state": recorded["start"],
        "trained_state": recorded["end"],
        # transformers takes the loss in fp32: the fp64 replay's losses end 5e-8 of the
        # run's change in them away; the misstatements below, 1.5e-3 and more
        "replay_tolerance": 1e-5,
        **change,
    }
    loss_weight_derivatives(
        recorded["model"], run or recorded["run"], recorded["queries"], **options
    )


def test_the_replay_ends_at_the_trainers_weights(recorded: dict[str, Any]) -> None:
    decays = recorded["settings"].weight_decay
    decayed = {n for n, d in decays.items() if d > 0}
    assert decayed and all("bias" not in n and "ln_" not in n for n in decayed)
    assert len(decayed) < len(decays)
    replay(recorded)


def test_a_trajectory_that_misstates_the_run_is_refused(recorded: dict[str, Any]) -> None:
    decays = recorded["settings"].weight_decay
    shorter = TrainingTrajectory(list(recorded["run"].steps)[:-1])
    misstated: list[dict[str, Any]] = [
        {"loss_convention": "micro_batch_mean"},
        {"optimizer": AdamWSettings(weight_decay=decays, max_grad_norm=None)},
        {"optimizer": AdamWSettings(weight_decay=0.0, max_grad_norm=1.0)},
        {"run": shorter},
    ]
    for change in misstated:
        with pytest.raises(ValueError, match="does not reproduce the run"):
            replay(recorded, **change)

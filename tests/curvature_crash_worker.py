"""A HF Trainer capture that dies by SIGKILL: ``train(ROOT, POINT)`` runs in a worker
process that ``tests/test_curvature_crash.py`` starts from its zygote (and, without the
kill, in the test's own process to resume it).

``POINT``: ``save`` kills the process in ``on_save`` of step 4, from a callback listed
before the capture's (between the trainer's checkpoint and the capture's ``on_save``),
with statistics committed at checkpoints only; ``step`` kills it as step 5 begins (steps
0..4 committed, checkpoint-4 the latest), with statistics committed every step.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import torch
from datasets import Dataset
from transformers import Trainer, TrainerCallback

from tda_plugins.integrations.transformers import GradientCaptureCallback
from tests.models import tiny_causal_lm
from tests.trainers import pad_rows, training_args

STEPS = 6
#: point -> (event that kills, global_step it kills at, curvature_save_steps)
POINTS = {"save": ("on_save", 4, 0), "step": ("on_step_begin", 5, 1)}


class Kill(TrainerCallback):
    """SIGKILL (no cleanup of any kind) at ``event`` when ``state.global_step == step``."""

    def __init__(self, event: str, step: int):
        self.event, self.step = event, step

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._maybe("on_save", state.global_step)

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._maybe("on_step_begin", state.global_step)

    def _maybe(self, event: str, step: int) -> None:
        if event == self.event and step == self.step:
            os.kill(os.getpid(), signal.SIGKILL)


def rows() -> Dataset:
    """12 distinct rows of 8 tokens (no padding: every stored token row is a real one)."""
    gen = torch.Generator().manual_seed(0)
    return Dataset.from_list(
        [{"input_ids": torch.randint(2, 64, (8,), generator=gen).tolist()} for _ in range(12)]
    )


def train(root: Path, point: str, resume_from: Path | None = None) -> None:
    event, step, save_steps = POINTS[point]
    capture = GradientCaptureCallback(
        store_dir=str(root / "store"),
        layers="linear",
        curvature_head=True,
        keep_tokens=True,
        curvature_save_steps=save_steps,
    )
    callbacks: list[TrainerCallback] = [capture] if resume_from else [Kill(event, step), capture]
    args = training_args(root / "out", max_steps=STEPS, save_strategy="steps", save_steps=2)
    trainer = Trainer(
        model=tiny_causal_lm("llama", torch.float32),
        args=args,
        train_dataset=rows(),
        data_collator=pad_rows,
        callbacks=callbacks,
    )
    trainer.train(resume_from_checkpoint=None if resume_from is None else str(resume_from))

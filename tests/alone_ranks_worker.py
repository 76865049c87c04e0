"""Two launched ranks whose ``Trainer`` runs each alone: ``torchrun`` on a machine without
GPUs and ``use_cpu`` unset, where accelerate trains one process per rank (``parallel_mode``
``not_parallel``) with only a warning.

On every rank, one real ``Trainer`` per callback of this package (capture, influence
logging, data selection), ``use_cpu=False``, ``train()``; writes ``<callback>-<rank>.json``:
the refusal's message (``null`` if the run trained), the trainer's ``parallel_mode``, the
steps begun and whether the store exists.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from datasets import Dataset
from transformers import Trainer, TrainerCallback

from tda_plugins.integrations.transformers import (
    DataSelectionCallback,
    GradientCaptureCallback,
    InfluenceLoggingCallback,
    pad_examples,
)
from tda_plugins.session.capture import UnsupportedTrainingSetup
from tests.models import tiny_causal_lm
from tests.trainers import token_rows, training_args

EXAMPLES = [{"input_ids": r} for r in token_rows(4)]


class StepCounter(TrainerCallback):
    def __init__(self) -> None:
        self.begun = 0

    def on_step_begin(self, *args: Any, **kwargs: Any) -> None:
        self.begun += 1


def main(folder: Path) -> None:
    rank = dist.get_rank()
    folder.mkdir(parents=True, exist_ok=True)
    store = folder / f"store-{rank}"
    callbacks = {
        "capture": GradientCaptureCallback(store_dir=str(store)),
        "influence": InfluenceLoggingCallback(EXAMPLES[:1]),
        "selection": DataSelectionCallback(EXAMPLES[:1]),
    }
    for name, callback in callbacks.items():
        steps = StepCounter()
        args = training_args(folder / f"out-{rank}", use_cpu=False)
        trainer = Trainer(
            model=tiny_causal_lm("llama", torch.float32),
            args=args,
            train_dataset=Dataset.from_list(EXAMPLES),
            data_collator=pad_examples,
            callbacks=[steps, callback],
        )
        try:
            trainer.train()
            refusal = None
        except UnsupportedTrainingSetup as refused:
            refusal = str(refused)
        outcome = {
            "refusal": refusal,
            "parallel_mode": args.parallel_mode.value,
            "steps": steps.begun,
            "store": store.exists(),
        }
        (folder / f"{name}-{rank}.json").write_text(json.dumps(outcome))

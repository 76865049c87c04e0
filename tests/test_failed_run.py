"""A run that stops with an error gets no ``on_train_end``: its callbacks stay hooked on the
model. A retry in the same process, on the same model, with new callbacks, unhooks them
first (with a warning), so that nothing of the retry is recorded by them into the failed
run's store, and the model ends the retry with no hook of either run."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from datasets import Dataset
from torch import nn
from transformers import Trainer, TrainerCallback

from tda_plugins.integrations.transformers import (
    DataSelectionCallback,
    GradientCaptureCallback,
    InfluenceLoggingCallback,
)
from tda_plugins.store import StoreReader
from tests.models import tiny_causal_lm
from tests.selection_helpers import PINNED
from tests.trainers import pad_rows, token_rows, training_args

STEPS = 4
ROWS = [{"input_ids": r} for r in token_rows(2 * STEPS)]
QUERIES = [{"input_ids": r} for r in token_rows(2, seed=9)]


class _FailAtStep(TrainerCallback):
    """Raises at the end of optimizer step ``step`` (1-based), as a crash mid-run would."""

    def __init__(self, step: int):
        self.step = step

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step == self.step:
            raise RuntimeError("the run stopped here")


def hooks(model: nn.Module) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


def run(model: nn.Module, folder: Path, *extra: TrainerCallback) -> GradientCaptureCallback:
    capture = GradientCaptureCallback(store_dir=str(folder / "store"))
    callbacks = [
        capture,
        InfluenceLoggingCallback(QUERIES, report_dir=str(folder / "report")),
        DataSelectionCallback(QUERIES, layers="all", **PINNED),
        *extra,
    ]
    trainer = Trainer(
        model=model,
        args=training_args(folder / "out", max_steps=STEPS),
        train_dataset=Dataset.from_list(ROWS),
        data_collator=pad_rows,
        callbacks=callbacks,
    )
    trainer.train()
    return capture


def files(folder: Path) -> dict[str, int]:
    return {str(p.relative_to(folder)): p.stat().st_size for p in folder.rglob("*") if p.is_file()}


def test_a_retry_after_a_failed_run_unhooks_the_failed_runs_callbacks(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    model = tiny_causal_lm("llama", torch.float32)
    plain = hooks(model)
    failed = GradientCaptureCallback(store_dir=str(tmp_path / "failed" / "store"))
    with pytest.raises(RuntimeError, match="the run stopped here"):
        trainer = Trainer(
            model=model,
            args=training_args(tmp_path / "failed" / "out", max_steps=STEPS),
            train_dataset=Dataset.from_list(ROWS),
            data_collator=pad_rows,
            callbacks=[failed, InfluenceLoggingCallback(QUERIES), _FailAtStep(2)],
        )
        trainer.train()
    assert failed.session is not None and hooks(model) > plain  # left hooked
    failed.session.store.flush()  # its background writes of the steps before the error
    before = files(tmp_path / "failed" / "store")

    with caplog.at_level(logging.WARNING, logger="tda_plugins"):
        retried = run(model, tmp_path / "retry")
    assert "2 callback(s) of an earlier run on this model were still hooked" in caplog.text
    assert files(tmp_path / "failed" / "store") == before  # nothing of the retry there
    assert hooks(model) == plain
    stored = StoreReader(tmp_path / "retry" / "store").load_all()
    assert sorted(set(stored.steps.tolist())) == list(range(STEPS))
    assert retried.session is None
    assert not model.__dict__["_tda_plugins_runs"]  # a finished run's callbacks are freed
    torch.save(model, tmp_path / "model.pt")  # nothing of the runs left to pickle
    # the failed run's store holds the steps it committed, and reads
    reader = StoreReader(tmp_path / "failed" / "store")
    assert sorted(set(reader.load_all().steps.tolist())) == [0, 1]

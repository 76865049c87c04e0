"""The end of a training run (K-FAC statistics, Adam moments, weights digest) shows
progress when it is large; here the threshold is lowered to a tiny run's size."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from datasets import Dataset
from transformers import Trainer

from tda_plugins import GradientCaptureCallback
from tda_plugins.utils import progress
from tests.models import tiny_causal_lm
from tests.trainers import pad_rows, token_rows, training_args

WORK = ("writing K-FAC statistics", "saving the Adam moments", "weights digest")


@pytest.mark.parametrize("shown_from", [0, 2**40])
def test_end_of_training_work_shows_progress_when_large(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    shown_from: int,
) -> None:
    monkeypatch.setattr(progress, "SHOWN_FROM_BYTES", shown_from)
    trainer = Trainer(
        model=tiny_causal_lm("llama", torch.float32),
        args=training_args(tmp_path / "out", max_steps=2),
        train_dataset=Dataset.from_list([{"input_ids": r} for r in token_rows(4)]),
        data_collator=pad_rows,
        callbacks=[GradientCaptureCallback(store_dir=str(tmp_path / "store"), layers="linear")],
    )
    trainer.train()
    err = capsys.readouterr().err
    for what in WORK:
        assert (f"tda-plugins: {what}" in err) is (shown_from == 0), what

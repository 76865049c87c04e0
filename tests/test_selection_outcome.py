"""The step's decision as it is logged (``data_selection/outcome.py``): the scores
``StepSelection`` records are those the rule read; and the settings refuse options the
rule or the score never reads."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from datasets import Dataset

from tda_plugins.data_selection.outcome import decide
from tda_plugins.data_selection.parallel import Ranks
from tda_plugins.data_selection.rules import rule_by_name
from tda_plugins.data_selection.scoring import UnitScores
from tda_plugins.data_selection.settings import SelectionSettings


def test_per_layer_cosine_scores_are_logged_as_the_rule_used_them() -> None:
    """``granularity="per_layer"`` with ``score="cosine"``: each layer's rule reads the
    example's cosine with that layer's target, and the logged score (``StepSelection.
    scores``, ``selection/mean_score``) is their sum; it used to be the summed raw dots."""
    generator = torch.Generator().manual_seed(0)
    dots = torch.randn(6, 3, generator=generator, dtype=torch.float64) * 10
    squares = torch.rand(6, 3, generator=generator, dtype=torch.float64) * 50 + 1
    target_squares = torch.rand(3, generator=generator, dtype=torch.float64) * 20 + 1
    decision = decide(
        0,
        ids=torch.arange(6),
        counts=torch.full((6,), 4.0),
        scales=torch.full((6,), 24.0),
        roundings=torch.zeros(6),
        scores=UnitScores(dots, squares, target_squares),
        rule=rule_by_name("bottom_fraction", fraction=0.5),
        per_layer=True,
        ranks=Ranks(),
    )
    cosines = dots / (squares.sqrt() * target_squares.sqrt())
    torch.testing.assert_close(decision.outcome.scores.double(), cosines.sum(1), rtol=1e-6, atol=0)


@pytest.mark.parametrize(
    ("options", "unread"),
    [
        ({"fraction": 0.5}, "['fraction']"),  # step_cosine (the default rule) reads margin
        ({"rule": "bottom_fraction", "margin": 0.2, "seed": 3}, "['seed', 'margin']"),
        ({"rule": "threshold", "fraction": 0.5}, "['fraction']"),
        ({"rule": "random", "score": "loss", "refresh_every": 2}, "['refresh_every']"),
        ({"rule": "random", "score": "loss", "target_examples": 1}, "['target_examples']"),
    ],
)
def test_options_the_rule_or_score_never_reads_are_refused(
    options: dict[str, object], unread: str
) -> None:
    """They used to be accepted and dropped without a word (a selection audit)."""
    with pytest.raises(ValueError, match=re.escape(f"{unread} set, but rule")):
        SelectionSettings(**options)  # type: ignore[arg-type]


def test_a_target_given_with_the_loss_score_is_never_run(tmp_path: Path) -> None:
    """``score="loss"`` reads no target: a pool given anyway used to cost a forward and a
    backward at every refresh; the session builds none."""
    from transformers import Trainer

    from tda_plugins.integrations.transformers import DataSelectionCallback
    from tests.models import tiny_causal_lm
    from tests.trainers import pad_rows, token_rows, training_args

    selection = DataSelectionCallback(
        target=[{"input_ids": r} for r in token_rows(2, seed=7)],
        rule="bottom_fraction",
        score="loss",
        fraction=0.5,
        layers="all",
    )
    Trainer(
        model=tiny_causal_lm("llama", torch.float32),
        args=training_args(tmp_path / "out", max_steps=2, per_device_train_batch_size=4),
        train_dataset=Dataset.from_list([{"input_ids": r} for r in token_rows(8)]),
        data_collator=pad_rows,
        callbacks=[selection],
    ).train()
    assert len(selection.history) == 2
    assert selection.session is not None and selection.session.pool is None

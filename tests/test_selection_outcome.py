"""The step's decision as it is logged (``data_selection/outcome.py``): the scores
``StepSelection`` records are those the rule read."""

from __future__ import annotations

import torch

from tda_plugins.data_selection.outcome import decide
from tda_plugins.data_selection.parallel import Ranks
from tda_plugins.data_selection.rules import rule_by_name
from tda_plugins.data_selection.scoring import UnitScores


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

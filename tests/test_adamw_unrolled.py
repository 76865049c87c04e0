"""``adamw_unrolled``: AdamW-influence carried through the later steps with each step's
empirical Fisher, read from the store alone.

1. Inside real ``Trainer`` runs (full fine-tuning and LoRA, gradient accumulation 1 and
   2, with and without clipping), the scores equal a brute-force derivative of each
   query's loss at the final weights with respect to each example's loss weight through
   a ``torch.func`` replay of the run in which every step's gradient moves with the
   replayed weights by ``curvature`` times the empirical Fisher of the step's examples
   (``tests.trajectory_oracle``, ``curvature``), with Adam's denominators held fixed.
2. ``curvature=0`` is ``adamw_influence``; a negative factor is refused.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tda_plugins.methods import method_by_name
from tests.stores import rel_error, scores_by_id
from tests.test_adamw_influence import CASES, capture_queries, replay_run, train

#: A Fisher factor large enough that the curvature moves the scores well past rounding.
CURVATURE = 50.0


@pytest.mark.parametrize("case", CASES)
def test_scores_equal_the_derivative_of_a_replay_with_fisher_curvature(
    tmp_path: Path, case: str
) -> None:
    """``adamw_unrolled`` = ``-d L_q(theta_T) / d w_z`` of the replay whose steps carry
    the empirical Fisher (relative 1e-5: scores and adjoints are fp32), and differs from
    ``adamw_influence`` by far more than that (the curvature term is exercised)."""
    kind, accumulation, clip = CASES[case]
    run = train(tmp_path, kind, gradient_accumulation_steps=accumulation, max_grad_norm=clip)
    queries = capture_queries(run, tmp_path / "queries")
    unrolled = method_by_name("adamw_unrolled", curvature=CURVATURE).score(run.store, queries)
    plain = method_by_name("adamw_influence").score(run.store, queries)

    _, occurrences, derivatives = replay_run(run, accumulation, clip, curvature=CURVATURE)
    ids = torch.tensor([i for _, i in occurrences])
    query_ids = queries.load_all().example_ids
    got = scores_by_id(unrolled, ids, query_ids)
    expected = -derivatives
    assert rel_error(got, expected) < 1e-5
    assert rel_error(scores_by_id(plain, ids, query_ids), expected) > 1e-2


def test_zero_curvature_is_adamw_influence(tmp_path: Path) -> None:
    """With no curvature the reverse pass is AdamW-influence's, to fp32 rounding."""
    run = train(tmp_path, "full", gradient_accumulation_steps=2, max_grad_norm=1.0)
    queries = capture_queries(run, tmp_path / "queries")
    unrolled = method_by_name("adamw_unrolled", curvature=0.0).score(run.store, queries)
    plain = method_by_name("adamw_influence").score(run.store, queries)
    assert torch.equal(unrolled.train_ids, plain.train_ids)
    assert rel_error(unrolled.values.double(), plain.values.double()) < 1e-6


def test_a_negative_curvature_is_refused() -> None:
    with pytest.raises(ValueError, match="curvature must be >= 0"):
        method_by_name("adamw_unrolled", curvature=-1.0)

"""The measure of the fidelity benchmark: per validation block, the Spearman correlation
of an attributor's scores with the ground truth, and its mean over validation blocks
with a percentile bootstrap 95% interval (validation blocks resampled, paired when two
attributors are compared).

* **Leave-one-out**: the removed blocks' scores against their effects
  ``loss_v(without j) - loss_v(full)``.
* **Linear datamodeling score (LDS)**: over the subset runs, the sum of the scores of each
  run's blocks against minus the validation loss of the run trained on them.

Sign convention: a positive score predicts that removing the block raises the validation
loss (it helped), so a faithful method correlates positively on both.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from attribution import spearman
from fidelity_truth import LeaveOneOut, SubsetRuns
from torch import Tensor


@dataclass(frozen=True)
class Fidelity:
    """One attributor's agreement with leave-one-out.

    Attributes:
        name: the attributor (and its variant).
        per_query: ``(M,)`` fp64 Spearman of each validation block; NaN for a block the
            attributor did not score (the mean and the intervals leave it out; a paired
            interval keeps the blocks both scored).
        resamples: bootstrap resamples of the validation blocks.
        seconds: wall seconds the attributor took (NaN where not timed).
    """

    name: str
    per_query: Tensor
    resamples: int
    seconds: float = float("nan")

    @property
    def mean(self) -> float:
        """Mean Spearman over the validation blocks scored."""
        return float(self.per_query.nanmean())

    @property
    def scored(self) -> int:
        """Validation blocks scored (the others' Spearman is NaN)."""
        return int(self.per_query.isfinite().sum())

    def interval(self, minus: Fidelity | None = None) -> tuple[float, float]:
        """Percentile bootstrap 95% interval of the mean, or of the mean difference to
        ``minus`` (paired: the same validation blocks resampled for both)."""
        values = self.per_query if minus is None else self.per_query - minus.per_query
        values = values[values.isfinite()]
        gen = torch.Generator().manual_seed(0)
        draws = torch.randint(0, values.shape[0], (self.resamples, values.shape[0]), generator=gen)
        means = values[draws].mean(dim=1)
        low, high = torch.quantile(means, torch.tensor([0.025, 0.975], dtype=means.dtype))
        return float(low), float(high)


def fidelity(
    name: str, scores: Tensor, effects: Tensor, resamples: int, seconds: float = float("nan")
) -> Fidelity:
    """Spearman per validation block of ``(M, K)`` scores against ``(M, K)`` effects; NaN
    for a block whose scores are not all finite (one the attributor left out)."""
    if scores.shape != effects.shape:
        raise ValueError(
            f"{name} gave scores of shape {tuple(scores.shape)}, expected "
            f"{tuple(effects.shape)} (validation blocks x removed blocks or subsets)"
        )
    scored = scores.isfinite().all(dim=1)
    if not scored.any():
        raise ValueError(f"{name} scored no validation block (every row has a NaN)")
    rho = torch.full((scores.shape[0],), float("nan"), dtype=torch.float64)
    rho[scored] = spearman(scores[scored].T.double(), effects[scored].T.double())
    return Fidelity(name, rho, resamples, seconds)


@dataclass(frozen=True)
class GroundTruth:
    """What an attributor's ``(M, N)`` scores are measured against.

    Attributes:
        loo: the leave-one-out runs.
        removed: ``(R,)`` the training blocks they left out.
        subsets: the LDS runs.
        resamples: bootstrap resamples.
    """

    loo: LeaveOneOut
    removed: Tensor
    subsets: SubsetRuns
    resamples: int

    def leave_one_out(self, name: str, scores: Tensor, seconds: float = float("nan")) -> Fidelity:
        """The removed blocks' scores against their leave-one-out effects."""
        self._check(name, scores)
        return fidelity(name, scores[:, self.removed], self.loo.effects, self.resamples, seconds)

    def lds(self, name: str, scores: Tensor) -> Fidelity:
        """Per validation block, the Spearman over the subsets of the summed scores of each
        subset's blocks against minus the loss of the run trained on it."""
        self._check(name, scores)
        predicted = scores.double() @ self.subsets.masks.double().T
        return fidelity(name, predicted, -self.subsets.losses.T, self.resamples)

    def _check(self, name: str, scores: Tensor) -> None:
        expected = (self.loo.full.shape[0], self.subsets.masks.shape[1])
        if tuple(scores.shape) != expected:
            raise ValueError(
                f"{name} returned scores of shape {tuple(scores.shape)}, expected {expected} "
                "(validation blocks x training blocks)"
            )

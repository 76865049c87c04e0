"""Preconditioners (identity, K-FAC, EK-FAC) and the inline curvature statistics."""

from tda_plugins.precondition.base import PRECONDITIONERS, Identity, Preconditioner
from tda_plugins.precondition.kfac import EKFAC, KFAC
from tda_plugins.precondition.statistics import (
    CurvatureAccumulator,
    KroneckerFactors,
    load_curvature,
)

__all__ = [
    "EKFAC",
    "KFAC",
    "PRECONDITIONERS",
    "CurvatureAccumulator",
    "Identity",
    "KroneckerFactors",
    "Preconditioner",
    "load_curvature",
]

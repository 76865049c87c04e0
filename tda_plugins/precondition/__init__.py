"""Preconditioners (identity, K-FAC, EK-FAC) and the inline curvature statistics."""

from tda_plugins.precondition.base import PRECONDITIONERS, Identity, Preconditioner
from tda_plugins.precondition.ekfac import EKFACPreconditioner
from tda_plugins.precondition.forms import FactorSpec
from tda_plugins.precondition.kfac import KFACPreconditioner
from tda_plugins.precondition.plan import (
    CapturePlan,
    CurvatureBudgetError,
    PlanInputs,
    plan_capture,
    require_within_budget,
)
from tda_plugins.precondition.snapshots import KroneckerFactors
from tda_plugins.precondition.statistics import CurvatureAccumulator, load_curvature

__all__ = [
    "PRECONDITIONERS",
    "CapturePlan",
    "CurvatureAccumulator",
    "CurvatureBudgetError",
    "EKFACPreconditioner",
    "FactorSpec",
    "Identity",
    "KFACPreconditioner",
    "KroneckerFactors",
    "PlanInputs",
    "Preconditioner",
    "load_curvature",
    "plan_capture",
    "require_within_budget",
]

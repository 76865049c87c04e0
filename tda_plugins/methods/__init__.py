"""Attribution methods behind one interface, registered by name; and the exact
metagradient (``metagradient.py``; ``tda_plugins.metagradient``), which replays the
training run instead of reading a store."""

from tda_plugins.methods import adamw_influence, curvature, gradient, less
from tda_plugins.methods.attribute import attribute
from tda_plugins.methods.base import METHODS, AttributionMethod, method_by_name, register_method
from tda_plugins.methods.gradient import Checkpoint
from tda_plugins.methods.metagradient import WeightDerivatives, loss_weight_derivatives
from tda_plugins.methods.scores import Scores
from tda_plugins.methods.training_run import (
    AdamWSettings,
    LossConvention,
    MicroBatch,
    TrainingStep,
    TrainingTrajectory,
)

__all__ = [
    "METHODS",
    "AdamWSettings",
    "AttributionMethod",
    "Checkpoint",
    "LossConvention",
    "MicroBatch",
    "Scores",
    "TrainingStep",
    "TrainingTrajectory",
    "WeightDerivatives",
    "adamw_influence",
    "attribute",
    "curvature",
    "gradient",
    "less",
    "loss_weight_derivatives",
    "method_by_name",
    "register_method",
]

"""Attribution methods behind one interface, registered by name."""

from tda_plugins.methods import adamw_influence, curvature, gradient, less
from tda_plugins.methods.attribute import attribute
from tda_plugins.methods.base import METHODS, AttributionMethod, method_by_name, register_method
from tda_plugins.methods.gradient import Checkpoint
from tda_plugins.methods.scores import Scores

__all__ = [
    "METHODS",
    "AttributionMethod",
    "Checkpoint",
    "Scores",
    "adamw_influence",
    "attribute",
    "curvature",
    "gradient",
    "less",
    "method_by_name",
    "register_method",
]

"""Online data selection: drop the examples that hurt a target, exactly, from ``.grad``."""

from tda_plugins.data_selection.outcome import StepSelection
from tda_plugins.data_selection.rules import RULES, DropRule, rule_by_name
from tda_plugins.data_selection.selector import DataSelector
from tda_plugins.data_selection.session import SelectionError, SelectionSession
from tda_plugins.data_selection.settings import SelectionSettings

__all__ = [
    "RULES",
    "DataSelector",
    "DropRule",
    "SelectionError",
    "SelectionSession",
    "SelectionSettings",
    "StepSelection",
    "rule_by_name",
]

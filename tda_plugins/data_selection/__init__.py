"""Online data selection: drop the examples that hurt a target, exactly, from ``.grad``."""

from tda_plugins.data_selection.rules import RULES, DropRule, rule_by_name
from tda_plugins.data_selection.selector import DataSelector, StepSelection

__all__ = ["RULES", "DataSelector", "DropRule", "StepSelection", "rule_by_name"]

"""Where the transformers callbacks on one model find each other's outcomes.

A ``TrainerCallback`` sees the trainer's events and the model, never the other callbacks.
``DataSelectionCallback`` edits ``.grad``, which the live influence log must follow: an
example the selection dropped did not train, so it must not be credited with the step's
influence. The selection therefore posts its step outcomes on the model it selects for,
and the influence callback on the same model reads them after the step (``on_step_end``,
after every callback's ``on_pre_optimizer_step``, whichever of the two runs first).
"""

from __future__ import annotations

from torch import nn

from tda_plugins.data_selection.outcome import StepSelection

#: The model attribute holding its running selection's outcomes (a plain attribute, not
#: a submodule, parameter or buffer: nothing of it is saved with the weights).
_SELECTION = "_tda_plugins_selection_history"


def post_selection(model: nn.Module, history: list[StepSelection]) -> None:
    """Make ``history`` (a running selection's list of outcomes, appended to at every
    step) the one the other callbacks on ``model`` read."""
    model.__dict__[_SELECTION] = history


def withdraw_selection(model: nn.Module, history: list[StepSelection]) -> None:
    """The selection that posted ``history`` on ``model`` has ended."""
    if model.__dict__.get(_SELECTION) is history:
        del model.__dict__[_SELECTION]


def latest_selection(model: nn.Module) -> StepSelection | None:
    """The latest step outcome of the selection running on ``model`` (``None``: none)."""
    history: list[StepSelection] = model.__dict__.get(_SELECTION, [])
    return history[-1] if history else None

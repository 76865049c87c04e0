"""Where the transformers callbacks on one model find each other's outcomes, and the
runs that hooked it.

A ``TrainerCallback`` sees the trainer's events and the model, never the other callbacks.
``DataSelectionCallback`` edits ``.grad``, which the live influence log must follow: an
example the selection dropped did not train, so it must not be credited with the step's
influence. The selection therefore posts its step outcomes on the model it selects for,
and the influence callback on the same model reads them after the step (``on_step_end``,
after every callback's ``on_pre_optimizer_step``, whichever of the two runs first).
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable

from torch import nn

from tda_plugins.data_selection.outcome import StepSelection

#: The model attribute holding its running selection's outcomes (a plain attribute, not
#: a submodule, parameter or buffer: nothing of it is saved with the weights).
_SELECTION = "_tda_plugins_selection_history"
#: The model attribute listing the callbacks that hooked it: (the run's ``TrainerState``,
#: weakly; how to unhook the callback without finishing, True if it was still hooked).
_RUNS = "_tda_plugins_runs"

logger = logging.getLogger("tda_plugins")


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


class _Runs(list):
    """The list under :data:`_RUNS`: it holds weak references and callbacks, which are no
    part of the model, so a pickled model (``torch.save(model)``, ``copy.deepcopy``)
    carries an empty one."""

    def __reduce__(self) -> tuple[type, tuple[()]]:
        return (_Runs, ())


def enrol(model: nn.Module, run: object, abort: Callable[[], bool]) -> None:
    """A callback of the run whose ``TrainerState`` is ``run`` has hooked ``model``;
    ``abort`` unhooks it without finishing (True if it was still hooked)."""
    model.__dict__.setdefault(_RUNS, _Runs()).append((weakref.ref(run), abort))


def withdraw(model: nn.Module | None, abort: Callable[[], bool]) -> None:
    """The callback whose ``abort`` this is has ended its run normally: ``model`` keeps no
    reference to it (its queries, history and session are freed with it)."""
    if model is not None and _RUNS in model.__dict__:
        model.__dict__[_RUNS] = _Runs(e for e in model.__dict__[_RUNS] if e[1] != abort)


def release_stale(model: nn.Module, run: object) -> None:
    """Unhook the callbacks of every other run still on ``model``, before ``run`` hooks it.

    A run that stops with an error gets no ``on_train_end`` (the trainer calls no event
    then): its callbacks stay hooked, their stores keep the writer lock and thread, and a
    new run on the same model in the same process (a retry) would be recorded by them too,
    into the old store. ``trainer.train()`` makes a new ``TrainerState`` per run, so the
    callbacks enrolled under another state are that earlier run's."""
    entries = model.__dict__.get(_RUNS, [])
    model.__dict__[_RUNS] = _Runs((ref, abort) for ref, abort in entries if ref() is run)
    unhooked = sum(bool(abort()) for ref, abort in entries if ref() is not run)
    if unhooked:
        logger.warning(
            "tda-plugins: %d callback(s) of an earlier run on this model were still hooked "
            "(it stopped with an error): unhooked them, and their stores keep the steps they "
            "committed",
            unhooked,
        )

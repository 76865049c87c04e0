"""EK-FAC made to score through each of its routes, for the tests that hold every route
to a dense reference.

By default scoring keeps the training gradients that the eigenvalue correction rotated
into the basis (:data:`~tda_plugins.precondition.ekfac.KEPT_BYTES`) and scores them as
they are; without that memory it reads the store again, and either rotates each
preconditioned query back or, where it costs less, rotates the training chunks into the
basis.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any
from unittest import mock

from tda_plugins.precondition import EKFACPreconditioner

_KEPT_BYTES = "tda_plugins.precondition.ekfac.KEPT_BYTES"


def kept_bytes(limit: int) -> Any:
    """EK-FAC keeping at most ``limit`` bytes of rotated training gradients per group."""
    return mock.patch(_KEPT_BYTES, limit)


@contextlib.contextmanager
def stored() -> Iterator[None]:
    """Nothing kept: every layer scored from the store read again."""
    with kept_bytes(0):
        yield


@contextlib.contextmanager
def prefer_the_eigenbasis() -> Iterator[None]:
    """Nothing kept, and every preconditioned query left in the basis (the training
    chunks read again are rotated into it instead)."""
    correct = EKFACPreconditioner._correct

    def correct_then_prefer(self: EKFACPreconditioner, *args: Any, **kwargs: Any) -> Any:
        kept = correct(self, *args, **kwargs)
        self._train_rotation = dict.fromkeys(self._train_rotation, 0.0)
        return kept

    with stored(), mock.patch.object(EKFACPreconditioner, "_correct", correct_then_prefer):
        yield

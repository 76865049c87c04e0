"""Preconditioners: strategies that turn a query gradient into ``(F + lambda I)^{-1} g_q``.

Each is registered under a name and declares what it needs from a store; methods ask
the strategy instead of branching on its name (the Kronfluence pattern).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from typing import TYPE_CHECKING, ClassVar, Protocol

import torch

from tda_plugins.grads.base import PerExampleGrad
from tda_plugins.store.reader import StoreChunk, StoreReader
from tda_plugins.utils.registry import Registry

if TYPE_CHECKING:
    from tda_plugins.parallel.ranks import Ranks

PRECONDITIONERS: Registry[Preconditioner] = Registry("preconditioner")
#: Class decorator: make a preconditioner available under a name.
register_preconditioner = PRECONDITIONERS.register


class TrainingChunks(Protocol):
    """The training examples one scoring pass reads: ``store`` (the whole store, of which
    this rank reads a part) in chunks of at most ``chunk`` examples, on ``device``."""

    store: StoreReader
    chunk: int
    device: torch.device

    @property
    def examples(self) -> int:
        """How many examples this rank's chunks hold."""
        ...

    def chunks(self, layers: list[str]) -> Iterator[StoreChunk]:
        """This rank's chunks of the gradients of ``layers``, in store order."""
        ...


class Preconditioner(ABC):
    """Applies an (approximate, damped) inverse curvature to query gradients.

    Damping: ``lambda = damping * mean eigenvalue`` of the matrix it damps (relative, so
    the result does not depend on the loss scale); ``damping`` is set per instance.
    """

    name: ClassVar[str]
    #: Needs the inline K-FAC statistics saved in the store.
    needs_curvature: ClassVar[bool] = False
    #: Returns dense ``(B2, D)`` queries whatever their input form (an elementwise step
    #: breaks the factor structure), so scoring takes the queries in groups that fit; a
    #: fit may set it for the store it fitted (K-FAC's tied weights).
    dense_queries: bool = False

    def __init__(self, damping: float = 0.1):
        if damping <= 0:
            raise ValueError(
                f"damping must be > 0 (relative to the mean eigenvalue), got {damping}"
            )
        self.damping = damping
        #: Groups of layers (model order) that are uses of one tied weight, set by the fit.
        #: Such a weight's per-example gradient is the sum of its uses' (one layout), so
        #: its query side is preconditioned once, from the sum of its uses' query
        #: gradients, and that one side is scored against each use's training gradients
        #: (their dots add up to the dot with the summed training gradient).
        self.tied_units: list[tuple[str, ...]] = []

    @abstractmethod
    def fit(
        self, store: StoreReader, progress: bool = False, *, ranks: Ranks | None = None
    ) -> None:
        """Prepare from the store (factors, eigendecompositions; fp64), the work shared by
        ``ranks`` (a collective when they are several) and the results on their device
        (default: one process, on the CPU)."""

    @abstractmethod
    def __call__(self, layer: str, query: PerExampleGrad) -> PerExampleGrad:
        """Preconditioned ``(B2, D)`` queries of one layer (for a use of a tied weight,
        ``query`` is the sum of all its uses' query gradients: :attr:`tied_units`)."""

    def train_side(self, layer: str, grads: PerExampleGrad) -> PerExampleGrad:
        """The training gradients in the basis the last preconditioned queries of
        ``layer`` are in (an orthogonal change of basis keeps every dot product; default:
        the gradients as they are)."""
        return grads

    def fit_for_scoring(
        self, store: StoreReader, progress: bool = False, *, ranks: Ranks | None = None
    ) -> None:
        """The part of :meth:`fit` that comes before scoring starts, where the rest is done
        a layer group at a time by :meth:`training_chunks` (default: all of :meth:`fit`)."""
        self.fit(store, progress, ranks=ranks)

    def split_groups(self, groups: list[list[str]], store: StoreReader) -> list[list[str]]:
        """The layer groups that scoring takes one at a time (each one pass over the
        store), from those its memory budget allows (default: unchanged); the layers of
        a tied unit stay in one group."""
        return groups

    def training_chunks(
        self, source: TrainingChunks, layers: list[str], ranks: Ranks, progress: bool
    ) -> TrainingChunks:
        """The training side that the layer group ``layers`` is scored from, after
        :meth:`fit_for_scoring` (default: ``source``, the store as read). A collective
        when ``ranks`` are several: every rank calls it for every group, in order."""
        return source


@register_preconditioner("identity")
class Identity(Preconditioner):
    """``F = 0``: the query is used as it is (GradDot, GradCos, TracIn)."""

    def fit(
        self, store: StoreReader, progress: bool = False, *, ranks: Ranks | None = None
    ) -> None:
        return None

    def __call__(self, layer: str, query: PerExampleGrad) -> PerExampleGrad:
        return query

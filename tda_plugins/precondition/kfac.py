"""The K-FAC preconditioner from the store's inline Kronecker statistics.

Per layer, with its gradient ``G`` in its layout and the row and column factors of
:mod:`~tda_plugins.precondition.sides` (linear: ``S`` and ``A``):

    G_q -> (Row + l_R I)^{-1} G_q (Col + l_C I)^{-1},   l_X = damping * mean eig(X)

with ``mean eig(X) = trace(X) / n``, so K-FAC needs no eigendecomposition: each damped
dense factor is inverted through its Cholesky factorization, a diagonal one entrywise,
and a norm scale (no row factor) is ``(S + l I)^{-1} g``. A weight tied between an
embedding and a head is preconditioned by the inverse of the damped sum of its two uses'
Kronecker terms (:func:`~tda_plugins.precondition.sides.tied_inverse`), applied to the sum
of its two uses' query gradients (:meth:`Preconditioner.units`).

Factorizations are computed in fp64; the inverses are then kept in the gradients'
accumulation dtype (``StoreReader.values_dtype``), and the products with them
(:func:`~tda_plugins.grads.ops.rotated_grads`: of the per-token factors where that is
cheaper, ``Row g_t`` and ``Col a_t``) run in that dtype: the damping bounds their condition
number by ``1 + n / damping``. On the factorized route the preconditioned queries stay
per-token factors, so that scoring can build them block by block instead of holding
``(M, D)`` dense queries. Each layer's statistics are freed once factorized.
"""

from __future__ import annotations

from torch import Tensor

from tda_plugins.grads.base import PerExampleGrad
from tda_plugins.grads.ops import rotated_grads
from tda_plugins.parallel.ranks import LayerTensors, Ranks
from tda_plugins.precondition.base import Preconditioner, register_preconditioner
from tda_plugins.precondition.fitting import (
    ABSENT,
    SharedInput,
    check_shape,
    fit_layers,
    present,
)
from tda_plugins.precondition.sides import Basis, Sides, damped_inverse, divided, tied_inverse
from tda_plugins.store.reader import StoreReader


@register_preconditioner("kfac")
class KFACPreconditioner(Preconditioner):
    """Kronecker-factored damped inverse, each factor damped separately.

    After :meth:`fit`: ``inverses`` (layer -> ``(row inverse, column inverse)``, the row
    one ``(R, R)``, ``(R,)`` diagonal or empty for none; for a linear layer
    ``(S^-1, A^-1)``) and ``tied`` (each use of a tied weight -> the basis and scale of
    its unit's inverse).
    """

    needs_curvature = True

    def fit(
        self, store: StoreReader, progress: bool = False, *, ranks: Ranks | None = None
    ) -> None:
        # factorized in fp64, kept in the store's accumulation dtype (every product casts
        # them to it), so that fp32 gradients need no fp64 copy of every inverse
        dtype = store.values_dtype()
        invert_col = SharedInput(lambda c: damped_inverse(c, self.damping).to(dtype))

        def fit(sides: Sides) -> LayerTensors:
            row = ABSENT if sides.row is None else damped_inverse(sides.row, self.damping)
            return row.to(dtype), invert_col(sides.col)

        kind = f"kfac-damping{self.damping!r}"
        fitted = fit_layers(store, ranks or Ranks(), fit, kind, progress, "K-FAC damped inverses")
        self.inverses: dict[str, LayerTensors] = fitted.untied()
        self.tied: dict[str, tuple[Basis, Tensor]] = {}
        self.tied_units = list(dict.fromkeys(fitted.units.values()))
        for unit in self.tied_units:
            basis, scale = tied_inverse(fitted.tied_uses(unit), self.damping)
            basis = Basis(None, basis.col.to(dtype), basis.shape)
            self.tied.update(dict.fromkeys(unit, (basis, scale)))
        # the inverse of a sum of two Kronecker terms makes a tied weight's queries dense
        self.dense_queries = bool(self.tied_units)

    def __call__(self, layer: str, query: PerExampleGrad) -> PerExampleGrad:
        if layer in self.tied:
            basis, scale = self.tied[layer]
            check_shape(query, basis.shape, layer)
            return basis.back(divided(basis.into(query), scale))
        # row_inv G_q col_inv = row_inv^T G_q col_inv (both symmetric): the product of a
        # rotation, routed, in the gradients' accumulation dtype; per-token factors
        # (row_inv g_t, col_inv [a_t; 1]) where those are fewer, so that many queries need
        # not be dense
        row_inv, col_inv = self.inverses[layer]
        rows = 1 if row_inv.numel() == 0 else row_inv.shape[0]
        check_shape(query, (rows, col_inv.shape[0]), layer)
        return rotated_grads(query, present(row_inv), col_inv)

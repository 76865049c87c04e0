"""A layer's K-FAC statistics in its gradient's layout, and what K-FAC and EK-FAC build.

A layer's flattened per-example gradient is a matrix ``G`` of ``(R, C)`` (row-major, so
``vec(X G Y) = (X kron Y) vec(G)`` for symmetric ``Y``), and its curvature is the
Kronecker product of a row factor and a column factor (docs/design.md section 7.4):

| layer | ``G`` | row factor | column factor |
|---|---|---|---|
| linear (Conv1D, LoRA, factor-projected) | ``(N_o, N_i')`` | ``S`` | ``A`` |
| embedding | ``(V, d)`` | ``A``, diagonal (token counts / rows) | ``S`` |
| head use of a tied weight | ``(V, d)`` | ``S``, diagonal | ``A`` |
| norm scales | ``(1, D)`` | none | ``S`` (per-example ``g g^T`` / rows) |

A weight tied between an embedding and a linear head gets the *sum* of its two uses'
Kronecker terms, ``F = X_e kron Y_e + X_h kron Y_h`` (cross-use terms dropped, as K-FAC
drops cross-layer ones), with diagonal row factors ``X``: :func:`tied_inverse` inverts
the damped sum exactly in one basis, :func:`tied_eigenbasis` gives EK-FAC its basis.

Every function takes and returns fp64 tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from tda_plugins.grads.base import PerExampleGrad
from tda_plugins.grads.dense import DenseGrad
from tda_plugins.grads.ops import rotated
from tda_plugins.precondition.snapshots import KroneckerFactors


@dataclass
class Sides:
    """The row and column factors of one layer (means over token rows, fp64).

    Attributes:
        row: ``(R, R)`` dense, ``(R,)`` diagonal, or ``None`` (a vector gradient,
            ``R = 1``).
        col: ``(C, C)``.
    """

    row: Tensor | None
    col: Tensor

    @classmethod
    def of(cls, stats: KroneckerFactors) -> Sides:
        """The sides of stored statistics (their forms are their shapes, see
        :mod:`~tda_plugins.precondition.forms`)."""
        a, s = stats.a_cov, stats.g_cov
        if a.numel() == 0:
            return cls(None, s)
        if a.dim() == 1:
            return cls(a, s)
        return cls(s, a)

    @property
    def shape(self) -> tuple[int, int]:
        """``(R, C)`` of the layer's gradient."""
        return (1 if self.row is None else self.row.shape[0]), self.col.shape[0]


def damping_scale(mean: Tensor) -> Tensor:
    """The scale a damping is relative to: a factor's mean eigenvalue, or 1 where it is
    0. A zero factor belongs to a layer whose gradients are all zero (a LoRA ``A`` at
    initialization, where ``B = 0``), which scores 0 whatever its inverse; damped by
    ``damping * tiny`` its inverse would be ``1 / (damping * tiny)``, past the largest
    float, and ``0 * inf`` would make every score NaN."""
    return torch.where(mean > 0, mean, torch.ones_like(mean))


def mean_eigenvalue(x: Tensor) -> Tensor:
    """The mean eigenvalue of a dense symmetric or diagonal factor (``trace / n``), as
    :func:`damping_scale` takes it (1 for a zero factor)."""
    return damping_scale(x.diagonal().mean() if x.dim() == 2 else x.mean())


def damped(x: Tensor, damping: float) -> Tensor:
    """``X + damping * mean eig(X) I`` of a dense ``(n, n)`` or diagonal ``(n,)`` factor."""
    shift = damping * mean_eigenvalue(x)
    if x.dim() == 1:
        return x + shift
    return x + shift * torch.eye(x.shape[0], dtype=x.dtype, device=x.device)


def damped_inverse(x: Tensor, damping: float) -> Tensor:
    """``(X + l I)^{-1}``, ``l = damping * mean eig(X)``: of a diagonal factor entrywise,
    of a dense one through the Cholesky factor of the damped matrix (``~n^3 / 3`` against
    ``~9 n^3`` for ``eigh``; formed once rather than solved per query, as a product with
    it is faster than two triangular solves, and the damping bounds the condition number
    by ``1 + n / damping``, well inside fp64)."""
    shifted = damped(x, damping)
    if x.dim() == 1:
        return 1 / shifted
    return torch.cholesky_inverse(torch.linalg.cholesky(shifted))


@dataclass
class Basis:
    """A change of basis of a layer's gradient, ``G -> B_r^T G B_c``.

    Attributes:
        row: ``(R, R)`` ``B_r``, or ``None`` for the identity.
        col: ``(C, C)`` ``B_c``.
        shape: ``(R, C)``.
    """

    row: Tensor | None
    col: Tensor
    shape: tuple[int, int]

    def into(self, grads: PerExampleGrad) -> Tensor:
        """``(B, R C)`` gradients in the basis, ``B_r^T G B_c`` (a routed rotation)."""
        return rotated(grads, self.row, self.col)

    def back(self, values: Tensor) -> DenseGrad:
        """``(B, R C)`` coefficients back in the layer's layout, ``B_r X B_c^T``."""
        x = values.view(-1, *self.shape)
        col = self.col.to(x.dtype)
        out = x @ col.T if self.row is None else self.row.to(x.dtype) @ x @ col.T
        return DenseGrad(out.flatten(1))


def divided(values: Tensor, scale: Tensor) -> Tensor:
    """``(B, R C)`` coefficients divided entrywise by an ``(R, C)`` scale, in fp64, back
    in ``values``' dtype."""
    shaped = values.double().view(-1, *scale.shape)
    return (shaped / scale).flatten(1).to(values.dtype)


def _tied_pair(uses: list[Sides]) -> tuple[Tensor, Tensor, Tensor, Tensor, tuple[int, int]]:
    """``(X_1, Y_1, X_2, Y_2, shape)`` of the two uses of a tied weight: each with an
    ``(R,)`` diagonal row factor ``X`` and a ``(C, C)`` column factor ``Y``."""
    rows = [u.row for u in uses]
    if len(uses) != 2 or uses[0].shape != uses[1].shape:
        raise ValueError(
            f"a tied weight's K-FAC form needs exactly two uses of one shape (an embedding "
            f"and a head), got shapes {[u.shape for u in uses]}"
        )
    x_1, x_2 = rows
    if x_1 is None or x_2 is None or x_1.dim() != 1 or x_2.dim() != 1:
        raise ValueError("a tied weight's uses need diagonal vocabulary-side factors")
    return x_1, uses[0].col, x_2, uses[1].col, uses[0].shape


def tied_inverse(uses: list[Sides], damping: float) -> tuple[Basis, Tensor]:
    """K-FAC of a tied weight: ``(basis, scale)`` such that
    ``(X_1' kron Y_1' + X_2' kron Y_2')^{-1} vec(G) = vec(((G M) / scale) M^T)``, each
    factor damped on its own (``X' = X + l_X I``, as :func:`damped`).

    With ``Y_1' = L L^T`` (Cholesky) and ``L^{-1} Y_2' L^{-T} = Q diag(delta) Q^T``, the
    matrix ``M = L^{-T} Q`` diagonalizes both column factors (``M^T Y_1' M = I``,
    ``M^T Y_2' M = diag(delta)``), so each row ``v`` of the sum, ``x_1v Y_1' + x_2v Y_2'``,
    is inverted by ``M diag(1 / (x_1v + x_2v delta)) M^T``: ``scale = x_1' 1^T +
    x_2' delta^T``, ``(R, C)``. Cost: one Cholesky and one ``eigh`` of ``C x C``.
    """
    x_1, y_1, x_2, y_2, shape = _tied_pair(uses)
    lower = torch.linalg.cholesky(damped(y_1, damping))
    half = torch.linalg.solve_triangular(lower, damped(y_2, damping), upper=False)
    whitened = torch.linalg.solve_triangular(lower, half.T, upper=False)
    delta, q = torch.linalg.eigh((whitened + whitened.T) / 2)
    m = torch.linalg.solve_triangular(lower.T, q, upper=True)
    scale = damped(x_1, damping).unsqueeze(1) + damped(x_2, damping).unsqueeze(1) * delta
    return Basis(None, m, shape), scale


def tied_eigenbasis(uses: list[Sides]) -> Basis:
    """EK-FAC's basis for a tied weight: the identity on the vocabulary side (both uses'
    row factors are diagonal there) and the eigenbasis of the column side's marginal
    ``tr(X_1) Y_1 + tr(X_2) Y_2`` (the sum's partial trace over the rows: one orthonormal
    basis for every row, of which an untied embedding's ``S`` basis is the case
    ``X_2 = 0``)."""
    x_1, y_1, x_2, y_2, shape = _tied_pair(uses)
    return Basis(None, torch.linalg.eigh(x_1.sum() * y_1 + x_2.sum() * y_2)[1], shape)

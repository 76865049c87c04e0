"""A layer's parameters inside its per-example gradient: where each one sits, keeping only
some of them, and unit-normalizing what is kept (docs/design.md section 7.10).

Every layer's flattened gradient (``D`` values, in the layout its adapter documents) is a
row-major ``(D / width, width)`` matrix whose columns are split between the layer's
parameters (:class:`ParameterLayout`). Keeping some parameters keeps their columns of
every row: for the per-token factors of a linear layer with a bias, the weight alone is
the factors without the appended 1, and the bias alone the factors of a zero-width input
with the 1 (``sum_t g_it``), so both stay factorized; any other case takes the columns of
the materialized gradients.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import singledispatch
from typing import Any

import torch
from torch import Tensor

from tda_plugins.grads.base import PerExampleGrad
from tda_plugins.grads.dense import DenseGrad
from tda_plugins.grads.ops import safe_norms, sq_norms
from tda_plugins.grads.tokens import PerTokenGrad, TokenFactors


@dataclass(frozen=True)
class ParameterLayout:
    """Where each of one layer's parameters sits in its flattened per-example gradient.

    The ``(D,)`` gradient seen row-major as ``(D / width, width)`` holds parameter ``name``
    in columns ``[start, stop)`` of every row: a linear layer (``nn.Linear``, GPT-2
    ``Conv1D``, LoRA ``A``/``B``) is ``(N_o, N_i + 1)``, its weight in columns ``[0, N_i)``
    and its bias in column ``N_i``; a norm one row ``[weight, bias]``; an embedding
    ``(V, D_e)``, all weight; a frozen weight with a trainable bias one row of ``N_o``.

    Attributes:
        width: columns of a row.
        columns: ``(name, start, stop)`` per parameter, in column order, covering
            ``[0, width)`` without gaps.
    """

    width: int
    columns: tuple[tuple[str, int, int], ...]

    def __post_init__(self) -> None:
        edges = [0]
        for _, start, stop in self.columns:
            if start != edges[-1] or stop <= start:
                edges = []
                break
            edges.append(stop)
        if not edges or edges[-1] != self.width:
            raise ValueError(
                f"a parameter layout's columns must cover [0, {self.width}) in order without "
                f"gaps, got {self.columns}"
            )

    @property
    def names(self) -> tuple[str, ...]:
        """The parameters' names within the layer (``"weight"``, ``"bias"``), in order."""
        return tuple(name for name, _, _ in self.columns)

    def spans(self, names: frozenset[str]) -> list[tuple[int, int]]:
        """Column spans ``[start, stop)`` of the parameters ``names``, in column order."""
        return [(start, stop) for name, start, stop in self.columns if name in names]

    def to_json(self) -> dict[str, Any]:
        return {"width": self.width, "columns": [list(c) for c in self.columns]}

    @classmethod
    def from_json(cls, value: dict[str, Any]) -> ParameterLayout:
        columns = tuple((str(n), int(s), int(e)) for n, s, e in value["columns"])
        return cls(int(value["width"]), columns)


def keep_parameters(
    grads: PerExampleGrad, layout: ParameterLayout, names: frozenset[str]
) -> PerExampleGrad:
    """The per-example gradients of the parameters ``names`` of a layer laid out as
    ``layout``: its ``(B, D')`` gradients, ``D'`` the kept columns of every row, in the same
    order (so that both sides of a dot, kept alike, pair entry by entry). Exact: the
    entries are the ones ``grads`` holds, nothing is recomputed.

    Cost: none when every parameter is kept or the factors of a linear layer lose their
    bias or weight (the result is factors again); else the copy of the kept columns of
    the materialized gradients (``~ B D``)."""
    if grads.dim % layout.width:
        raise ValueError(
            f"a gradient of {grads.dim} entries cannot hold a layer laid out in rows of "
            f"{layout.width} (a projected capture has no parameter layout): score whole layers"
        )
    if names.issuperset(layout.names):
        return grads
    spans = layout.spans(names)
    if not spans:
        raise ValueError(f"no parameter of {layout.names} is kept: leave the whole layer out")
    return _kept_columns(grads, layout.width, spans)


@singledispatch
def _kept_columns(
    grads: PerExampleGrad, width: int, spans: list[tuple[int, int]]
) -> PerExampleGrad:
    """The columns ``spans`` of every row of the materialized ``(B, D / width, width)``."""
    rows = grads.materialize().reshape(grads.batch_size, -1, width)
    parts = [rows[:, :, start:stop] for start, stop in spans]
    kept = parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)
    return DenseGrad(kept.reshape(grads.batch_size, -1))


@_kept_columns.register
def _(grads: TokenFactors, width: int, spans: list[tuple[int, int]]) -> PerExampleGrad:
    # [dW_i  db_i] = sum_t g_it [a_it; 1]^T: without the 1 the factors give dW_i alone;
    # with a zero-width input and the 1 they give db_i = sum_t g_it (an (N_o, 1) matrix).
    n_i = width - 1
    if grads.bias and grads.in_dim == width:
        if spans == [(0, n_i)]:
            return TokenFactors(grads.a, grads.g)
        if spans == [(n_i, width)]:
            return TokenFactors(grads.a[..., :0], grads.g, bias=True)
    return _kept_columns.dispatch(PerExampleGrad)(grads, width, spans)


def unit_normalized(grads: PerExampleGrad) -> PerExampleGrad:
    """Each example's gradient divided by its norm (a zero gradient stays zero), in the
    same representation. Cost: the routed squared norms (docs/design.md section 3.2) and
    one scaling of the output factors (or values)."""
    inverse = 1 / safe_norms(sq_norms(grads))
    return _rows_scaled(grads, inverse)


@singledispatch
def _rows_scaled(grads: PerExampleGrad, weights: Tensor) -> PerExampleGrad:
    """Example ``i``'s gradient times ``weights[i]``."""
    raise TypeError(f"no per-example scaling for {type(grads).__name__}")


@_rows_scaled.register
def _(grads: PerTokenGrad, weights: Tensor) -> PerExampleGrad:
    return grads.scaled(weights.view(-1, 1, 1))  # the token factors' g: (B, T, N_o)


@_rows_scaled.register
def _(grads: DenseGrad, weights: Tensor) -> PerExampleGrad:
    return grads.scaled(weights.view(-1, 1))

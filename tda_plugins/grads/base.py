"""The interface every per-example gradient representation implements.

Three representations cover every layer type the engine captures (one module each):

* :class:`~tda_plugins.grads.tokens.TokenFactors` -- a weight ``W`` of shape ``(N_o, N_i)``
  whose per-example gradient is ``dW_i = sum_t g_it a_it^T`` (linear, Conv1D, LoRA,
  factor-projected layers).
* :class:`~tda_plugins.grads.embedding.EmbeddingFactors` -- an embedding table whose
  per-example gradient scatters ``g_it`` into the rows named by the token ids.
* :class:`~tda_plugins.grads.dense.DenseGrad` -- an already materialized per-example
  gradient (norm scales, dense projections).

Each representation answers the operations consumers need (materialize, squared norms,
train x query cross-Gram, per-token scores) with a cost estimate per route (multiply-adds,
the formulas of docs/design.md section 3); the functions in :mod:`tda_plugins.grads.ops`
let :func:`~tda_plugins.grads.routing.choose_route` pick the cheaper one. Products are
accumulated in fp32 (fp64 when the factors are fp64), whatever dtype the factors were
captured in.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Literal, Self

import torch
from torch import Tensor

from tda_plugins.grads.blocks import output_blocks, row_runs, summed
from tda_plugins.grads.routing import Route

#: How the output (row) side of a rotation acts: a dense ``(R, R)`` matrix, an ``(R,)``
#: diagonal, or none at all (the identity: no tensor).
RowForm = Literal["dense", "diagonal", "none"]


def row_form(u_out: Tensor | None) -> RowForm:
    """The :data:`RowForm` of a rotation's output side: ``None`` is the identity, a 1-D
    tensor a diagonal, a 2-D one a dense matrix."""
    if u_out is None:
        return "none"
    return "diagonal" if u_out.dim() == 1 else "dense"


def row_cost(rows: int, form: RowForm) -> int:
    """Multiply-adds of applying an output side of ``form`` to one length-``rows`` vector."""
    return {"dense": rows, "diagonal": 1, "none": 0}[form] * rows


def rotate_rows(x: Tensor, u_out: Tensor | None) -> Tensor:
    """``U_out^T`` applied to every length-``R`` vector along the last axis of ``x``:
    ``x @ U_out`` for a dense ``(R, R)`` ``u_out``, ``x * u_out`` for an ``(R,)``
    diagonal, ``x`` itself for ``None``; in ``x``'s dtype."""
    if u_out is None:
        return x
    u = u_out.to(x.dtype)
    return x @ u if u.dim() == 2 else x * u


def tensors_of(grads: PerExampleGrad) -> list[Tensor]:
    """The tensors a representation holds, in :meth:`PerExampleGrad.map_tensors` order."""
    found: list[Tensor] = []

    def note(t: Tensor) -> Tensor:
        found.append(t)
        return t

    grads.map_tensors(note)
    return found


def values_dtype(grads: PerExampleGrad) -> torch.dtype:
    """The accumulation dtype of a representation's materialized values: fp64 when any of
    its floating tensors is fp64, else fp32."""
    dtypes = {t.dtype for t in tensors_of(grads)}
    return torch.float64 if torch.float64 in dtypes else torch.float32


def empty_values(grads: PerExampleGrad, rows: int) -> Tensor:
    """An uninitialized ``(rows, D)`` tensor for materialized gradients of ``grads``' layer:
    its accumulation dtype (:func:`values_dtype`), on its device."""
    device = tensors_of(grads)[0].device
    return torch.empty(rows, grads.dim, dtype=values_dtype(grads), device=device)


class PerExampleGrad(ABC):
    """One layer's per-example gradients for a micro-batch of ``B`` examples."""

    @property
    @abstractmethod
    def batch_size(self) -> int:
        """``B``, the number of examples."""

    @property
    @abstractmethod
    def dim(self) -> int:
        """Length ``D`` of one flattened per-example gradient."""

    @abstractmethod
    def materialize(self) -> Tensor:
        """Per-example gradients as a ``(B, D)`` tensor in the accumulation dtype."""

    def materialize_into(self, out: Tensor) -> Tensor:
        """:meth:`materialize` written into ``out``, a ``(B, D)`` tensor of the
        accumulation dtype (no allocation of the result where the representation can
        write it in place); returns ``out``."""
        return out.copy_(self.materialize())

    @abstractmethod
    def merge_call(self, other: Self) -> Self:
        """Combine two calls of the same module in one forward (their gradients add)."""

    @abstractmethod
    def map_tensors(self, fn: Callable[[Tensor], Tensor]) -> Self:
        """Apply ``fn`` to every tensor (device moves, detaching)."""

    def select(self, rows: Tensor | slice) -> Self:
        """The examples ``rows`` (every field has the example axis first; a slice gives
        views)."""
        return self.map_tensors(lambda t: t[rows])

    @abstractmethod
    def weighted_sum(self, weights: Tensor) -> Tensor:
        """``sum_i w_i dW_i`` as a ``(D,)`` vector, for ``(B,)`` weights, without
        materializing per-example gradients (cost of one weight-gradient matmul)."""

    @abstractmethod
    def total(self) -> Tensor:
        """``sum_i dW_i`` over every example as a ``(D,)`` vector (one weight-gradient
        matmul for factors)."""

    def rows_sum(self, rows: Tensor) -> Tensor:
        """``sum_{i in rows} dW_i`` as a ``(D,)`` vector, for ``(n,)`` distinct example
        indices (cost of the rows' share of one weight-gradient matmul). Each
        contiguous run of rows is a view of the factors, so nothing is gathered."""
        return self.runs_sum(row_runs(rows))

    def runs_sum(self, runs: list[slice]) -> Tensor:
        """:meth:`rows_sum` over the examples of ``runs`` (from :func:`row_runs`, so that
        several layers share one host read of the rows)."""
        return summed(self.select(run).total() for run in runs)

    @abstractmethod
    def scaled(self, factor: float | Tensor) -> Self:
        """``factor`` times the per-example gradients."""

    def dot(self, vector: Tensor) -> Tensor:
        """``(B,)`` inner products ``<dW_i, v>`` with one ``(D,)`` vector (a target
        gradient in this layer's flattened layout), in the accumulation dtype."""
        grads = self.materialize()
        return grads @ vector.to(grads.dtype)

    def dot_costs(self, vector_factors: PerExampleGrad) -> dict[Route, float]:
        """Cost estimate of :meth:`dot` with a vector ``v`` that is also known as the
        summed per-example gradients ``vector_factors``: the product with ``v``
        (materialized route, ``~ B T D`` for factors) or the ghost dot against the
        factors, summed over their examples (factorized route, where it exists)."""
        factorized = self.gram_costs(vector_factors).get(Route.FACTORIZED)
        costs = {Route.MATERIALIZED: self._materialize_flops()}
        return costs if factorized is None else {**costs, Route.FACTORIZED: factorized}

    def score_and_sum_costs(
        self, vector_factors: PerExampleGrad | None, rows: float
    ) -> dict[Route, float]:
        """Cost estimate of what data selection does with a step's gradients: a
        :meth:`dot` of every example with one vector (also known as the summed gradients
        ``vector_factors``, where given), then the sum of ``rows`` of the examples.
        Factorized: both on this representation as it is, the cheaper dot route plus the
        rows' share of one weight-gradient product; materialized: the ``(B, D)`` gradients
        built once (``B T D`` for factors), both read from them (``~ B D``). A
        representation that is already materialized stays as it is."""
        dots = {Route.MATERIALIZED: self._materialize_flops()}
        if vector_factors is not None:
            dots = self.dot_costs(vector_factors)
        share = self._materialize_flops() * rows / max(self.batch_size, 1)
        return {
            Route.FACTORIZED: min(dots.values()) + share,
            Route.MATERIALIZED: self._materialize_flops() + self.batch_size * self.dim,
        }

    @classmethod
    @abstractmethod
    def stack(cls, parts: list[Self]) -> Self:
        """Concatenate several micro-batches of one layer along the example axis."""

    def nbytes(self) -> int:
        """Bytes held by this record's tensors."""
        return unique_nbytes([self])

    # Operations: each returns {route: flops} and implements the factorized route; the
    # materialized route is shared below.
    def gram_costs(self, other: PerExampleGrad) -> dict[Route, float]:
        """Cost estimate of the ``B1 x B2`` cross-Gram per route."""
        return self._materialized_gram_cost(other)

    def _materialized_gram_cost(self, other: PerExampleGrad) -> dict[Route, float]:
        return {
            Route.MATERIALIZED: self._materialize_flops()
            + other._materialize_flops()
            + self.batch_size * other.batch_size * self.dim
        }

    def gram_factorized(self, other: PerExampleGrad) -> Tensor:
        """``(B1, B2)`` inner products without materializing; only where costs list it."""
        raise NotImplementedError(f"{type(self).__name__} has no factorized Gram")

    def split_bias(self) -> tuple[PerExampleGrad, Tensor] | None:
        """``(weight part, (B, N_o) bias gradients)`` where a layer's bias column can be
        taken apart without copying the weight part, else ``None`` (then the gradients
        are used whole, bias column interleaved)."""
        return None

    def gram_materialized(self, other: PerExampleGrad) -> Tensor:
        """``(B1, B2)`` inner products of the materialized gradients."""
        mine, theirs = self.materialize(), other.materialize()
        dtype = torch.promote_types(mine.dtype, theirs.dtype)
        return mine.to(dtype) @ theirs.to(dtype).T

    def row_blocks(self, width: int, dtype: torch.dtype) -> Callable[[slice], Tensor]:
        """``rows -> (B, r width)``: the output rows ``rows`` of the materialized gradients
        seen as ``(B, D / width, width)``, in ``dtype``. Here they are materialized once and
        sliced; factor representations build each block on demand instead, into memory
        that the next block reuses: use a block before asking for the next."""
        values = self.materialize().to(dtype)
        return lambda rows: values[:, rows.start * width : rows.stop * width]

    def add_squared_entries(self, total: Tensor) -> Tensor:
        """``total += sum_i dW_i * dW_i`` (entrywise) for an ``(N_o, N_i)`` total, usually
        fp64 (EK-FAC's eigenvalue correction); returns ``total``.

        Built a block of output rows at a time (:meth:`row_blocks`) and squared while the
        block is in cache: no ``(B, D)`` materialized copy, fp64 copy or square of it
        travels through memory. Each square and its sum over the ``B`` examples are in
        the accumulation dtype; only the running total is in ``total``'s dtype.
        """
        n_o, width = total.shape
        dtype = values_dtype(self)
        blocks = self.row_blocks(width, dtype)
        row_bytes = self.batch_size * width * dtype.itemsize
        for rows in output_blocks(n_o, row_bytes, total):
            # out of place: a block may be a view of the representation's own values
            total[rows] += blocks(rows).view(self.batch_size, -1, width).square().sum(dim=0)
        return total

    def sq_norm_costs(self) -> dict[Route, float]:
        """FLOP estimate of the ``(B,)`` squared norms per route."""
        return {Route.MATERIALIZED: self._materialize_flops() + self.batch_size * self.dim}

    def sq_norms_factorized(self) -> Tensor:
        """``(B,)`` squared norms without materializing; only where costs list it."""
        raise NotImplementedError(f"{type(self).__name__} has no factorized norm")

    def sq_norms_materialized(self) -> Tensor:
        """``(B,)`` squared norms of the materialized gradients."""
        return self.materialize().pow(2).sum(dim=1)

    def token_score_costs(self, query: PerExampleGrad) -> dict[Route, float]:
        """FLOP estimate of per-token scores against ``query`` per route."""
        raise TypeError(
            f"per-token scores need a per-token representation, but this layer is captured "
            f"as {type(self).__name__}; capture it without a dense projection"
        )

    def token_scores_factorized(self, query: PerExampleGrad) -> Tensor:
        """``(B1, B2, T1)`` token scores without materializing the query."""
        raise NotImplementedError

    def token_scores_materialized(self, query: PerExampleGrad) -> Tensor:
        """``(B1, B2, T1)`` token scores against the materialized query."""
        raise NotImplementedError

    def rotation_costs(
        self, out_dim: int, in_dim: int, *, out_form: RowForm = "dense"
    ) -> dict[Route, float]:
        """FLOP estimate per route of the rotated gradients ``U_out^T dW_i U_in`` of a
        layer whose gradient is ``(out_dim, in_dim)``, ``U_out`` of form ``out_form``
        (:func:`row_form`)."""
        dense = self.batch_size * in_dim * (row_cost(out_dim, out_form) + out_dim * in_dim)
        return {Route.MATERIALIZED: self._materialize_flops() + dense}

    def rotated_factorized(self, u_out: Tensor | None, u_in: Tensor) -> PerExampleGrad:
        """The rotated gradients as rotated factors, not materialized; only where costs
        list it."""
        raise NotImplementedError(f"{type(self).__name__} has no factorized rotation")

    def rotated_materialized(self, u_out: Tensor | None, u_in: Tensor) -> Tensor:
        """``(B, N_o N_i')`` rotated gradients ``U_out^T dW_i U_in`` of the materialized
        gradients, in the accumulation dtype (``u_out`` as in :func:`rotate_rows`)."""
        dw = self.materialize()
        dw = dw.view(self.batch_size, -1, u_in.shape[0])
        if u_out is not None and u_out.dim() == 2:
            dw = u_out.to(dw.dtype).T @ dw
        elif u_out is not None:
            dw = dw * u_out.to(dw.dtype).unsqueeze(1)
        return (dw @ u_in.to(dw.dtype)).flatten(1)

    @abstractmethod
    def _materialize_flops(self) -> float:
        """FLOPs of :meth:`materialize`."""

    def _check_dim(self, other: PerExampleGrad) -> None:
        if other.dim != self.dim:
            raise ValueError(
                f"cannot compare gradients of dimension {self.dim} with dimension {other.dim}: "
                "train and query gradients must be captured with the same layers and projection"
            )

    def _check_pair(self, other: PerExampleGrad) -> None:
        if type(other) is not type(self) or other.dim != self.dim:
            raise ValueError(
                f"cannot compare a {type(self).__name__} of dimension {self.dim} with a "
                f"{type(other).__name__} of dimension {other.dim}: train and query gradients "
                "must be captured with the same layers and projection"
            )


def unique_nbytes(grads: list[PerExampleGrad]) -> int:
    """Bytes held by the tensors of ``grads``, each storage counted once (layers fed by one
    input share its factor)."""
    storages: dict[int, int] = {}

    def count(t: Tensor) -> Tensor:
        storage = t.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
        return t

    for g in grads:
        g.map_tensors(count)
    return sum(storages.values())

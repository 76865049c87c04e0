"""Per-example gradient representations of one layer, and the operations on them.

Three representations cover every layer type the engine captures:

* :class:`TokenFactors` -- a weight ``W`` of shape ``(N_o, N_i)`` whose per-example gradient
  is ``dW_i = sum_t g_it a_it^T`` (linear, Conv1D, LoRA, factor-projected layers).
* :class:`EmbeddingFactors` -- an embedding table whose per-example gradient scatters
  ``g_it`` into the rows named by the token ids.
* :class:`DenseGrad` -- an already materialized per-example gradient (norm scales, dense
  projections).

Each representation answers the operations consumers need (materialize, squared norms,
train x query cross-Gram, per-token scores) with a cost estimate per route (multiply-adds,
the formulas of docs/design.md section 3); the functions
in :mod:`tda_plugins.grads.ops` let :func:`~tda_plugins.grads.routing.choose_route` pick
the cheaper one. Products are accumulated in fp32 (fp64 when the factors are fp64),
whatever dtype the factors were captured in.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Self

import torch
from torch import Tensor

from tda_plugins.grads.routing import Route
from tda_plugins.grads.workspace import Workspace

#: Largest intermediate (elements) a factorized Gram builds at once; bigger ones are chunked.
_GRAM_CHUNK_ELEMENTS = 1 << 24


def accumulation_dtype(t: Tensor) -> torch.dtype:
    """fp64 for fp64 inputs, fp32 for everything else (bf16/fp16/fp32)."""
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _pad_tokens(t: Tensor, tokens: int) -> Tensor:
    """Pad ``(B, T, ...)`` with zero token rows to ``tokens``: zero rows add nothing."""
    if t.shape[1] == tokens:
        return t
    return torch.cat([t, t.new_zeros(t.shape[0], tokens - t.shape[1], *t.shape[2:])], dim=1)


def _stack_tokens(tensors: list[Tensor]) -> Tensor:
    tokens = max(t.shape[1] for t in tensors)
    return torch.cat([_pad_tokens(t, tokens) for t in tensors])


TensorKey = tuple[int, tuple[int, ...], tuple[int, ...]]


def tensor_key(t: Tensor) -> TensorKey:
    """Identifies the memory a tensor views: layers fed by one input share its key."""
    return (t.data_ptr(), tuple(t.shape), t.stride())


def row_runs(rows: Tensor) -> list[slice]:
    """``(n,)`` distinct indices -> the slices of their runs of consecutive ones
    (``[0, 1, 2, 5, 6] -> [0:3, 5:7]``; none: one empty slice); slicing a tensor by them
    gives views."""
    runs: list[slice] = []
    for i in rows.tolist():
        if runs and runs[-1].stop == i:
            runs[-1] = slice(runs[-1].start, i + 1)
        else:
            runs.append(slice(i, i + 1))
    return runs or [slice(0, 0)]


def summed(parts: Iterable[Tensor]) -> Tensor:
    """The sum of one or more tensors, added into the first (which must be a fresh one)."""
    it = iter(parts)
    out = next(it)
    for part in it:
        out += part
    return out


def spans(total: int, step: int) -> list[slice]:
    """``[0, total)`` cut into consecutive slices of ``step`` (the last one shorter)."""
    return [slice(i, min(i + step, total)) for i in range(0, total, step)]


#: Bytes of one block of materialized gradients in a blocked product on a CPU (about a
#: core's share of the last-level cache); other devices take one block.
_CPU_BLOCK_BYTES = 1 << 21
#: Fewest output rows in a block: narrower products run far below peak (on the peer
#: benchmark's layer shapes, 128 rows made the blocked cross-Gram 10-45% faster than 32)...
_MIN_BLOCK_ROWS = 128
#: ... unless that block would pass this many bytes (wide rows of large batches: 128 rows
#: of a 1536-input layer for 256 + 256 examples are 400 MB); then fewer rows, down to
_MAX_BLOCK_BYTES = 1 << 26
#: rows (below them the per-example products that build a block slow down).
_FEWEST_BLOCK_ROWS = 32


def _tensors_of(grads: PerExampleGrad) -> list[Tensor]:
    """The tensors a representation holds."""
    found: list[Tensor] = []

    def note(t: Tensor) -> Tensor:
        found.append(t)
        return t

    grads.map_tensors(note)
    return found


def values_dtype(grads: PerExampleGrad) -> torch.dtype:
    """The accumulation dtype of a representation's materialized values: fp64 when any of
    its floating tensors is fp64, else fp32."""
    dtypes = {t.dtype for t in _tensors_of(grads)}
    return torch.float64 if torch.float64 in dtypes else torch.float32


def empty_values(grads: PerExampleGrad, rows: int) -> Tensor:
    """An uninitialized ``(rows, D)`` tensor for materialized gradients of ``grads``' layer:
    its accumulation dtype (:func:`values_dtype`), on its device."""
    device = _tensors_of(grads)[0].device
    return torch.empty(rows, grads.dim, dtype=values_dtype(grads), device=device)


def _output_blocks(out_dim: int, row_bytes: int, like: Tensor) -> list[slice]:
    """Slices of ``out_dim`` output rows, each ``row_bytes`` bytes per row once
    materialized, sized to stay in cache on a CPU; one slice on other devices."""
    if like.device.type != "cpu":
        return [slice(0, out_dim)]
    row_bytes = max(row_bytes, 1)
    step = max(_MIN_BLOCK_ROWS, _CPU_BLOCK_BYTES // row_bytes)
    step = min(step, max(_FEWEST_BLOCK_ROWS, _MAX_BLOCK_BYTES // row_bytes))
    return spans(out_dim, step)


def _row_chunks(rows: int, cols: int) -> list[slice]:
    """Split ``rows`` so that each ``chunk x cols`` block stays under the chunk budget."""
    step = max(1, _GRAM_CHUNK_ELEMENTS // max(cols, 1))
    return spans(rows, step)


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
        for rows in _output_blocks(n_o, row_bytes, total):
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

    def rotation_costs(self, out_dim: int, in_dim: int) -> dict[Route, float]:
        """FLOP estimate per route of the rotated gradients ``U_out^T dW_i U_in`` of a
        layer whose gradient is ``(out_dim, in_dim)``."""
        dense = self.batch_size * out_dim * in_dim * (out_dim + in_dim)
        return {Route.MATERIALIZED: self._materialize_flops() + dense}

    def rotated_factorized(self, u_out: Tensor, u_in: Tensor) -> PerExampleGrad:
        """The rotated gradients as rotated factors, not materialized; only where costs
        list it."""
        raise NotImplementedError(f"{type(self).__name__} has no factorized rotation")

    def rotated_materialized(self, u_out: Tensor, u_in: Tensor) -> Tensor:
        """``(B, N_o N_i')`` rotated gradients ``U_out^T dW_i U_in`` of the materialized
        gradients, in the accumulation dtype."""
        dw = self.materialize()
        dw = dw.view(-1, u_out.shape[0], u_in.shape[0])
        return (u_out.to(dw.dtype).T @ dw @ u_in.to(dw.dtype)).flatten(1)

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


class PerTokenGrad(PerExampleGrad):
    """A representation that keeps one factor pair per token (``T`` rows per example)."""

    @property
    @abstractmethod
    def tokens(self) -> int:
        """``T``, the number of token rows per example."""

    @abstractmethod
    def _token_pair_products(self, other: Self, rows: slice) -> Tensor:
        """``(b1, T1, B2, T2)`` inner products of token contributions, for examples ``rows``."""

    def _chunked(self, other: Self, reduce: Callable[[Tensor], Tensor]) -> Tensor:
        cols = self.tokens * other.batch_size * other.tokens
        parts = [
            reduce(self._token_pair_products(other, rows))
            for rows in _row_chunks(self.batch_size, cols)
        ]
        return torch.cat(parts, dim=0)

    def gram_factorized(self, other: PerExampleGrad) -> Tensor:
        return self._chunked(self._same(other), lambda p: p.sum(dim=(1, 3)))

    def token_scores_factorized(self, query: PerExampleGrad) -> Tensor:
        return self._chunked(self._same(query), lambda p: p.sum(dim=3).transpose(1, 2))

    def _same(self, other: PerExampleGrad) -> Self:
        self._check_pair(other)
        return other  # type: ignore[return-value]

    # A DenseGrad query (a preconditioned or projected-dense gradient of the same layer)
    # has no tokens: only the materialized routes apply to it.
    def gram_costs(self, other: PerExampleGrad) -> dict[Route, float]:
        if isinstance(other, DenseGrad):
            self._check_dim(other)
            return self._materialized_gram_cost(other)
        return self._factor_gram_costs(self._same(other))

    def token_score_costs(self, query: PerExampleGrad) -> dict[Route, float]:
        if isinstance(query, DenseGrad):
            self._check_dim(query)
            rows = self.batch_size * self.tokens * query.batch_size
            return {Route.MATERIALIZED: rows * self._token_width()}
        return self._factor_token_score_costs(self._same(query))

    @abstractmethod
    def _factor_gram_costs(self, other: Self) -> dict[Route, float]:
        """Costs against a capture of the same representation."""

    @abstractmethod
    def _factor_token_score_costs(self, query: Self) -> dict[Route, float]:
        """Token-score costs against a capture of the same representation."""

    @abstractmethod
    def _token_width(self) -> int:
        """Multiply-adds to score one token against one materialized query."""


@dataclass
class TokenFactors(PerTokenGrad):
    """Per-token factors of a weight gradient: ``dW_i = sum_t g_it [a_it; 1]^T``.

    Attributes:
        a: ``(B, T, N_i)`` layer inputs, in the dtype they were captured in.
        g: ``(B, T, N_o)`` gradients of the backpropagated loss w.r.t. the layer outputs.
        bias: when true, a constant 1 is appended to every ``a_it`` (virtually: it is
            never stored), so the last column of the materialized ``(N_o, N_i + 1)``
            gradient is the bias gradient ``sum_t g_it``.
    """

    a: Tensor
    g: Tensor
    bias: bool = False

    @property
    def batch_size(self) -> int:
        return self.a.shape[0]

    @property
    def tokens(self) -> int:
        return self.a.shape[1]

    @property
    def in_dim(self) -> int:
        """``N_i`` plus one when the bias is appended."""
        return self.a.shape[2] + int(self.bias)

    @property
    def out_dim(self) -> int:
        return self.g.shape[2]

    @property
    def dim(self) -> int:
        return self.in_dim * self.out_dim

    def augmented_a(self, rows: slice | None = None) -> Tensor:
        """``(B, T, N_i [+1])`` inputs in the accumulation dtype, bias column appended (a
        copy when there is one); of the examples ``rows`` only, when given."""
        a = self.a if rows is None else self.a[rows]
        a = a.to(accumulation_dtype(a))
        if not self.bias:
            return a
        return torch.cat([a, a.new_ones(*a.shape[:2], 1)], dim=2)

    def materialize(self) -> Tensor:
        g = self.g.to(accumulation_dtype(self.g))
        return torch.bmm(g.transpose(1, 2), self.augmented_a()).reshape(self.batch_size, -1)

    def materialize_into(self, out: Tensor) -> Tensor:
        g = self.g.to(accumulation_dtype(self.g))
        shape = (self.batch_size, self.out_dim, self.in_dim)
        torch.bmm(g.transpose(1, 2), self.augmented_a(), out=out.view(shape))
        return out

    def merge_call(self, other: TokenFactors) -> TokenFactors:
        return TokenFactors(
            torch.cat([self.a, other.a], dim=1), torch.cat([self.g, other.g], dim=1), self.bias
        )

    def split_bias(self) -> tuple[TokenFactors, Tensor] | None:
        if not self.bias:
            return None
        return TokenFactors(self.a, self.g), self.g.to(accumulation_dtype(self.g)).sum(dim=1)

    def gram_materialized(self, other: PerExampleGrad) -> Tensor:
        # The same products as materializing both sides, but each side is built a block of
        # output rows at a time (a factor side as dW_i[rows] = g_i[:, rows]^T a_i) and the
        # two blocks are multiplied while they are still in cache: no (B, D) gradients of
        # a factor side travel through memory, or are held at all (on a CPU, the plain
        # product of two (B, D) matrices costs as much as materializing one of them).
        dtype = torch.promote_types(values_dtype(self), values_dtype(other))
        out = self.g.new_zeros(self.batch_size, other.batch_size, dtype=dtype)
        theirs = other.split_bias()
        mine = None if theirs is None else self.split_bias()
        if mine is not None and theirs is not None:
            # Two factor sides: the bias columns' products are one (B1, N_o) x (N_o, B2)
            # product of the token sums of g, and the blocks leave them out (a block with
            # its bias column is not one contiguous product and needs a second buffer).
            torch.mm(mine[1].to(dtype), theirs[1].to(dtype).T, out=out)
            return mine[0]._add_blocked_gram(theirs[0], out)
        return self._add_blocked_gram(other, out)

    def _add_blocked_gram(self, other: PerExampleGrad, out: Tensor) -> Tensor:
        """``out += `` the ``(B1, B2)`` cross-Gram, a block of output rows at a time."""
        width = self.in_dim
        mine, theirs = self.row_blocks(width, out.dtype), other.row_blocks(width, out.dtype)
        row_bytes = (self.batch_size + other.batch_size) * width * out.element_size()
        for rows in _output_blocks(self.out_dim, row_bytes, out):
            out.addmm_(mine(rows), theirs(rows).T)
        return out

    def row_blocks(self, width: int, dtype: torch.dtype) -> Callable[[slice], Tensor]:
        if width != self.in_dim:
            raise ValueError(
                f"row blocks of width {width} asked of factors whose rows are {self.in_dim} "
                "wide: both sides of a product must be captured with the same layer shape"
            )
        # The bias column of a block is its rows' sum over tokens, written beside the
        # product: no (B, T, N_i + 1) augmented copy of the inputs is made. Every block is
        # written into the same kept buffers (the first block is the largest): blocks of
        # tens of MB allocated afresh each time would leave the allocator's heap holding
        # several of them.
        a, g = self.a.to(dtype), self.g.to(dtype)
        n_i, batch = a.shape[2], self.batch_size
        kept = Workspace()

        def block(rows: slice) -> Tensor:
            g_rows = g[:, :, rows].transpose(1, 2)  # (B, r, T)
            r = g_rows.shape[1]
            if not self.bias:
                (out,) = kept.carve([(batch, r, n_i)], dtype, a.device)
                return torch.bmm(g_rows, a, out=out).view(batch, -1)
            out, product = kept.carve([(batch, r, n_i + 1), (batch, r, n_i)], dtype, a.device)
            out[:, :, :n_i] = torch.bmm(g_rows, a, out=product)
            torch.sum(g_rows, dim=2, out=out[:, :, n_i])
            return out.view(batch, -1)

        return block

    def map_tensors(self, fn: Callable[[Tensor], Tensor]) -> TokenFactors:
        return TokenFactors(fn(self.a), fn(self.g), self.bias)

    def weighted_sum(self, weights: Tensor) -> Tensor:
        g = (
            self.g.to(accumulation_dtype(self.g))
            * weights.to(accumulation_dtype(self.g))[:, None, None]
        )
        a = self.augmented_a()
        return (g.reshape(-1, self.out_dim).T @ a.reshape(-1, self.in_dim)).flatten()

    def total(self) -> Tensor:
        # No weights to apply: one product over every token.
        g = self.g.to(accumulation_dtype(self.g)).reshape(-1, self.out_dim)
        return (g.T @ self.augmented_a().reshape(-1, self.in_dim)).flatten()

    def runs_sum(self, runs: list[slice]) -> Tensor:
        # One (N_o, N_i) output that every run's product adds into (addmm_): a separate
        # product per run and a sum of them would write and read the output once more per
        # run (for an 8000-row head, ~40% of the runs' time on a CPU).
        out: Tensor | None = None
        for run in runs:
            part = self.select(run)  # views of the run's examples
            g = part.g.to(accumulation_dtype(part.g)).reshape(-1, self.out_dim).T
            a = part.augmented_a().reshape(-1, self.in_dim)
            out = g @ a if out is None else out.addmm_(g, a)
        assert out is not None  # row_runs gives at least one (possibly empty) run
        return out.flatten()

    def scaled(self, factor: float | Tensor) -> TokenFactors:
        return TokenFactors(self.a, self.g * factor, self.bias)

    def dot(self, vector: Tensor) -> Tensor:
        # sum_t g_it^T V a_it: one (B*T, N_o) x (N_o, N_i) product, no (B, D) tensor, whose
        # result is taken on the narrower side (V a_it when N_o < N_i, else g_it^T V).
        g = self.g.to(accumulation_dtype(self.g)).reshape(self.batch_size, -1, self.out_dim)
        a = self.a.to(accumulation_dtype(self.a))
        v = vector.to(g.dtype).view(self.out_dim, self.in_dim)
        weight, bias = (v[:, :-1], v[:, -1]) if self.bias else (v, None)
        if self.out_dim < self.in_dim:
            h = a @ weight.T if bias is None else torch.addmm(bias, a.flatten(0, 1), weight.T)
            return (h.view_as(g) * g).sum(dim=(1, 2))
        h = g @ weight
        out = (h * a).sum(dim=(1, 2))
        return out if bias is None else out + (g @ bias).sum(dim=1)

    @classmethod
    def stack(cls, parts: list[TokenFactors]) -> TokenFactors:
        a = _stack_tokens([p.a for p in parts])
        return TokenFactors(a, _stack_tokens([p.g for p in parts]), parts[0].bias)

    def _materialize_flops(self) -> float:
        return self.batch_size * self.tokens * self.dim

    def _factor_gram_costs(self, other: Self) -> dict[Route, float]:
        pairs = self.batch_size * other.batch_size * self.tokens * other.tokens
        return {
            Route.FACTORIZED: pairs * (self.in_dim + self.out_dim),
            **self._materialized_gram_cost(other),
        }

    def _token_pair_products(self, other: TokenFactors, rows: slice) -> Tensor:
        """``(b1, T1, B2, T2)`` products ``(a_it . a_js)(g_it . g_js)`` for examples ``rows``."""
        a1, g1 = self.augmented_a(rows), self.g[rows].to(accumulation_dtype(self.g))
        a2, g2 = other.augmented_a(), other.g.to(accumulation_dtype(other.g))
        ka = a1.reshape(-1, a1.shape[2]) @ a2.reshape(-1, a2.shape[2]).T
        kg = g1.reshape(-1, g1.shape[2]) @ g2.reshape(-1, g2.shape[2]).T
        return (ka * kg).view(a1.shape[0], self.tokens, other.batch_size, other.tokens)

    @staticmethod
    def shared_input_dots(grads: list[TokenFactors], targets: list[TokenFactors]) -> list[Tensor]:
        """Per layer ``l``, the ``(B1,)`` ghost dots ``<dW_i^l, sum_j dV_j^l>`` of bias-free
        layers whose training factors share one input ``a`` (``grads[l].a``) and whose
        target factors share one input ``a'``: the input Gram ``a a'^T``, ``(B1 T1, B2 T2)``,
        is computed once for all of them, each layer adding only its output Gram. The
        same as ``grads[l].gram_factorized(targets[l]).sum(dim=1)``."""
        for g, t in zip(grads, targets, strict=True):
            g._check_pair(t)
        a1, a2 = grads[0].augmented_a(), targets[0].augmented_a()
        a2 = a2.reshape(-1, a2.shape[2])
        outputs = [
            (g.g.to(a1.dtype), t.g.to(a1.dtype).reshape(-1, t.out_dim))
            for g, t in zip(grads, targets, strict=True)
        ]
        parts: list[list[Tensor]] = [[] for _ in grads]
        for rows in _row_chunks(grads[0].batch_size, grads[0].tokens * a2.shape[0]):
            ka = a1[rows].reshape(-1, a1.shape[2]) @ a2.T
            for part, (g1, g2) in zip(parts, outputs, strict=True):
                kg = g1[rows].reshape(-1, g1.shape[2]) @ g2.T
                part.append((ka * kg).view(g1[rows].shape[0], -1).sum(dim=1))
        return [torch.cat(p) for p in parts]

    def sq_norm_costs(self) -> dict[Route, float]:
        per_example = self.tokens * self.tokens * (self.in_dim + self.out_dim)
        return {Route.FACTORIZED: self.batch_size * per_example, **super().sq_norm_costs()}

    def sq_norms_factorized(self) -> Tensor:
        a, g = self.augmented_a(), self.g.to(accumulation_dtype(self.g))
        return (torch.bmm(a, a.transpose(1, 2)) * torch.bmm(g, g.transpose(1, 2))).sum(dim=(1, 2))

    def _factor_token_score_costs(self, query: Self) -> dict[Route, float]:
        pairs = self.batch_size * query.batch_size * self.tokens * query.tokens
        rows = self.batch_size * self.tokens * query.batch_size
        return {
            Route.FACTORIZED: pairs * (self.in_dim + self.out_dim),
            Route.MATERIALIZED: query._materialize_flops() + rows * self._token_width(),
        }

    def _token_width(self) -> int:
        return self.dim

    def rotation_costs(self, out_dim: int, in_dim: int) -> dict[Route, float]:
        rotate = self.batch_size * self.tokens * (out_dim * out_dim + in_dim * in_dim)
        return {
            Route.FACTORIZED: rotate + self._materialize_flops(),
            **super().rotation_costs(out_dim, in_dim),
        }

    def rotated_factorized(self, u_out: Tensor, u_in: Tensor) -> TokenFactors:
        # U_out^T dW_i U_in = sum_t (U_out^T g_it)(U_in^T [a_it; 1])^T: each token's factors
        # rotated (the bias column rotates with the inputs, so it is explicit here), never
        # the dense rotation.
        a = self.augmented_a()
        g = self.g.to(accumulation_dtype(self.g))
        return TokenFactors(a @ u_in.to(a.dtype), g @ u_out.to(g.dtype))

    def token_scores_materialized(self, query: PerExampleGrad) -> Tensor:
        b2, n_o, n_i = query.batch_size, self.out_dim, self.in_dim
        q = query.materialize().view(b2, n_o, n_i).permute(1, 0, 2).reshape(n_o, b2 * n_i)
        g = self.g.to(accumulation_dtype(self.g)).reshape(-1, n_o)
        h = (g @ q).view(-1, b2, n_i)
        a = self.augmented_a().reshape(-1, 1, n_i)
        return (h * a).sum(dim=2).view(self.batch_size, self.tokens, b2).transpose(1, 2)


@dataclass
class EmbeddingFactors(PerTokenGrad):
    """Per-token factors of an embedding gradient: row ``ids_it`` receives ``g_it``.

    Attributes:
        ids: ``(B, T)`` int64 token ids.
        g: ``(B, T, D)`` gradients w.r.t. the looked-up rows (zero at ``padding_idx``).
        num_embeddings: ``V``, rows of the table; the materialized gradient is ``(V, D)``.
    """

    ids: Tensor
    g: Tensor
    num_embeddings: int

    @property
    def batch_size(self) -> int:
        return self.ids.shape[0]

    @property
    def tokens(self) -> int:
        return self.ids.shape[1]

    @property
    def dim(self) -> int:
        return self.num_embeddings * self.g.shape[2]

    def _g(self) -> Tensor:
        return self.g.to(accumulation_dtype(self.g))

    def materialize(self) -> Tensor:
        g = self._g()
        out = g.new_zeros(self.batch_size, self.num_embeddings, g.shape[2])
        out.scatter_add_(1, self.ids.unsqueeze(2).expand_as(g), g)
        return out.reshape(self.batch_size, -1)

    def merge_call(self, other: EmbeddingFactors) -> EmbeddingFactors:
        return EmbeddingFactors(
            torch.cat([self.ids, other.ids], dim=1),
            torch.cat([self.g, other.g], dim=1),
            self.num_embeddings,
        )

    def map_tensors(self, fn: Callable[[Tensor], Tensor]) -> EmbeddingFactors:
        return EmbeddingFactors(fn(self.ids), fn(self.g), self.num_embeddings)

    def weighted_sum(self, weights: Tensor) -> Tensor:
        return self._scattered(self._g() * weights.to(self._g().dtype)[:, None, None])

    def total(self) -> Tensor:
        return self._scattered(self._g())

    def runs_sum(self, runs: list[slice]) -> Tensor:
        # One (V, D) table that every run's tokens are added into, instead of a zeroed
        # table per run and their sum.
        out = self.g.new_zeros(
            self.num_embeddings, self.g.shape[2], dtype=accumulation_dtype(self.g)
        )
        for run in runs:
            part = self.select(run)  # views of the run's examples
            out.index_add_(0, part.ids.reshape(-1), part._g().reshape(-1, out.shape[1]))
        return out.flatten()

    def _scattered(self, g: Tensor) -> Tensor:
        """``(B, T, D)`` token gradients added into their rows: the ``(V D,)`` sum."""
        out = g.new_zeros(self.num_embeddings, g.shape[2])
        out.index_add_(0, self.ids.reshape(-1), g.reshape(-1, g.shape[2]))
        return out.flatten()

    def scaled(self, factor: float | Tensor) -> EmbeddingFactors:
        return EmbeddingFactors(self.ids, self.g * factor, self.num_embeddings)

    def dot(self, vector: Tensor) -> Tensor:
        # sum_t g_it . V[ids_it]: a gather of the looked-up rows, no (B, V*D) tensor.
        g = self._g()
        rows = vector.to(g.dtype).view(self.num_embeddings, -1)[self.ids]
        return (g * rows).sum(dim=(1, 2))

    @classmethod
    def stack(cls, parts: list[EmbeddingFactors]) -> EmbeddingFactors:
        ids = _stack_tokens([p.ids for p in parts])
        return EmbeddingFactors(ids, _stack_tokens([p.g for p in parts]), parts[0].num_embeddings)

    def _materialize_flops(self) -> float:
        return float(self.batch_size * self.tokens * self.g.shape[2])

    def _token_pair_products(self, other: EmbeddingFactors, rows: slice) -> Tensor:
        same = (self.ids[rows].reshape(-1, 1) == other.ids.reshape(1, -1)).to(self.g.dtype)
        g1, g2 = self._g()[rows], other._g()
        kg = g1.reshape(-1, g1.shape[2]) @ g2.reshape(-1, g2.shape[2]).T
        return (same.to(kg.dtype) * kg).view(g1.shape[0], self.tokens, other.batch_size, -1)

    def _factor_gram_costs(self, other: Self) -> dict[Route, float]:
        pairs = self.batch_size * other.batch_size * self.tokens * other.tokens
        return {
            Route.FACTORIZED: pairs * (self.g.shape[2] + 1),
            **self._materialized_gram_cost(other),
        }

    def sq_norm_costs(self) -> dict[Route, float]:
        per_example = self.tokens * self.tokens * (self.g.shape[2] + 1)
        return {Route.FACTORIZED: self.batch_size * per_example, **super().sq_norm_costs()}

    def sq_norms_factorized(self) -> Tensor:
        g = self._g()
        same = (self.ids.unsqueeze(2) == self.ids.unsqueeze(1)).to(g.dtype)
        return (same * torch.bmm(g, g.transpose(1, 2))).sum(dim=(1, 2))

    def _factor_token_score_costs(self, query: Self) -> dict[Route, float]:
        pairs = self.batch_size * query.batch_size * self.tokens * query.tokens
        rows = self.batch_size * self.tokens * query.batch_size
        return {
            Route.FACTORIZED: pairs * (self.g.shape[2] + 1),
            Route.MATERIALIZED: query._materialize_flops() + rows * self._token_width(),
        }

    def _token_width(self) -> int:
        return self.g.shape[2]

    def token_scores_materialized(self, query: PerExampleGrad) -> Tensor:
        q = query.materialize().view(query.batch_size, self.num_embeddings, -1)
        rows = q[:, self.ids]  # (B2, B1, T1, D): the query gradient at each train token's row
        return torch.einsum("btd,cbtd->bct", self._g(), rows)


@dataclass
class DenseGrad(PerExampleGrad):
    """Materialized per-example gradients.

    Attributes:
        values: ``(B, D)`` per-example gradients, flattened over the layer's parameters in
            the order its adapter documents.
    """

    values: Tensor

    @property
    def batch_size(self) -> int:
        return self.values.shape[0]

    @property
    def dim(self) -> int:
        return self.values.shape[1]

    def materialize(self) -> Tensor:
        return self.values.to(accumulation_dtype(self.values))

    def merge_call(self, other: DenseGrad) -> DenseGrad:
        return DenseGrad(self.values + other.values)

    def map_tensors(self, fn: Callable[[Tensor], Tensor]) -> DenseGrad:
        return DenseGrad(fn(self.values))

    def weighted_sum(self, weights: Tensor) -> Tensor:
        values = self.materialize()
        return weights.to(values.dtype) @ values

    def total(self) -> Tensor:
        return self.materialize().sum(dim=0)

    def scaled(self, factor: float | Tensor) -> DenseGrad:
        return DenseGrad(self.values * factor)

    @classmethod
    def stack(cls, parts: list[DenseGrad]) -> DenseGrad:
        return DenseGrad(torch.cat([p.values for p in parts]))

    def _materialize_flops(self) -> float:
        return 0.0

    def gram_costs(self, other: PerExampleGrad) -> dict[Route, float]:
        self._check_dim(other)
        return super().gram_costs(other)


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


def stack_examples(parts: list[PerExampleGrad]) -> PerExampleGrad:
    """Concatenate one layer's micro-batches along the example axis.

    Parts of one representation keep it; a mix (a store keeps whichever form is smaller
    per micro-batch) is materialized. A single part is returned as it is (no copy).
    """
    if len(parts) == 1:
        return parts[0]
    first = type(parts[0])
    if all(type(p) is first for p in parts):
        return first.stack(parts)
    return DenseGrad.stack([DenseGrad(p.materialize()) for p in parts])

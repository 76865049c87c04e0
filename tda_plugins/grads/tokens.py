"""Per-token representations: the shared Gram/token-score machinery (:class:`PerTokenGrad`)
and the linear layers' factors ``dW_i = sum_t g_it [a_it; 1]^T`` (:class:`TokenFactors`)."""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Self

import torch
from torch import Tensor

from tda_plugins.grads.base import PerExampleGrad, RowForm, rotate_rows, row_cost, values_dtype
from tda_plugins.grads.blocks import accumulation_dtype, output_blocks, row_chunks, stack_tokens
from tda_plugins.grads.dense import DenseGrad
from tda_plugins.grads.routing import Route
from tda_plugins.grads.workspace import Workspace


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
            for rows in row_chunks(self.batch_size, cols)
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
        for rows in output_blocks(self.out_dim, row_bytes, out):
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
        a = stack_tokens([p.a for p in parts])
        return TokenFactors(a, stack_tokens([p.g for p in parts]), parts[0].bias)

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
        for rows in row_chunks(grads[0].batch_size, grads[0].tokens * a2.shape[0]):
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

    def rotation_costs(
        self, out_dim: int, in_dim: int, *, out_form: RowForm = "dense"
    ) -> dict[Route, float]:
        rotate = self.batch_size * self.tokens * (row_cost(out_dim, out_form) + in_dim * in_dim)
        return {
            Route.FACTORIZED: rotate + self._materialize_flops(),
            **super().rotation_costs(out_dim, in_dim, out_form=out_form),
        }

    def rotated_factorized(self, u_out: Tensor | None, u_in: Tensor) -> TokenFactors:
        # U_out^T dW_i U_in = sum_t (U_out^T g_it)(U_in^T [a_it; 1])^T: each token's factors
        # rotated (the bias column rotates with the inputs, so it is explicit here), never
        # the dense rotation.
        a = self.augmented_a()
        g = self.g.to(accumulation_dtype(self.g))
        return TokenFactors(a @ u_in.to(a.dtype), rotate_rows(g, u_out))

    def token_scores_materialized(self, query: PerExampleGrad) -> Tensor:
        b2, n_o, n_i = query.batch_size, self.out_dim, self.in_dim
        q = query.materialize().view(b2, n_o, n_i).permute(1, 0, 2).reshape(n_o, b2 * n_i)
        g = self.g.to(accumulation_dtype(self.g)).reshape(-1, n_o)
        h = (g @ q).view(-1, b2, n_i)
        a = self.augmented_a().reshape(-1, 1, n_i)
        return (h * a).sum(dim=2).view(self.batch_size, self.tokens, b2).transpose(1, 2)

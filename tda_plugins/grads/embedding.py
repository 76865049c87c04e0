"""Embedding tables: the per-example gradient scatters ``g_it`` into the rows named by the
token ids (:class:`EmbeddingFactors`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Self

import torch
from torch import Tensor

from tda_plugins.grads.base import PerExampleGrad, RowForm, row_cost
from tda_plugins.grads.blocks import accumulation_dtype, stack_tokens
from tda_plugins.grads.routing import Route
from tda_plugins.grads.tokens import PerTokenGrad


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
        ids = stack_tokens([p.ids for p in parts])
        return EmbeddingFactors(ids, stack_tokens([p.g for p in parts]), parts[0].num_embeddings)

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

    def rotation_costs(
        self, out_dim: int, in_dim: int, *, out_form: RowForm = "dense"
    ) -> dict[Route, float]:
        costs = super().rotation_costs(out_dim, in_dim, out_form=out_form)
        if out_form == "dense":  # the vocabulary side rotated densely: no factor form
            return costs
        per_token = in_dim * in_dim + row_cost(1, out_form)
        return {Route.FACTORIZED: self.batch_size * self.tokens * per_token, **costs}

    def rotated_factorized(self, u_out: Tensor | None, u_in: Tensor) -> EmbeddingFactors:
        # diag(u) dE_i U_in = sum_t e_{id_it} (u[id_it] U_in^T g_it)^T: the same rows, each
        # token's gradient rotated and scaled by its row's entry; a dense vocabulary side
        # would mix rows, and is not offered (rotation_costs)
        g = self._g() @ u_in.to(self._g().dtype)
        if u_out is not None:
            if u_out.dim() != 1:
                raise ValueError("an embedding's factor rotation takes a diagonal row side")
            g = g * u_out.to(g.dtype)[self.ids].unsqueeze(2)
        return EmbeddingFactors(self.ids, g, self.num_embeddings)

    def row_blocks(self, width: int, dtype: torch.dtype) -> Callable[[slice], Tensor]:
        # Each block holds only the rows it covers: the tokens whose ids fall in it are
        # added there, so no (B, V D) table is built for the whole vocabulary.
        if width != self.g.shape[2]:
            raise ValueError(
                f"row blocks of width {width} asked of an embedding whose rows are "
                f"{self.g.shape[2]} wide"
            )
        g = self.g.to(dtype)

        def block(rows: slice) -> Tensor:
            out = g.new_zeros(self.batch_size, rows.stop - rows.start, width)
            inside = (self.ids >= rows.start) & (self.ids < rows.stop)
            example, token = inside.nonzero(as_tuple=True)
            row = self.ids[example, token] - rows.start
            out.index_put_((example, row), g[example, token], accumulate=True)
            return out.view(self.batch_size, -1)

        return block

    def add_squared_entries(self, total: Tensor) -> Tensor:
        # Only the rows an example looks up are non-zero in its gradient: each example's
        # tokens are summed into its distinct rows (one key per example and id), which are
        # squared and added to theirs; cost B T D, nothing of size V D per example.
        g = self._g().reshape(-1, self.g.shape[2])
        example = torch.arange(self.batch_size, device=self.ids.device).repeat_interleave(
            self.tokens
        )
        keys, slot = torch.unique(
            example * self.num_embeddings + self.ids.reshape(-1), return_inverse=True
        )
        rows = g.new_zeros(keys.shape[0], g.shape[1]).index_add_(0, slot, g)
        total.index_add_(0, keys % self.num_embeddings, rows.square().to(total.dtype))
        return total

    def token_scores_materialized(self, query: PerExampleGrad) -> Tensor:
        q = query.materialize().view(query.batch_size, self.num_embeddings, -1)
        rows = q[:, self.ids]  # (B2, B1, T1, D): the query gradient at each train token's row
        return torch.einsum("btd,cbtd->bct", self._g(), rows)

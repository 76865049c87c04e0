"""Embedding tables: the per-example gradient scatters ``g_it`` into the rows named by the
token ids (:class:`EmbeddingFactors`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Self

import torch
from torch import Tensor

from tda_plugins.grads.base import PerExampleGrad
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

    def token_scores_materialized(self, query: PerExampleGrad) -> Tensor:
        q = query.materialize().view(query.batch_size, self.num_embeddings, -1)
        rows = q[:, self.ids]  # (B2, B1, T1, D): the query gradient at each train token's row
        return torch.einsum("btd,cbtd->bct", self._g(), rows)

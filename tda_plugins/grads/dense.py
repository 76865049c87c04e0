"""Materialized per-example gradients (:class:`DenseGrad`: norm scales, dense projections,
preconditioned queries), and stacking micro-batches of any representation."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from tda_plugins.grads.base import PerExampleGrad
from tda_plugins.grads.blocks import accumulation_dtype
from tda_plugins.grads.routing import Route


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


def sum_of_uses(parts: list[PerExampleGrad]) -> PerExampleGrad:
    """The per-example gradients of one parameter used by several layers (a tied weight:
    its gradient is the sum of its uses', all in one layout), materialized and added; a
    single part as it is."""
    if len(parts) == 1:
        return parts[0]
    total = parts[0].materialize().clone()
    for part in parts[1:]:
        total += part.materialize()
    return DenseGrad(total)

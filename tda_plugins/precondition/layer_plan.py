"""One captured layer's line of the memory plan: its statistics, and what its records and
shards hold per token and per example (:mod:`~tda_plugins.precondition.plan`)."""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from tda_plugins.capture.adapters import LayerAdapter
from tda_plugins.capture.adapters.linear import LinearAdapter
from tda_plugins.grads.projection import ProjectionConfig
from tda_plugins.precondition.forms import FactorSpec


@dataclass(frozen=True)
class LayerPlan:
    """One captured layer.

    Attributes:
        name: module name.
        factors: the statistics it keeps (unpacks as the widths ``(n_a, n_s)`` of ``A``
            and ``S``); ``None`` when the layer gets none (see ``note``).
        note: why it gets none.
        owner: the rank that holds (and saves) its statistics.
        token_bytes: bytes its record holds per token (input and output-gradient factors;
            an input shared by several layers, as q/k/v's, is counted for each of them).
        example_bytes: bytes its record holds per example (materialized captures).
        dense_bytes: one example's materialized gradient, the most a shard stores for it.
        token_shard_bytes: per token, what a shard stores of its per-token factors.
    """

    name: str
    factors: FactorSpec | None
    note: str | None
    owner: int | None
    token_bytes: int
    example_bytes: int
    dense_bytes: int
    token_shard_bytes: int

    def statistics_numel(self) -> int:
        return 0 if self.factors is None else self.factors.numel


def layer_plan(
    name: str,
    module: nn.Module,
    adapter: LayerAdapter,
    projection: ProjectionConfig | None,
    spec: FactorSpec | str,
) -> LayerPlan:
    """One layer's statistics (``spec``, or why it has none) and what its records hold:
    per token for per-token factors, per example for a materialized capture (norm scales,
    dense projections)."""
    params = adapter.captured_parameters(module)
    accumulation = 8 if next(iter(params.values())).element_size() == 8 else 4
    if projection is not None and projection.kind == "dense":
        per_token, flat = 0, projection.k
    else:
        k = None if projection is None else (projection.k_a, projection.k_g)
        per_token, flat = _record_sizes(params, adapter, k)
    dense_bytes = accumulation * flat
    return LayerPlan(
        name=name,
        factors=spec if isinstance(spec, FactorSpec) else None,
        note=spec if isinstance(spec, str) else None,
        owner=None,
        token_bytes=per_token,
        example_bytes=0 if per_token else dense_bytes,
        dense_bytes=dense_bytes,
        token_shard_bytes=per_token,
    )


def _record_sizes(
    params: dict[str, nn.Parameter], adapter: LayerAdapter, k: tuple[int, int] | None
) -> tuple[int, int]:
    """Bytes per token of a layer's per-token factors (0: captured materialized), and the
    entries of its flat gradient, under factor projection to ``k = (k_a, k_g)`` if given:
    a linear layer's inputs and output gradients (a side no wider than its ``k`` kept),
    an embedding's int64 ids and output gradients (or both sides projected)."""
    weight = next(iter(params.values()))
    itemsize = weight.element_size()
    if isinstance(adapter, LinearAdapter) and "weight" in params:
        n_o, n_i = adapter.weight_layout(params["weight"]).shape
        in_dim, a_width = n_i + int("bias" in params), n_i
        if k is not None and k[0] < in_dim:
            in_dim = a_width = k[0]
        if k is not None and k[1] < n_o:
            n_o = k[1]
        return itemsize * (a_width + n_o), in_dim * n_o
    if adapter.family == "embedding":
        if k is not None:
            return itemsize * (k[0] + k[1]), k[0] * k[1]
        return 8 + itemsize * weight.shape[1], weight.numel()
    return 0, sum(p.numel() for p in params.values())
